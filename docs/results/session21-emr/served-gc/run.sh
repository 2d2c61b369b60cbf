#!/bin/bash
# the tiny model served at 64 streams, the commit before the heap freeze against this one, taking turns
OUT=${OUT:?}; mkdir -p $OUT
for r in 1 2; do
 for t in frozen before; do
  if [ $t = frozen ]; then P=<this checkout>; else P=<worktree at fdfa38f^>; fi
  PYTHONPATH=$P python -m kvserve.cli serve <kvserve make-checkpoint OUT --arch llama --size tiny> --port 8377 --max-num-seqs 64 > $OUT/server-$t-$r.log 2>&1 &
  SP=$!
  PORT=8377; source <this checkout>/benchmarks/wait_healthy.sh; wait_healthy
  PYTHONPATH=<this checkout> python -m kvserve.cli bench serve --base-url http://127.0.0.1:8377 --model <kvserve make-checkpoint OUT --arch llama --size tiny> --dataset-name random --num-prompts 2048 --random-input-len 64 --random-output-len 128 --max-concurrency 64 --result-json $OUT/$t-$r.json 2>&1 | grep -E "throughput|ITL|TPOT|TTFT" | head -12 | sed "s/^/$t $r: /"
  kill -TERM $SP; wait $SP 2>/dev/null
 done
done
