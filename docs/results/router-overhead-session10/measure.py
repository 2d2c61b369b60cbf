"""uvicorn's loop / HTTP parser under the router, side by side: router CPU ms a request and median TTFT, 3 rounds.

    PYTHONPATH=. python benchmarks/router.py fake-replica --port 18951 &
    PYTHONPATH=. python docs/results/router-overhead-session10/measure.py 64     (from the repository root)
"""
import asyncio, subprocess, sys, time, os, statistics
from pathlib import Path
sys.path.insert(0, "benchmarks")
from router import ttfts, cpu_seconds, wait_healthy
port = 18960; worker = "http://127.0.0.1:18951"
variants = [("uvloop", "httptools"), ("asyncio", "h11"), ("asyncio", "httptools"), ("uvloop", "h11")]
procs = {}
for i, (loop, http) in enumerate(variants):
    p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("variant.py")), loop, http, str(port + i), worker], env={**os.environ, "PYTHONPATH": os.getcwd()})
    wait_healthy(f"http://127.0.0.1:{port + i}", p, poll=0.05); procs[(loop, http)] = (p, port + i)
streams = int(sys.argv[1]); each = max(10, 400 // streams)
res = {v: [] for v in variants}; ttf = {v: [] for v in variants}
for v, (p, pt) in procs.items(): asyncio.run(ttfts(f"http://127.0.0.1:{pt}", streams, 2))
for r in range(3):
    for v, (p, pt) in procs.items():
        c = cpu_seconds(p.pid); t = asyncio.run(ttfts(f"http://127.0.0.1:{pt}", streams, each))
        res[v].append((cpu_seconds(p.pid) - c) / (streams * each) * 1e3); ttf[v].append(statistics.median(t) * 1e3)
for v in variants: print(v, "cpu ms/req", [f"{x:.3f}" for x in res[v]], "ttft ms", [f"{x:.2f}" for x in ttf[v]])
for p, _ in procs.values(): p.terminate()
