#!/bin/bash
# A/B of the server's CPU per token: the start tree without uvloop/httptools, this tree without them, this tree with
# uvloop where installed (it speaks h11 either way). server-cpu-ab-httptools.txt: a first run, this tree then on
# uvloop + httptools.
set -u
NOFAST='import sys; sys.modules["uvloop"] = None; sys.modules["httptools"] = None; '
start() {  # tree port blocked
  local launcher="import sys; ${3}sys.argv = ['kvserve'] + sys.argv[1:]; from kvserve.cli import main; sys.exit(main())"
  OMP_NUM_THREADS=1 PYTHONPATH=$1 python3 -c "$launcher" serve ${CHECKPOINT:?a tiny checkpoint: kvserve make-checkpoint DIR --arch llama} --port $2 --device cpu \
    --disable-uvicorn-access-log > serve_$2.log 2>&1 &
  echo $!
}
A=$(start ${START_TREE:?a worktree of 9f8f14f} 18941 "$NOFAST"); B=$(start ${TREE:-$(pwd)} 18942 "$NOFAST"); C=$(start ${TREE:-$(pwd)} 18943 "")
for p in 18941 18942 18943; do until curl -sf localhost:$p/health > /dev/null; do sleep 0.5; done; done
for round in 1 2; do
  for mode in "" "--no-stream"; do
    for pair in "start:$A:18941" "now-asyncio:$B:18942" "now:$C:18943"; do
      IFS=: read name pid port <<< "$pair"
      echo "$name $(python3 ${TREE:-$(pwd)}/benchmarks/server_cpu.py --pid $pid --url http://127.0.0.1:$port --clients 32 --requests 2 $mode)"
    done
  done
done
kill $A $B $C
