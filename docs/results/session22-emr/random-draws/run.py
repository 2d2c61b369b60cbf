"""Random sampling end to end: SmolLM2 (as shipped) decoding 16 and 1 streams with temperature 1.0, before and
after a change to the sampler, each tree in its own process, taking turns, 3 rounds:

    python docs/results/session22-emr/random-draws/run.py BEFORE_TREE AFTER_TREE [TOP_P]

Output tok/s of ``LLM.generate`` (prefill included): 16 or 1 prompts of 64 tokens, 128 tokens out each, with
``top_p`` TOP_P (default 1.0: none)."""

import os
import statistics
import subprocess
import sys

CODE = '''
import sys, time, torch
torch.set_num_threads(2)
from kvserve import LLM, SamplingParams
streams, top_p = int(sys.argv[1]), float(sys.argv[2])
llm = LLM("smollm2-135m-instruct", seed=0)
prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 5000 for j in range(64)]} for i in range(streams)]
params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=128, ignore_eos=True)
llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
print(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
'''

trees = {"before": sys.argv[1], "after": sys.argv[2]}
TOP_P = sys.argv[3] if len(sys.argv) > 3 else "1.0"
for streams in (16, 1):
    results = {name: [] for name in trees}
    for _ in range(3):
        for name, tree in trees.items():
            out = subprocess.run([sys.executable, "-c", CODE, str(streams), TOP_P], cwd=tree, check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
            results[name].append(float(out.stdout.strip().splitlines()[-1]))
    b, a = (statistics.median(results[n]) for n in ("before", "after"))
    print(f"{streams:2d} streams, output tok/s: before {b:6.1f} {[round(x, 1) for x in results['before']]}, "
          f"after {a:6.1f} {[round(x, 1) for x in results['after']]}: {a / b:.2f}x", flush=True)
