"""The router in front of replicas (issue 19), each scenario with its baseline in the same run.

    PYTHONPATH=. python benchmarks/router.py cache [--replicas 4] [--num-kv-blocks 80]
    PYTHONPATH=. python benchmarks/router.py skew [--replicas 4]
    PYTHONPATH=. python benchmarks/router.py overhead [--streams 64]

``cache``: ``kvserve serve --data-parallel-size N`` with small KV pools, once with ``--routing-policy round_robin``
and once with ``cache_aware``, each serving the same ``prefix`` workload in ``shuffled`` order (8 groups of
8 requests sharing a 512-token system prompt, in a seeded random order): a pool of 80 blocks keeps about two
groups' prompts, a quarter of them. Reports the replicas' prefix-cache hit rate (their ``/metrics``, summed)
and ``kvserve bench serve``'s output throughput. Each replica gets one thread (``OMP_NUM_THREADS=1``), so N replicas share N cores.

``skew``: one hot prefix (one group of 64 requests) through ``cache_aware``: the requests each replica took
(the router's ``/metrics``), as the most loaded replica's share against the mean.

``overhead``: the router's own cost, without a model: a fake replica that answers like an engine (its first
chunk after ``--first-chunk-ms``, then a chunk every ``--chunk-ms``), called by ``--streams`` concurrent clients
directly and through ``kvserve router``, in ``--rounds`` rounds that alternate the two; the difference of the
median (and P90) times to the first streamed chunk, the router process's CPU time per request, and the router's
start-up time (from its process start to its /health answering 200). The fake replica and the client are bare
asyncio HTTP/1.1 (tens of µs a request), so that the router is what the two arms differ by and nothing in the
instrument saturates: a closed loop of 64 streams answered at once (``--first-chunk-ms 0 --chunk-ms 0``) runs
the client, router and replica flat out on the machine's cores, and its TTFT then measures their queues (±20 ms
from round to round on 2 cores), not the router's latency. ``--router-cpus 1`` pins the router to CPU 1 and the
rest to the other CPUs, as a deployment gives the router a core of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.upstream import Origin, Upstream

MODEL = "smollm2-135m-instruct"


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
        time.sleep(poll)
    raise RuntimeError(f"{url} did not come up")


def metric_sum(url: str, name: str) -> dict[str, float]:
    """Samples of ``name`` on ``url``'s /metrics, by their labels."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                samples[json.dumps(sample.labels, sort_keys=True)] = sample.value
    return samples


def start_dp(port: int, replicas: int, policy: str, extra: list[str], log: Path) -> subprocess.Popen:
    command = ["kvserve", "serve", MODEL, "--port", str(port), "--data-parallel-size", str(replicas),
               "--routing-policy", policy, *extra]
    server = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    for index in range(replicas):
        wait_healthy(f"http://127.0.0.1:{port + 1 + index}", server)
    wait_healthy(f"http://127.0.0.1:{port}", server)
    return server


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def bench_serve(port: int, flags: list[str], out: Path) -> dict:
    subprocess.run(["kvserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL,
                    "--result-json", str(out), *flags], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def cache(args: argparse.Namespace, work: Path) -> dict:
    workload = ["--dataset-name", "prefix", "--prefix-order", "shuffled", "--prefix-num-groups", "8",
                "--prefix-group-size", "8", "--prefix-len", "512", "--suffix-len", "32", "--random-output-len", "32",
                "--max-concurrency", str(args.concurrency), "--warmup", "0"]
    results = {}
    for policy in ("round_robin", "cache_aware"):
        server = start_dp(args.port, args.replicas, policy, ["--num-kv-blocks", str(args.num_kv_blocks)],
                          work / f"{policy}.log")
        try:
            report = bench_serve(args.port, workload, work / f"{policy}.json")["runs"][0]
            urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(args.replicas)]
            hits = sum(sum(metric_sum(u, "kvserve:prefix_cache_hits_total").values()) for u in urls)
            queries = sum(sum(metric_sum(u, "kvserve:prefix_cache_queries_total").values()) for u in urls)
        finally:
            stop(server)
        results[policy] = {"hit_rate": hits / queries, "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                           "cached_fraction_seen_by_clients": report["usage_cached_fraction"],
                           "output_throughput": report["output_throughput"], "ttft_ms": report["ttft_ms"]}
        print(f"{policy:12s} hit rate {hits / queries:6.1%}  output {report['output_throughput']:6.1f} tok/s",
              flush=True)
    rr, ca = results["round_robin"], results["cache_aware"]
    results["hit_rate_ratio"] = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    results["throughput_ratio"] = ca["output_throughput"] / rr["output_throughput"]
    print(f"cache_aware / round_robin: hit rate {results['hit_rate_ratio']:.2f}x, "
          f"output throughput {results['throughput_ratio']:.2f}x")
    return results


