#!/bin/bash
# Process start to /health 200, then the first chat request's seconds (8 tokens), of `kvserve serve` (the default
# model, cached), trees taking turns:
#   TREES="<worktree of 9f8f14f> $(pwd)" N=3 bash docs/results/session44-zen3/first_request.sh
set -u
cd "$(mktemp -d)"
for i in $(seq 1 "${N:-3}"); do
  for tree in $TREES; do
    start=$(date +%s.%N)
    PYTHONPATH=$tree python3 -m kvserve.cli serve --port 18792 > serve.log 2>&1 & pid=$!
    until curl -sf http://127.0.0.1:18792/health > /dev/null; do sleep 0.05; done
    ready=$(date +%s.%N)
    curl -sf http://127.0.0.1:18792/v1/chat/completions -H 'Content-Type: application/json' -d \
      '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}' > /dev/null
    done_at=$(date +%s.%N)
    echo "$tree ready $(echo "$ready - $start" | bc) first-request $(echo "$done_at - $ready" | bc)"
    kill $pid; wait $pid 2>/dev/null
  done
done
