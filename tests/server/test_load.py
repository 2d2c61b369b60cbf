"""Many concurrent streams, and clients that walk away: every request completes or is aborted, blocks freed."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess

NUM_STREAMS = 128
NUM_DISCONNECTS = 32


async def stream_tokens(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> tuple[int, str | None]:
    """Stream one completion; (usage's completion tokens, the last finish_reason)."""
    body = {"model": MODEL_NAME, "prompt": f"Request {i} says", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.8, "seed": i}
    completion_tokens, finish = -1, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
    return completion_tokens, finish


def wait_until_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.metric("kvserve:num_requests_running") == 0 and server.metric("kvserve:num_requests_waiting") == 0
                and server.metric("kvserve:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("requests still hold KV blocks: " + str([
        server.metric(name) for name in
        ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")]))


def test_concurrent_streams_all_finish_with_their_exact_token_count(server: ServerProcess) -> None:
    async def run() -> list[tuple[int, str | None]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream_tokens(client, server.url, i, 4 + i % 5) for i in range(NUM_STREAMS)))

    results = asyncio.run(run())
    assert results == [(4 + i % 5, "length") for i in range(NUM_STREAMS)]
    wait_until_idle(server)


def test_clients_that_disconnect_abort_their_requests_and_free_every_block(server: ServerProcess) -> None:
    aborted_before = server.metric("kvserve:request_success_total", finished_reason="abort")

    async def read_one_chunk_and_leave(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Client {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return  # closes the connection mid-stream

    async def give_up_waiting(client: httpx.AsyncClient) -> None:
        """Four clients whose requests run, then leave without an answer. Each leaves once the engine runs all
        four (and nothing else: they go first): a client that left after a fixed wait (50 ms) sometimes left
        before its request had reached the engine on a loaded machine, which then had nothing to abort."""
        bodies = [{"model": MODEL_NAME, "prompt": f"Patient {i}", "max_tokens": 240, "ignore_eos": True}
                  for i in range(4)]
        posts = [asyncio.ensure_future(client.post(f"{server.url}/v1/completions", json=body)) for body in bodies]
        while await asyncio.to_thread(server.metric, "kvserve:num_requests_running") < 4:
            assert not any(post.done() for post in posts), "a 240-token completion ended before all four ran"
            await asyncio.sleep(0.005)
        for post in posts:
            post.cancel()  # closes its connection
        await asyncio.gather(*posts, return_exceptions=True)
        assert all(post.cancelled() for post in posts), "a 240-token completion ended before its client left"

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            await give_up_waiting(client)
            await asyncio.gather(*(read_one_chunk_and_leave(client, i) for i in range(NUM_DISCONNECTS - 4)))

    asyncio.run(run())
    wait_until_idle(server)
    aborted = server.metric("kvserve:request_success_total", finished_reason="abort") - aborted_before
    assert aborted == NUM_DISCONNECTS