def skew(args: argparse.Namespace, work: Path) -> dict:
    workload = ["--dataset-name", "prefix", "--prefix-num-groups", "1", "--prefix-group-size", "64",
                "--prefix-len", "256", "--suffix-len", "16", "--random-output-len", "16",
                "--max-concurrency", str(args.concurrency), "--warmup", "0"]
    server = start_dp(args.port, args.replicas, "cache_aware", [], work / "skew.log")
    try:
        bench_serve(args.port, workload, work / "skew.json")
        per_replica = metric_sum(f"http://127.0.0.1:{args.port}", "kvserve_router:requests_total")
        decisions = metric_sum(f"http://127.0.0.1:{args.port}", "kvserve_router:decisions_total")
    finally:
        stop(server)
    counts = sorted(per_replica.values(), reverse=True)
    mean = statistics.mean(counts + [0] * (args.replicas - len(counts)))
    result = {"requests_per_replica": counts, "max_over_mean": counts[0] / mean, "decisions": decisions}
    print(f"one hot prefix over {args.replicas} replicas: requests {counts}, the most loaded "
          f"{counts[0] / mean:.2f}x the mean; decisions {decisions}")
    return result


def fake_replica(port: int, num_chunks: int, first_chunk_ms: float, chunk_ms: float) -> None:
    """A replica without a model, on bare asyncio streams (a few tens of µs a request, so that at 64 streams the
    instrument is not what saturates): /health, /metrics, and completions streamed as ``num_chunks`` one-token
    chunks, the first after ``first_chunk_ms`` and the rest every ``chunk_ms`` (an engine's TTFT and ITL;
    0 and 0 stream them at once)."""
    chunk = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    done = b"data: [DONE]\n\n"
    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    metrics = b"kvserve:num_requests_running 0\nkvserve:num_requests_waiting 0\n"

    def whole(content: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(content), content)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if not head.startswith(b"POST"):
                    writer.write(whole(metrics if b" /metrics " in head else b"ok"))
                    continue
                writer.write(stream_head)
                for index in range(num_chunks):
                    delay = first_chunk_ms if index == 0 else chunk_ms
                    if delay:
                        await asyncio.sleep(delay / 1e3)
                    writer.write(framed)
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    asyncio.run(main())


