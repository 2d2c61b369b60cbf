#!/usr/bin/env bash
# OpenMP's spin at a barrier, SmolLM2 as shipped, offline greedy (docs/results/session43-zen3/omp_wait_policy.py),
# each line a process of its own, the settings taking turns within each round:
#   libgomp's default (GOMP_SPINCOUNT 300,000), kvserve's command's default since session 47 (3,000), PASSIVE.
# "loaded": `yes > /dev/null` running beside it (another process busy on one of the two cores).
# usage: PYTHONPATH=<tree> ROUNDS=3 bash docs/results/session47-zen3/omp_spin.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
script="$here/../session43-zen3/omp_wait_policy.py"
run() {  # setting streams tokens
  case $1 in
    libgomp) env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=300000 python3 "$script" "$2" "$3" ;;
    bounded) env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=3000 python3 "$script" "$2" "$3" ;;
    passive) env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=PASSIVE python3 "$script" "$2" "$3" ;;
  esac 2>/dev/null | sed -n 's/.*tok\/s=\([0-9.]*\).*/\1/p'
}
for load in quiet loaded; do
  competitor=""
  if [ "$load" = loaded ]; then yes > /dev/null & competitor=$!; fi
  for shape in "1 64" "16 48"; do
    for round in $(seq "${ROUNDS:-3}"); do
      line="$load, ${shape% *} streams x ${shape#* } tokens, round $round, tok/s:"
      for setting in libgomp bounded passive; do line="$line $setting $(run $setting $shape)"; done
      echo "$line (load $(cut -d' ' -f1 /proc/loadavg))"
    done
  done
  [ -n "$competitor" ] && kill "$competitor"
done
