"""``kvserve bench serve`` against a real ``kvserve serve`` and against a server that misbehaves."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvserve.bench.client import LoadShape, Target, run_workload
from kvserve.bench.workloads import SampleRequest, Workload
from kvserve.cli import main
from tests.server.conftest import MODEL_NAME, ServerProcess


def test_a_run_against_kvserve_completes_and_compare_reads_it(
    server: ServerProcess, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer", str(tiny_checkpoint),
              "--num-warmups", "1"]
    random_json, prefix_json = tmp_path / "random.json", tmp_path / "prefix.json"
    assert main([*common, "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "20",
                 "--random-output-len", "5", "--max-concurrency", "3", "--result-json", str(random_json)]) == 0
    assert main([*common, "--dataset-name", "prefix", "--prefix-num-groups", "2", "--prefix-group-size", "3",
                 "--prefix-len", "48", "--suffix-len", "4", "--random-output-len", "3",
                 "--result-json", str(prefix_json)]) == 0
    random_result, prefix_result = (json.loads(p.read_text()) for p in (random_json, prefix_json))
    assert random_result["completed"] == 6 and random_result["failed"] == 0
    assert random_result["output_tokens"] == 6 * 5 and random_result["input_tokens"] == 6 * 20  # ids as sent
    assert random_result["config"]["dataset_name"] == "random" and random_result["versions"]["git_commit"]
    assert prefix_result["completed"] == 6 and prefix_result["prefix_cache_hit_rate"] > 0.5
    capsys.readouterr()
    assert main(["bench", "compare", str(random_json), str(prefix_json)]) == 0
    table = capsys.readouterr().out
    assert "output tok/s" in table and "x)" in table


async def _misbehaving_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, calls: list[int]) -> None:
    """Request 0: a 500; 1: a stream cut mid-way; 2: a stream short of tokens; others: a proper stream."""
    await reader.readuntil(b"\r\n\r\n")
    calls.append(len(calls))
    kind = calls[-1]
    if kind == 0:
        body = json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode()
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    else:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        writer.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if kind != 1:
            writer.write(b'data: {"choices": [{"text": "b"}]}\n\n')
            usage = {"prompt_tokens": 3, "completion_tokens": 1 if kind == 2 else 2}
            writer.write(f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'.encode())
    await writer.drain()
    writer.transport.abort() if kind == 1 else writer.close()


def test_errors_and_dropped_connections_are_counted_not_crashed_on() -> None:
    async def scenario():
        calls: list[int] = []
        server = await asyncio.start_server(lambda r, w: _misbehaving_server(r, w, calls), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        workload = Workload("t", [SampleRequest("hi", 1, 2) for _ in range(4)])
        async with server:
            return await run_workload(Target(f"http://127.0.0.1:{port}", "m"), workload, LoadShape(max_concurrency=1))

    results, _ = asyncio.run(scenario())
    assert [r.ok for r in results] == [False, False, False, True]
    assert results[0].error.startswith("HTTP 500") and "boom" in results[0].error
    assert "RemoteProtocolError" in results[1].error or "no usage" in results[1].error
    assert "got 1 of 2 tokens" in results[2].error
    assert results[3].completion_tokens == 2 and results[3].ttft is not None and len(results[3].itl) == 1