async def ttfts(url: str, streams: int, requests_each: int) -> list[float]:
    """Each of ``streams`` clients sends ``requests_each`` streamed completions in turn; the time from each
    request to its first streamed chunk. The client is the router's own lean HTTP/1.1 client (kept-alive
    connections, no per-line parsing), so it costs both arms little and the same."""
    origin = Origin.parse(url)
    body = json.dumps({"model": MODEL, "prompt": "a shared prefix " * 20, "max_tokens": 8, "stream": True}).encode()
    headers = [(b"content-type", b"application/json")]
    upstream = Upstream(max_idle_per_origin=streams)

    async def one_stream() -> list[float]:
        times = []
        for _ in range(requests_each):
            start = time.perf_counter()
            response = await upstream.request(b"POST", origin, b"/v1/completions", body, headers)
            first = None
            while chunk := await response.receive():
                if first is None and b"data: " in chunk:
                    first = time.perf_counter() - start
            times.append(first)
        return times

    try:
        return [t for times in await asyncio.gather(*(one_stream() for _ in range(streams))) for t in times]
    finally:
        await upstream.aclose()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(args: argparse.Namespace, work: Path) -> dict:
    """Rounds alternating direct and through the router (so drift in the machine's load hits both alike); the
    medians of all their first-chunk times, and the router process's CPU time over its rounds."""
    replica_port, router_port = args.port + 1, args.port
    requests_each = args.requests_each or max(10, 400 // args.streams)
    pin_router = None
    if args.router_cpus:  # the router on its own cores, as in a deployment; the client and the replica elsewhere
        router_cpus = {int(cpu) for cpu in args.router_cpus.split(",")}
        os.sched_setaffinity(0, os.sched_getaffinity(0) - router_cpus)
        pin_router = lambda: os.sched_setaffinity(0, router_cpus)  # noqa: E731
    replica = subprocess.Popen([sys.executable, __file__, "fake-replica", "--port", str(replica_port),
                                "--first-chunk-ms", str(args.first_chunk_ms), "--chunk-ms", str(args.chunk_ms)],
                               stdout=(work / "fake.log").open("ab"), stderr=subprocess.STDOUT)
    router = None
    try:
        wait_healthy(f"http://127.0.0.1:{replica_port}", replica)
        started = time.monotonic()
        router = subprocess.Popen(["kvserve", "router", "--worker", f"http://127.0.0.1:{replica_port}", "--port",
                                   str(router_port)], stdout=(work / "router.log").open("ab"), stderr=subprocess.STDOUT,
                                  preexec_fn=pin_router)
        wait_healthy(f"http://127.0.0.1:{router_port}", router, poll=0.02)
        router_start_s = time.monotonic() - started
        asyncio.run(ttfts(f"http://127.0.0.1:{router_port}", args.streams, 2))  # warm-up: connections
        samples: dict[str, list[float]] = {"direct": [], "router": []}
        rounds: list[dict[str, float]] = []
        cpu_s = 0.0
        for _ in range(args.rounds):
            medians = {}
            for name, port in (("direct", replica_port), ("router", router_port)):
                cpu_before = cpu_seconds(router.pid)
                times = asyncio.run(ttfts(f"http://127.0.0.1:{port}", args.streams, requests_each))
                if name == "router":
                    cpu_s += cpu_seconds(router.pid) - cpu_before
                samples[name] += times
                medians[name] = statistics.median(times) * 1e3
            rounds.append(medians)
    finally:
        for process in (router, replica):
            if process is not None:
                process.terminate()
                process.wait(30)
    direct, routed = (statistics.median(samples[name]) * 1e3 for name in ("direct", "router"))
    p90 = {name: statistics.quantiles(samples[name], n=10)[-1] * 1e3 for name in samples}
    num_routed = args.rounds * args.streams * requests_each
    results = {"streams": args.streams, "requests_each": requests_each, "router_cpus": args.router_cpus,
               "first_chunk_ms": args.first_chunk_ms, "chunk_ms": args.chunk_ms, "rounds": rounds,
               "direct_ttft_ms": direct, "router_ttft_ms": routed, "overhead_ms": routed - direct,
               "direct_ttft_p90_ms": p90["direct"], "router_ttft_p90_ms": p90["router"],
               "overhead_p90_ms": p90["router"] - p90["direct"],
               "router_cpu_ms_per_request": cpu_s / num_routed * 1e3, "router_start_s": router_start_s}
    print(f"{args.streams} streams, {args.rounds} rounds of {args.streams * requests_each} requests each way: median "
          f"TTFT direct {direct:.2f} ms, through the router {routed:.2f} ms: {routed - direct:+.2f} ms a request "
          f"(P90 {p90['direct']:.2f} and {p90['router']:.2f}: {p90['router'] - p90['direct']:+.2f}); the "
          f"router's CPU time {results['router_cpu_ms_per_request']:.3f} ms a request; router healthy "
          f"{router_start_s:.2f} s after its start")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="scenario", required=True)
    for name in ("cache", "skew", "overhead", "fake-replica"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, default=18800)
        p.add_argument("--json", type=Path, default=None)
    sub.choices["cache"].add_argument("--replicas", type=int, default=4)
    sub.choices["cache"].add_argument("--num-kv-blocks", type=int, default=80)
    sub.choices["cache"].add_argument("--concurrency", type=int, default=8)
    sub.choices["skew"].add_argument("--replicas", type=int, default=4)
    sub.choices["skew"].add_argument("--concurrency", type=int, default=16)
    sub.choices["overhead"].add_argument("--streams", type=int, default=64)
    sub.choices["overhead"].add_argument("--requests-each", type=int, default=None,
                                         help="requests each stream sends in a round (default: 400 / streams, "
                                              "at least 10)")
    sub.choices["overhead"].add_argument("--rounds", type=int, default=3)
    sub.choices["overhead"].add_argument("--router-cpus", default=None,
                                         help="CPUs to pin the router to (e.g. 1); the client and the fake replica "
                                              "get the others. Default: all share every CPU")
    for name in ("overhead", "fake-replica"):
        sub.choices[name].add_argument("--first-chunk-ms", type=float, default=50.0,
                                       help="the fake replica's time to its first chunk (an engine's TTFT)")
        sub.choices[name].add_argument("--chunk-ms", type=float, default=10.0,
                                       help="the fake replica's time between chunks (an engine's ITL); with "
                                            "--first-chunk-ms 0 too, the answer streams at once and the closed "
                                            "loop saturates the client, router and replica instead of "
                                            "measuring the router's latency")
    sub.choices["fake-replica"].add_argument("--num-chunks", type=int, default=8)
    args = parser.parse_args()
    if args.scenario == "fake-replica":
        fake_replica(args.port, args.num_chunks, args.first_chunk_ms, args.chunk_ms)
        return
    work = Path(tempfile.mkdtemp(prefix=f"router-{args.scenario}-"))
    result = {"cache": cache, "skew": skew, "overhead": overhead}[args.scenario](args, work)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
