#!/usr/bin/env bash
# Issue 9's measurement: the prefix cache off and on, and llama.cpp's llama-server, on the same workloads in one
# run, each pass against a fresh server. Results go to $OUT (default docs/results/prefix-cache-<date>), one JSON
# per pass, then `kvserve bench compare` tables.
#
#   benchmarks/prefix_cache.sh                       # kvserve on / off, plus llama.cpp if $LLAMA_SERVER is set
#   LLAMA_SERVER=$PEERS_DIR/llamacpp/build/bin/llama-server LLAMA_GGUF=$PEERS_DIR/smollm2-f32.gguf \
#       benchmarks/prefix_cache.sh    # llama.cpp too: benchmarks/peers/README.md says how to build and make them
#   WORKLOADS="prefix" benchmarks/prefix_cache.sh    # a subset
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=smollm2-135m-instruct
OUT=${OUT:-docs/results/prefix-cache-$(date +%Y%m%d-%H%M)}
WORKLOADS=${WORKLOADS:-"prefix multiturn random"}
PORT=${PORT:-18700}
mkdir -p "$OUT"

workload_flags() {
  case "$1" in
    # 8 groups x 16 requests sharing a 1,024-token system prompt, 32-token suffixes, 64 output tokens
    prefix) echo "--dataset-name prefix --prefix-num-groups 8 --prefix-group-size 16 --prefix-len 1024 --suffix-len 32 --random-output-len 64 --max-concurrency 16" ;;
    # 8 conversations of 4 turns: a ~1,000-token first message, ~100-token later ones, 64-token answers,
    # so that the last turn resends a history of about 1,500 tokens
    multiturn) echo "--dataset-name multiturn --num-conversations 8 --num-turns 4 --first-turn-len 1000 --turn-len 100 --random-output-len 64 --max-concurrency 8" ;;
    # no sharing: what the cache costs
    random) echo "--dataset-name random --num-prompts 64 --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --max-concurrency 16" ;;
  esac
}

# shellcheck source=wait_healthy.sh
source "benchmarks/wait_healthy.sh"

run_pass() {  # label, workload, bench backend, server command...
  local label=$1 workload=$2 backend=$3; shift 3
  start_server "$OUT/$label-$workload.server.log" "$@"
  wait_healthy
  # shellcheck disable=SC2046
  kvserve bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$label" --backend "$backend" \
    --result-json "$OUT/$label-$workload.json" $(workload_flags "$workload") 2>/dev/null | tee "$OUT/$label-$workload.txt"
  stop_server
  results+=("$OUT/$label-$workload.json")
}

for workload in $WORKLOADS; do
  results=()  # in the order run: the cache off is the baseline; older files in $OUT stay out
  run_pass kvserve-cache-off "$workload" kvserve kvserve serve "$MODEL" --port "$PORT" --no-enable-prefix-caching
  run_pass kvserve-cache-on "$workload" kvserve kvserve serve "$MODEL" --port "$PORT"
  if [ -n "${LLAMA_SERVER:-}" ] && [ "$workload" != random ]; then
    run_pass "llamacpp-$(basename "${LLAMA_GGUF%.gguf}")" "$workload" llamacpp "$LLAMA_SERVER" -m "$LLAMA_GGUF" \
      --host 127.0.0.1 --port "$PORT" -t 2 -tb 2 -np 16 -c 32768 -b 512 -ub 512 --metrics
  fi
  kvserve bench compare "${results[@]}" | tee "$OUT/compare-$workload.txt"
done
