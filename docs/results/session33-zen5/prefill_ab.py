"""The prefill kernel of an older tree and this one's, taking turns in one process, at Gemma 3's window layer shape.

    git worktree add /some/dir 7a158ad        # the tree before the key-tile grid
    python docs/results/session33-zen5/prefill_ab.py /some/dir   # from this tree's root
"""
import ctypes, sys, time, statistics
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kvserve import native
from kvserve.attention import cpu_paged
from kvserve.attention.cpu_paged import CpuPagedBackend
from tests.attention.test_cpu_paged import make_step
torch.set_num_threads(2)
decode = ctypes.CDLL(str(native.library_path(cpu_paged.DECODE_SOURCE)))
new = CpuPagedBackend((decode, ctypes.CDLL(str(native.library_path(cpu_paged.PREFILL_SOURCE)))))
old = CpuPagedBackend((decode, ctypes.CDLL(str(native.library_path(Path(sys.argv[1]) / "kvserve/attention/csrc/paged_prefill.c")))))
for cached, chunk in [(0, 512), (1500, 512), (600, 128), (3000, 64)]:
    step = make_step([(cached, chunk)], 0, head_dim=256, block_size=16, num_kv_heads=1, group=4, seed=0)
    times = {"old": [], "new": []}
    for _ in range(7):
        for name, b in (("old", old), ("new", new)):
            meta = b.build_metadata(step.inputs, {None, 512})
            t = time.perf_counter()
            for _ in range(5):
                b.forward(step.q, step.k, step.v, 0, step.kv, meta, scale=0.0625, sliding_window=512)
            times[name].append((time.perf_counter() - t) / 5 * 1e3)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{chunk} on {cached} cached: old {o:.2f} ms, new {n:.2f} ms, new/old {n/o:.3f}")
