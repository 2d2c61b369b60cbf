#!/bin/bash
# Process start to /health 200 of `kvserve serve` (the default model, cached), revisions taking turns:
#   git worktree add ../before e302589
#   TREES="$(realpath ../before) $(pwd)" N=5 docs/results/session17-emr/startup.sh
# FIRST_REQUEST=1 also times the first chat request (8 tokens) after /health 200 (session 44).
# Each server starts from a neutral folder with PYTHONPATH at its tree: started from a checkout, python's first
# sys.path entry (the current folder) would shadow PYTHONPATH, and both runs would be the checkout's code.
set -u
cd "$(mktemp -d)"
for i in $(seq 1 "${N:-3}"); do
  for tree in $TREES; do
    start=$(date +%s.%N)
    PYTHONPATH=$tree python3 -m kvserve.cli serve --port 18792 > serve.log 2>&1 & pid=$!
    until curl -sf http://127.0.0.1:18792/health > /dev/null; do sleep 0.05; done
    ready=$(date +%s.%N)
    if [ -n "${FIRST_REQUEST:-}" ]; then
      curl -sf http://127.0.0.1:18792/v1/chat/completions -H 'Content-Type: application/json' -d \
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}' > /dev/null
      echo "$tree ready $(echo "$ready - $start" | bc) first-request $(echo "$(date +%s.%N) - $ready" | bc)"
    else
      echo "$tree $(echo "$ready - $start" | bc)"
    fi
    kill $pid; wait $pid 2>/dev/null
  done
done
