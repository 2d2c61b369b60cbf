"""Seeded draws, one step's sampling, before (a generator reseeded per row) and after (counter-based noise):

    python docs/results/session22-emr/seeded-draw/run.py BEFORE_TREE AFTER_TREE

each tree a checkout of kvserve (the commit before and the one that changed it); the two take turns in one
process per round, 2 threads, median ms of 20 calls a round."""

import os
import statistics
import subprocess
import sys

CODE = '''
import statistics, sys, time, torch
torch.set_num_threads(2)
from kvserve.sample.sampler import Sampler
from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sampling_params import SamplingParams
rows, vocab = int(sys.argv[1]), int(sys.argv[2])
batch = SamplingBatch([SamplingRow(SamplingParams(temperature=0.8, seed=s), 0, f"r{s}", [1, 2, 3], [4] * s)
                       for s in range(rows)])
logits = torch.randn(rows, vocab)
sampler = Sampler()
times = []
for _ in range(22):
    x = logits.clone()
    start = time.perf_counter(); sampler(x, batch); times.append(time.perf_counter() - start)
print(statistics.median(times[2:]) * 1e3)
'''

trees = {"before": sys.argv[1], "after": sys.argv[2]}
for rows, vocab in ((1, 49152), (16, 49152), (64, 49152), (1, 262144), (16, 262144)):
    results = {name: [] for name in trees}
    for _ in range(3):
        for name, tree in trees.items():
            out = subprocess.run([sys.executable, "-c", CODE, str(rows), str(vocab)], cwd=tree, check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
            results[name].append(float(out.stdout))
    b, a = (statistics.median(results[n]) for n in ("before", "after"))
    print(f"{rows:3d} seeded rows x {vocab:6d}: before {b:7.2f} ms {results['before']}, after {a:7.2f} ms "
          f"{results['after']}: {b / a:.2f}x", flush=True)
