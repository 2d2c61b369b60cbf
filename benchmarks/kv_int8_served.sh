#!/usr/bin/env bash
# Issue 17: SmolLM2 served at 16 streams, int8 KV against fp32 KV (auto), on random and long (1,900-token prompts,
# 100 out), the two caches taking turns on each workload (ORDER="int8 auto" reverses them). Writes into $OUT.
# LOADS="long" runs one workload; LONG_PROMPT=1000 LONG_OUT=1000 NUM_PROMPTS=16 makes its 2,000-token contexts
# decode-heavy (one wave of 16 requests).
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18820}
source benchmarks/wait_healthy.sh
OUT=${OUT:-kv-int8-served}; mkdir -p $OUT
for load in ${LOADS:-random long}; do
  if [ $load = random ]; then FLAGS="--dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5 --num-prompts 64 --max-concurrency 16"
  else FLAGS="--dataset-name long --long-prompt-len ${LONG_PROMPT:-1900} --random-output-len ${LONG_OUT:-100} --num-prompts ${NUM_PROMPTS:-32} --max-concurrency 16"; fi
  for dtype in ${ORDER:-auto int8}; do
    start_server $OUT/$dtype-$load.server.log kvserve serve smollm2-135m-instruct --port $PORT --max-num-seqs 16 --kv-cache-dtype $dtype
    wait_healthy
    kvserve bench serve --base-url http://127.0.0.1:$PORT --model smollm2-135m-instruct --label kv-$dtype --backend kvserve \
      --warmup 2 --result-json $OUT/$dtype-$load.json $FLAGS 2>/dev/null > $OUT/$dtype-$load.txt
    stop_server
  done
  kvserve bench compare $OUT/auto-$load.json $OUT/int8-$load.json > $OUT/compare-$load.txt
done
echo DONE
