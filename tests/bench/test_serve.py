"""``kvserve bench serve`` against a real ``kvserve serve`` and against a server that misbehaves."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from kvserve.bench.datasets import SampleRequest, add_dataset_arguments, build_dataset
from kvserve.bench.report import versions
from kvserve.bench.serve import (CHAT, COMPLETIONS, Target, arrival_delays, length_fields, parse_request_rates,
                                 run_requests, sessions, token_counter, with_answers)
from kvserve.bench.throughput import tokenized
from kvserve.cli import main
from kvserve.engine.input_processor import InputProcessor
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerProcess


def count_words(text: str) -> int:
    """A stand-in for the benchmark's tokenizer: one token per word."""
    return len(text.split())


def test_runs_against_kvserve_complete_and_compare_reads_them(
    server: ServerProcess, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer", str(tiny_checkpoint),
              "--warmup", "1"]
    paths = {name: tmp_path / f"{name}.json" for name in ("random", "prefix", "multiturn")}
    assert main([*common, "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "20",
                 "--random-output-len", "5", "--max-concurrency", "3", "--goodput", "e2e:600000",
                 "--result-json", str(paths["random"])]) == 0
    assert main([*common, "--dataset-name", "prefix", "--prefix-num-groups", "2", "--prefix-group-size", "3",
                 "--prefix-len", "48", "--suffix-len", "4", "--random-output-len", "3",
                 "--result-json", str(paths["prefix"])]) == 0
    assert main([*common, "--dataset-name", "multiturn", "--num-conversations", "2", "--num-turns", "3",
                 "--first-turn-len", "40", "--turn-len", "8", "--random-output-len", "4", "--request-rate", "50,inf",
                 "--result-json", str(paths["multiturn"]), "--plot", str(tmp_path / "plots")]) == 0
    table = capsys.readouterr().out
    assert "turn 2: prompt" in table and "E2E P99" in table  # per-turn TTFT, and a sweep table

    random_run, prefix_run = (json.loads(paths[name].read_text())["runs"][0] for name in ("random", "prefix"))
    assert (random_run["completed"], random_run["failed"]) == (6, 0)
    assert random_run["output_tokens"] == 6 * 5 and random_run["input_tokens"] == 6 * 20  # ids as sent
    assert random_run["goodput"] == pytest.approx(random_run["request_throughput"])
    # a token that decodes to no text yet (part of a character) sends an empty chunk, which times nothing
    assert len(random_run["requests"]) == 6 and all(len(r["itl_ms"]) <= 4 for r in random_run["requests"])
    assert all(r["ttft_ms"] <= r["e2e_ms"] and r["tpot_ms"] for r in random_run["requests"])
    assert (prefix_run["completed"], prefix_run["failed"]) == (6, 0)
    assert prefix_run["prefix_cache_hit_rate"] > 0.5 and prefix_run["usage_cached_fraction"] > 0.5

    multiturn = json.loads(paths["multiturn"].read_text())
    assert [run["request_rate"] for run in multiturn["runs"]] == [50.0, "inf"]
    for run in multiturn["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        by_turn = run["prompt_tokens_by_turn"]
        assert list(by_turn) == ["0", "1", "2"] and by_turn["0"] < by_turn["1"] < by_turn["2"]
    assert multiturn["config"]["dataset_name"] == "multiturn" and multiturn["versions"]["kvserve"]
    assert len(list((tmp_path / "plots").glob("*.png"))) == 5  # three distributions and two against rate
    assert multiturn["versions"] == versions() and multiturn["machine"]["num_cpus"]
    assert "--tokenizer" in multiturn["config"]["argv"]

    assert main(["bench", "compare", *map(str, paths.values())]) == 0
    table = capsys.readouterr().out
    assert "output tok/s" in table and "x)" in table and "@50.0" in table and "@inf" in table


def test_the_chat_endpoint_gets_texts_that_fit_and_messages_templated_once(
    server: ServerProcess, tiny_checkpoint: Path, tokenizer, tmp_path: Path
) -> None:
    """long fills the context beside the template's tokens (its decoded ids used to come out longer than the
    context); grounded sends its chat turn, which the server templates once."""
    common = ["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer", str(tiny_checkpoint),
              "--warmup", "0", "--endpoint", CHAT, "--num-prompts", "2", "--random-output-len", "3"]
    long_json, grounded_json = tmp_path / "long.json", tmp_path / "grounded.json"
    assert main([*common, "--dataset-name", "long", "--result-json", str(long_json)]) == 0
    assert main([*common, "--dataset-name", "grounded", "--random-input-len", "40", "--num-prompts", "3",
                 "--result-json", str(grounded_json)]) == 0
    long_run = json.loads(long_json.read_text())["runs"][0]
    assert long_run["completed"] == 2
    assert all(MAX_MODEL_LEN - 3 - 2 <= r["prompt_tokens"] <= MAX_MODEL_LEN - 3 for r in long_run["requests"])
    grounded = json.loads(grounded_json.read_text())
    workload = build_dataset(argparse.Namespace(**grounded["config"]), tokenizer)
    grounded_run = grounded["runs"][0]
    # the server counts the workload's templated lengths; the first (a whole module to edit) outgrows 256
    assert [r["prompt_tokens"] for r in grounded_run["requests"]] == [r.prompt_len for r in workload]
    assert grounded_run["completed"] == 2 and grounded_run["requests"][0]["error"].startswith(
        f"HTTP 400: {{\"error\":{{\"message\":\"messages ({workload[0].prompt_len} tokens) leaves no room")


# ---- a server that misbehaves -----------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def text(t: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t}]}


def usage(completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion}}


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
# what the fake server does, by the prompt it is sent
BEHAVIOURS: dict[str, bytes | None] = {
    "http-500": None,
    "drop-mid-stream": STREAM_HEAD + sse(text("a")),  # then the connection is reset
    "close-before-done": STREAM_HEAD + sse(text("a"), text("b"), usage(2)),
    "short": STREAM_HEAD + sse(text("a"), usage(1), "[DONE]"),
    "stream-error": STREAM_HEAD + sse(text("a"), {"error": {"message": "out of memory", "code": 500}}),
    "malformed": STREAM_HEAD + sse(text("a"), "[1, 2]", "[DONE]"),
    "not-json": STREAM_HEAD + sse(text("a"), "{oops", "[DONE]"),
    "no-usage": STREAM_HEAD + sse(text("a b"), "[DONE]"),  # two words: two tokens by count_words, in one chunk
    "no-usage-short": STREAM_HEAD + sse(text("a"), text("b"), "[DONE]"),  # two chunks of one word, "ab"
    "hang": STREAM_HEAD,  # then nothing until the client gives up
    "endless": STREAM_HEAD,  # then a chunk every 50 ms, for longer than any test waits
    "good": STREAM_HEAD + sse(text("a"), text("b"), usage(2), "[DONE]"),
    # JSON may leave U+0085 / U+2028 / U+2029 in text, where str.splitlines (and httpx's aiter_lines) would end a
    # line; the event-stream format ends lines at CR and LF alone (here CRLF)
    "raw-separators": STREAM_HEAD + "".join(
        f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in (text("a\u2028\x85"), text("b\u2029"), usage(2))
    ).encode() + b"data: [DONE]\r\n\r\n",
}


