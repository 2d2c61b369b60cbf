#!/bin/bash
# The router-overhead before/after runs of session 10, in the order they ran (runs.log has each one's start
# time and load average): main at deb32a3 ("before") and the router-fast branch ("after") exported to
# directories, taking turns under the same benchmark script (the branch's benchmarks/router.py):
#   git archive deb32a3 | tar -x -C /tmp/router-before;  git archive router-fast | tar -x -C /tmp/router-after
set -e
one() {  # which streams tag [extra flags]
  PYTHONPATH=/tmp/router-$1 python benchmarks/router.py overhead --streams $2 --port 18900 --json $1-$2-$3.json "${@:4}"
}
for rep in 1 2; do
  for streams in 1 64; do one before $streams $rep; one after $streams $rep; done
done
one after 64 pinned-1 --router-cpus 1  # the router on CPU 1, the client and the fake replica on CPU 0
for rep in 2 3; do one before 64 pinned-$rep --router-cpus 1; one after 64 pinned-$rep --router-cpus 1; done
for rep in 3 4; do one before 1 $rep; one after 1 $rep; done
