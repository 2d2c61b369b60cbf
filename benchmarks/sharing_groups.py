"""Host time of ``attention.backend.shared_prefixes`` a step (the runner calls it every step, for cascade
attention), at decode batches of a few prompts sampled many times, against another revision's function in the
same rounds.

    python benchmarks/sharing_groups.py [--baseline REV]

Each decode's table is its prompt's blocks up to a random point, then blocks of its own (125 blocks: 2,000
tokens); ``--baseline`` loads ``shared_prefixes`` from git revision REV and checks that both give the same result.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from typing import Callable

import numpy as np

from kvserve.attention.backend import shared_prefixes

CASES = ((256, 256), (256, 128), (256, 16), (384, 8))  # (decodes, prompts)
WIDTH, BLOCK_SIZE = 125, 16


def tables(num_decodes: int, num_prompts: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    prompts = rng.integers(0, 10**6, size=(num_prompts, WIDTH))
    rows = np.empty((num_decodes, WIDTH), dtype=np.int32)
    for i in range(num_decodes):
        own = int(rng.integers(WIDTH // 2, WIDTH))
        rows[i] = np.r_[prompts[i % num_prompts, :own], 10**7 + i * WIDTH + np.arange(WIDTH - own)]
    return rows, rng.integers(1000, 2000, size=num_decodes).astype(np.int32)


def from_revision(revision: str) -> Callable:
    source = subprocess.run(["git", "show", f"{revision}:kvserve/attention/backend.py"], capture_output=True,
                            text=True, check=True).stdout
    start, end = source.index("def shared_prefixes"), source.index("\nclass ", source.index("def shared_prefixes"))
    namespace: dict = {"np": np}
    exec(source[start:end], namespace)  # the one function, as that revision wrote it
    return namespace["shared_prefixes"]


def microseconds(function: Callable, rows: np.ndarray, lens: np.ndarray, calls: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function(rows, lens, BLOCK_SIZE)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="a git revision whose shared_prefixes to time beside")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    baseline = from_revision(args.baseline) if args.baseline else None
    rng = np.random.default_rng(0)
    print(f"# {platform.machine()}, python {platform.python_version()}; us a call, best of {args.rounds} rounds")
    for num_decodes, num_prompts in CASES:
        rows, lens = tables(num_decodes, num_prompts, rng)
        ours = [microseconds(shared_prefixes, rows, lens) for _ in range(args.rounds)]
        line = f"{num_decodes} decodes of {num_prompts} prompts: {min(ours):.0f} us"
        if baseline is not None:
            assert (baseline(rows, lens, BLOCK_SIZE)[0] == shared_prefixes(rows, lens, BLOCK_SIZE)[0]).all()
            theirs = [microseconds(baseline, rows, lens) for _ in range(args.rounds)]
            line += f", {args.baseline} {min(theirs):.0f} us ({min(theirs) / min(ours):.1f}x)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
