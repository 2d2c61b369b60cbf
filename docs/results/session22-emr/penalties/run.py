"""Penalized rows, one step's sampling, before (counts rebuilt from every row's whole history each step) and
after (counts kept on the device, the prompt sent once, each step's tokens added as they are drawn):

    python docs/results/session22-emr/penalties/run.py BEFORE_TREE AFTER_TREE

each tree a checkout of kvserve; the two take turns in one process per round, 5 rounds, 2 threads; 16 or 64
rows with repetition, presence and frequency penalties, 1,000-token prompts, 64 steps of greedy decoding:
the median ms of a step after the first. Optional further arguments: ROWSxVOCAB cases."""

import os
import statistics
import subprocess
import sys

CODE = '''
import random, statistics, sys, time, torch
torch.set_num_threads(2)
from kvserve.sample.sampler import Sampler
from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sampling_params import SamplingParams
rows_n, vocab = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(0)
params = SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)
rows = [SamplingRow(params, 0, f"r{i}", [rng.randrange(vocab) for _ in range(1000)], []) for i in range(rows_n)]
batch = SamplingBatch(rows)
sampler = Sampler()
times = []
for step in range(64):
    logits = torch.randn(rows_n, vocab)
    start = time.perf_counter()
    out = sampler(logits, batch)
    times.append(time.perf_counter() - start)
    for row, tokens in zip(rows, out.token_ids):
        row.output_token_ids.extend(tokens)
print(statistics.median(times[1:]) * 1e3)
'''

ROUNDS = 5
trees = {"before": sys.argv[1], "after": sys.argv[2]}
for rows, vocab in [tuple(map(int, c.split("x"))) for c in (sys.argv[3:] or ["16x49152", "64x49152", "16x262144"])]:
    results = {name: [] for name in trees}
    for _ in range(ROUNDS):
        for name, tree in trees.items():
            out = subprocess.run([sys.executable, "-c", CODE, str(rows), str(vocab)], cwd=tree, check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
            results[name].append(float(out.stdout))
    b, a = (statistics.median(results[n]) for n in ("before", "after"))
    print(f"{rows:3d} penalized rows x {vocab:6d}: before {b:7.2f} ms {[round(x, 2) for x in results['before']]}, "
          f"after {a:7.2f} ms {[round(x, 2) for x in results['after']]}: {b / a:.2f}x", flush=True)
