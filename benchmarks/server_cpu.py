"""What a running server's threads spend on each output token: CPU microseconds a token of its event loop (the
main thread: HTTP, validation, SSE framing) and of its engine thread, read from /proc while N clients each send
requests back to back (greedy, EOS ignored, so every request yields exactly --max-tokens tokens).

CPU time a token is steadier than throughput on a shared machine, and it is what the event loop and the engine
take from each other: both hold one GIL. Start the server first (a seeded tiny checkpoint makes the server's own
work the larger part, as on a GPU; OMP_NUM_THREADS=1 keeps its kernels' threads from spinning), then:

    OMP_NUM_THREADS=1 kvserve serve /tmp/tiny --port 8744 --disable-uvicorn-access-log &
    python benchmarks/server_cpu.py --pid $! --url http://127.0.0.1:8744 --clients 32 --requests 2 [--no-stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far (/proc/PID/task/TID/stat fields 14 and 15)."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except FileNotFoundError:  # a thread that ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def request_body(args: argparse.Namespace, index: int) -> dict:
    body = {"model": "", "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": args.stream}
    text = f"request number {index} says hello to the world"
    return {**body, "messages": [{"role": "user", "content": text}]} if args.endpoint == "chat" else \
        {**body, "prompt": text}


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, index: int) -> None:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    if not args.stream:
        (await client.post(path, json=request_body(args, index))).raise_for_status()
        return
    async with client.stream("POST", path, json=request_body(args, index)) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def load(args: argparse.Namespace) -> float:
    """Seconds the clients took, after one request that warms the server up."""
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        await one_request(client, args, -1)
        started = time.perf_counter()

        async def client_loop(number: int) -> None:
            for k in range(args.requests):
                await one_request(client, args, number * args.requests + k)

        await asyncio.gather(*(client_loop(n) for n in range(args.clients)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    args = parser.parse_args()
    before = thread_cpu_seconds(args.pid)
    seconds = asyncio.run(load(args))
    after = thread_cpu_seconds(args.pid)
    num_tokens = (args.clients * args.requests + 1) * args.max_tokens  # the warm-up's too: its CPU is counted
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    engine = max((cpu for tid, cpu in spent.items() if tid != args.pid), default=0.0)  # the busiest other thread
    print(json.dumps({
        "clients": args.clients, "endpoint": args.endpoint, "stream": args.stream,
        "output_tok_s": round(args.clients * args.requests * args.max_tokens / seconds, 1),
        "event_loop_us_per_token": round(spent.get(args.pid, 0.0) / num_tokens * 1e6, 1),
        "engine_us_per_token": round(engine / num_tokens * 1e6, 1),
        "process_us_per_token": round(sum(spent.values()) / num_tokens * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