async def _misbehave(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    kind = body.get("prompt") if isinstance(body.get("prompt"), str) else "unknown"
    if kind not in BEHAVIOURS or BEHAVIOURS[kind] is None:
        error = json.dumps({"error": {"message": f"boom: {kind}"}}).encode()
        status = b"500 Internal Server Error" if kind in BEHAVIOURS else b"404 Not Found"
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     + f"content-length: {len(error)}\r\n\r\n".encode() + error)
    else:
        writer.write(BEHAVIOURS[kind])
    await writer.drain()
    if kind == "endless":
        await _trickle(writer)
    if kind == "hang":
        await asyncio.sleep(30)
    if kind == "drop-mid-stream":
        writer.transport.abort()
    else:
        writer.close()


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A chunk every 50 ms for 10 s, never a gap that a timeout on each read would catch, until the client
    leaves."""
    for _ in range(200):
        try:
            writer.write(sse(text("a")))
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(0.05)


async def _against_misbehaving_server(run: Callable[[str], Awaitable[Any]]) -> Any:
    server = await asyncio.start_server(_misbehave, "127.0.0.1", 0)
    async with server:
        return await run(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")


def test_errors_and_dropped_connections_are_counted_not_crashed_on() -> None:
    kinds = list(BEHAVIOURS)
    requests = [SampleRequest(kind, 1, 2) for kind in kinds]

    async def run(url: str):
        return await run_requests(Target(url, "m", count_words, timeout_s=0.5), requests, max_concurrency=3)

    start = time.perf_counter()
    records, _ = asyncio.run(_against_misbehaving_server(run))
    assert time.perf_counter() - start < 5  # the endless stream is given up on at the timeout
    by_kind = dict(zip(kinds, records))
    assert {kind for kind, r in by_kind.items() if r.ok} == {"no-usage", "no-usage-short", "good", "raw-separators"}
    assert by_kind["http-500"].error.startswith("HTTP 500") and "boom" in by_kind["http-500"].error
    assert by_kind["drop-mid-stream"].error.split(":")[0] in {"RemoteProtocolError", "ReadError"} \
        or "before [DONE]" in by_kind["drop-mid-stream"].error
    assert "before [DONE]" in by_kind["close-before-done"].error
    assert by_kind["short"].error == "got 1 of 2 tokens (cut short?)"
    assert "out of memory" in by_kind["stream-error"].error
    assert by_kind["hang"].error == by_kind["endless"].error == "timed out: no [DONE] within --timeout 0.5 s"
    assert by_kind["endless"].e2e is None and len(by_kind["endless"].chunk_times) > 3
    assert by_kind["malformed"].error.startswith("a malformed chunk (AttributeError")
    assert by_kind["not-json"].error.startswith("a malformed chunk (JSONDecodeError")
    assert not by_kind["no-usage"].counted_from_usage and by_kind["no-usage"].completion_tokens == 2
    assert by_kind["no-usage-short"].completion_tokens == 1  # counted from the text: an estimate, no failure
    assert by_kind["good"].completion_tokens == 2 and len(by_kind["good"].itl) == 1
    assert by_kind["raw-separators"].completion_tokens == 2 and len(by_kind["raw-separators"].itl) == 1


def test_a_failing_server_is_reported_by_the_command(tiny_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    """Every request answered with a 404 (and no /metrics): the run is reported, the command fails."""
    def command(url: str, *flags: str) -> int:
        return main(["bench", "serve", "--base-url", url, "--model", "m", "--tokenizer", str(tiny_checkpoint),
                     "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "2", *flags])

    async def run(url: str) -> tuple[int, int]:
        loop = asyncio.get_running_loop()  # the command runs its own event loop, so in a thread of its own
        return (await loop.run_in_executor(None, command, url, "--warmup", "0"),
                await loop.run_in_executor(None, command, url))

    no_warmup, with_warmup = asyncio.run(_against_misbehaving_server(run))
    captured = capsys.readouterr()
    assert no_warmup == 1 and "completed 0, failed 3" in captured.out and "error x3: HTTP 404" in captured.out
    assert "hit rate (server /metrics): n/a" in captured.out
    assert with_warmup == 2 and "warm-up failed" in captured.err


# ---- the pieces of the load generator ---------------------------------------------------------------------


def test_arrivals_are_seeded_poisson_or_all_at_once() -> None:
    assert arrival_delays(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    delays = arrival_delays(2000, 4.0, seed=1)
    assert delays == arrival_delays(2000, 4.0, seed=1) and delays != arrival_delays(2000, 4.0, seed=2)
    gaps = [b - a for a, b in zip(delays, delays[1:])]
    assert delays[0] == 0 and min(gaps) > 0 and sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    assert parse_request_rates("1,2.5,inf") == [1.0, 2.5, float("inf")]
    for bad in ("fast", "0", "1,-2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_request_rates(bad)


def test_conversations_run_as_sessions_with_the_servers_answers() -> None:
    turns = [SampleRequest("p", 5, 2, messages=[{"role": "user", "content": f"u{c}"}], group=c, turn=0)
             for c in range(2)]
    second = SampleRequest("p", 9, 2, group=0, turn=1, messages=[
        {"role": "user", "content": "u0"}, {"role": "assistant", "content": "scripted"},
        {"role": "user", "content": "again"}])
    plain = SampleRequest([1, 2], 2, 2)
    assert sessions([turns[0], turns[1], second, plain]) == [[turns[0], second], [turns[1]], [plain]]
    target = Target("http://x", "m", count_words)
    path, body = target.request_body(second, ["the server's answer"])
    assert path == CHAT and body["messages"][1] == {"role": "assistant", "content": "the server's answer"}
    assert with_answers(second.messages, ["a"])[2] == second.messages[2]
    assert target.request_body(plain, [])[1]["prompt"] == [1, 2]
    assert Target("http://x", "m", count_words, endpoint=CHAT).request_body(
        SampleRequest("hi", 1, 2), [])[1]["messages"] == [{"role": "user", "content": "hi"}]


def test_grounded_sends_its_chat_turn_on_the_chat_endpoint(tokenizer) -> None:
    """Its prompt holds the chat template already: wrapped in a user message, it would be templated twice."""
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    workload = parser.parse_args(["--dataset-name", "grounded", "--num-prompts", "1", "--random-input-len", "40"])
    (request,) = build_dataset(workload, tokenizer)
    path, body = Target("http://x", "m", count_words, endpoint=CHAT).request_body(request, [])
    assert path == CHAT and body["messages"] == request.messages and "<|im_start|>" not in str(body["messages"])
    path, body = Target("http://x", "m", count_words).request_body(request, [])
    assert path == COMPLETIONS and body["prompt"] == request.prompt  # templated here: the server does not
    (offline,) = tokenized([request], InputProcessor(tokenizer, len(tokenizer), 512))  # bench throughput: ids
    assert offline.messages is None and offline.prompt_len == len(offline.prompt) > 40


def test_without_usage_the_benchmarks_tokenizer_counts(tokenizer) -> None:
    text = "Re-tokenized, the way vLLM's benchmark counts."
    assert token_counter(tokenizer)(text) == len(tokenizer.encode(text, add_special_tokens=False)) > 1


def test_each_backend_gets_its_exact_length_extras() -> None:
    assert length_fields("kvserve", 7) | length_fields("vllm", 7) == length_fields("vllm", 7)
    assert length_fields("vllm", 7)["min_tokens"] == 7 and length_fields("vllm", 7)["ignore_eos"] is True
    assert length_fields("llamacpp", 7)["n_predict"] == 7 and "min_tokens" not in length_fields("llamacpp", 7)
    assert {"ignore_eos", "min_tokens", "n_predict"}.isdisjoint(length_fields("openai", 7))
    assert all(length_fields(b, 7)["max_tokens"] == 7 and length_fields(b, 7)["stream_options"]["include_usage"]
               for b in ("kvserve", "vllm", "llamacpp", "openai"))


@pytest.mark.parametrize("flags, message", [
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--max-concurrency", "-1"], "--max-concurrency must be >= 1"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--timeout", "-1"], "--timeout must be a positive number"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--goodput", "tpot:-5"], "--goodput 'tpot:-5': the limit must be a finite number of milliseconds > 0"),
    (["--goodput", "ttft:nan"], "--goodput 'ttft:nan': the limit must be"),
    (["--dataset-name", "sharegpt", "--sharegpt-output-len", "0"], "--sharegpt-output-len must be at least 1"),
    (["--request-rate", "nan"], "--request-rate must be positive"),
    (["--request-rate", "2,nan"], "--request-rate must be positive"),
    (["--dataset-path", "data.json"], "--dataset-path is read by --dataset-name sharegpt only"),
    (["--result-json", "{tmp}"], "--result-json {tmp}: exists and is not a file"),
    (["--result-json", "{tmp}/a-file/out.json"], "{tmp}/a-file is not a directory"),
    (["--result-json", "{tmp}/no-dir/out.json"], "the directory {tmp}/no-dir does not exist"),
    (["--plot", "{tmp}/a-file"], "--plot {tmp}/a-file: exists and is not a directory"),
])
def test_bad_flags_are_refused_before_any_request(flags: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """Against a port nobody listens on: a flag checked only once requests went out would fail the warm-up."""
    (tmp_path / "a-file").write_text("")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", "/nonexistent", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error: ") and message.format(tmp=tmp_path) in err and len(err.splitlines()) == 1


def test_plots_without_matplotlib_are_refused_before_any_request(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `pip install kvserve` has no matplotlib: the run would end in a traceback after the whole sweep."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", "/nonexistent", "--plot", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "kvserve: error: --plot needs matplotlib: pip install 'kvserve[bench]'\n"
