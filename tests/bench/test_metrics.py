"""Figures computed from scripted streams with known timestamps are exact (no sleeps, no server)."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.bench.metrics import (RequestRecord, distribution_ms, meets_slos, parse_goodput, parse_prometheus,
                                   record_dict, server_hit_rate, summarize)
from kvserve.bench.report import format_run
from kvserve.bench.serve import finish, take_chunk


def text_chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [], "usage": usage}


def count_words(text: str) -> int:
    """A stand-in for the benchmark's tokenizer: one token per word."""
    return len(text.split())


def replay(events: list[tuple[float, dict[str, Any]]], end: float, expected: int, start: float = 0.0,
           saw_done: bool = True, turn: int | None = None, exact_length: bool = True) -> RequestRecord:
    """What the client records of a stream whose chunks arrived at the given times."""
    record = RequestRecord(expected, start=start, turn=turn)
    for now, chunk in events:
        take_chunk(record, chunk, now)
    finish(record, end, saw_done, exact_length, count_words)
    return record


def test_one_stream_gives_exact_ttft_itl_tpot_e2e() -> None:
    record = replay([(0.25, text_chunk("a")), (0.30, text_chunk("b")), (0.40, text_chunk("")),
                     (0.45, text_chunk("cd")), (0.46, usage_chunk(12, 4, cached=8))], end=0.5, expected=4, start=0.1)
    assert record.ok and record.text == "abcd" and record.counted_from_usage
    assert record.ttft == pytest.approx(0.15)
    # the empty chunk is a token's arrival (its text held back, a character's first bytes), as vLLM's bench counts
    assert record.itl == pytest.approx([0.05, 0.10, 0.05])
    assert record.e2e == pytest.approx(0.4)
    assert record.tpot == pytest.approx((0.4 - 0.15) / 3)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (12, 4, 8)
    figures = record_dict(record)
    assert figures["ttft_ms"] == 150.0 and figures["itl_ms"] == pytest.approx([50.0, 100.0, 50.0])
    assert "text" not in figures


def test_chat_chunks_time_tokens_not_the_role() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    held = {"choices": [{"index": 0, "delta": {"content": ""}}]}  # a token whose text is held back
    content = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    record = replay([(0.1, role), (0.3, held), (0.35, content), (0.36, usage_chunk(5, 2))], end=0.4, expected=2)
    assert record.ttft == pytest.approx(0.3) and record.tpot == pytest.approx(0.1) and record.ok
    assert record.text == "hi" and record.itl == pytest.approx([0.05])
    first_with_role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}
    record = replay([(0.2, first_with_role), (0.25, usage_chunk(5, 1))], end=0.3, expected=1)
    assert record.ttft == pytest.approx(0.2) and record.text == "hi"


def test_a_peers_finish_only_chunk_after_its_last_token_is_no_token() -> None:
    """llama.cpp ends a stream with ``"delta": {}`` and the finish reason, a chunk past the tokens usage counts."""
    finish_only = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    content = [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in ("a", "b")]
    record = replay([(0.1, content[0]), (0.2, content[1]), (0.201, finish_only), (0.21, usage_chunk(5, 2))],
                    end=0.3, expected=2)
    assert record.ok and record.itl == pytest.approx([0.1]) and record.tpot == pytest.approx(0.2)


def test_a_stream_that_timed_no_token_meets_no_ttft_or_tpot_limit() -> None:
    untimed = replay([(0.3, usage_chunk(5, 4))], end=0.4, expected=4)
    one_token = replay([(0.1, text_chunk("a")), (0.2, usage_chunk(5, 1))], end=0.3, expected=1)
    assert untimed.ok and untimed.ttft is None and untimed.tpot is None
    assert not meets_slos(untimed, {"ttft": 1.0}) and not meets_slos(untimed, {"tpot": 1.0})
    assert meets_slos(untimed, {"e2e": 1.0})
    assert meets_slos(one_token, {"ttft": 1.0, "tpot": 0.001})  # one token: no TPOT to miss


def test_a_run_summary_is_exact() -> None:
    first = replay([(0.1, text_chunk("a")), (0.12, text_chunk("b")), (0.14, text_chunk("c")),
                    (0.16, text_chunk("d")), (0.16, usage_chunk(10, 4, cached=4))], end=0.16, expected=4)
    second = replay([(0.3, text_chunk("a")), (0.35, text_chunk("b")), (0.35, usage_chunk(10, 2, cached=4))],
                    end=0.35, expected=2)
    failed = RequestRecord(5, error="HTTP 500: boom")
    s = summarize([first, second, failed], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 500: boom": 1})
    assert (s["input_tokens"], s["output_tokens"], s["num_without_usage"]) == (20, 6, 0)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_throughput"] == 13.0
    assert s["input_throughput"] == 10.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["max"] == pytest.approx(300)
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 50) / 2)  # (e2e - ttft) / (tokens - 1)
    assert s["itl_ms"]["median"] == pytest.approx(20) and s["itl_ms"]["max"] == pytest.approx(50)
    assert s["e2e_ms"]["median"] == pytest.approx((160 + 350) / 2)
    assert s["usage_cached_fraction"] == pytest.approx(8 / 20)
    assert "error x1: HTTP 500: boom" in format_run({**s, "prefix_cache_hit_rate": None}, "t")


def test_percentiles_interpolate_like_numpy() -> None:
    dist = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert dist["mean"] == pytest.approx(50.5) and dist["median"] == pytest.approx(50.5)
    assert dist["p90"] == pytest.approx(90.1) and dist["p99"] == pytest.approx(99.01)
    assert dist["max"] == pytest.approx(100)
    assert distribution_ms([]) is None


def test_streams_cut_short_or_in_error_fail_with_their_reason() -> None:
    short = replay([(0.1, text_chunk("a")), (0.2, usage_chunk(3, 1))], end=0.2, expected=2)
    assert not short.ok and short.error == "got 1 of 2 tokens (cut short?)"
    dropped = replay([(0.1, text_chunk("a"))], end=0.2, expected=2, saw_done=False)
    assert not dropped.ok and "before [DONE]" in dropped.error
    errored = replay([(0.1, text_chunk("a")), (0.2, {"error": {"message": "overloaded"}})], end=0.3, expected=2)
    assert not errored.ok and "overloaded" in errored.error


def test_without_usage_the_text_is_re_tokenized_and_said_so() -> None:
    """Two chunks of two words and one: three tokens (a server may put several tokens in a chunk), and TPOT over
    those three, as vLLM's benchmark counts them."""
    record = replay([(0.1, text_chunk("one two")), (0.3, text_chunk(" three"))], end=0.3, expected=3)
    record.prompt_tokens = 7  # what the workload generated
    assert record.ok and not record.counted_from_usage and record.completion_tokens == 3
    assert record.tpot == pytest.approx(0.1)
    s = summarize([record], duration=1.0)
    assert s["num_without_usage"] == 1 and s["output_tokens"] == 3 and s["usage_cached_fraction"] is None
    assert "re-tokenized with the benchmark's tokenizer" in format_run({**s, "prefix_cache_hit_rate": None}, "t")


def test_without_usage_a_count_by_re_tokenizing_fails_no_request() -> None:
    """A text need not tokenize back to the tokens that made it: the count is an estimate, not a check."""
    chunks = [(0.1, text_chunk("one two")), (0.2, text_chunk(" three"))]
    counted = replay(chunks, end=0.3, expected=5)
    assert counted.ok and counted.completion_tokens == 3 and not counted.counted_from_usage


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_goodput(["ttft:150", "tpot:30"])
    assert slos == {"ttft": pytest.approx(0.15), "tpot": pytest.approx(0.03)}
    meets = replay([(0.1, text_chunk("a")), (0.12, text_chunk("b")), (0.12, usage_chunk(1, 2))], 0.12, 2)
    slow_first = replay([(0.2, text_chunk("a")), (0.21, text_chunk("b")), (0.21, usage_chunk(1, 2))], 0.21, 2)
    slow_after = replay([(0.1, text_chunk("a")), (0.15, text_chunk("b")), (0.15, usage_chunk(1, 2))], 0.15, 2)
    failed = RequestRecord(2, error="HTTP 503: busy")
    s = summarize([meets, slow_first, slow_after, failed], 4.0, slos)
    assert s["goodput"] == pytest.approx(0.25) and s["goodput_slos_ms"] == {"ttft": 150, "tpot": 30}
    e2e_only = summarize([meets, slow_first, slow_after], 1.0, parse_goodput(["e2e:150"]))
    assert e2e_only["goodput"] == pytest.approx(2.0)


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:fast", "tpot:-5", "ttft:0", "ttft:nan", "e2e:inf"])
def test_bad_goodput_specs_name_the_problem(bad: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_ttft_by_turn_for_multiturn() -> None:
    turns = [replay([(0.5, text_chunk("a")), (0.5, usage_chunk(1000, 1))], 0.5, 1, turn=0),
             replay([(0.05, text_chunk("a")), (0.05, usage_chunk(1100, 1))], 0.05, 1, turn=1)]
    s = summarize(turns, 1.0)
    assert s["ttft_ms_by_turn"]["0"]["mean"] == pytest.approx(500)
    assert s["ttft_ms_by_turn"]["1"]["median"] == pytest.approx(50)
    assert s["prompt_tokens_by_turn"] == {"0": 1000, "1": 1100}


def test_server_hit_rate_from_kvserve_or_vllm_counters() -> None:
    before = parse_prometheus('# HELP x\nkvserve:prefix_cache_queries_total{model_name="m"} 100.0\n'
                              'kvserve:prefix_cache_hits_total{model_name="m"} 20.0\n')
    after = parse_prometheus('kvserve:prefix_cache_queries_total{model_name="m"} 300.0\n'
                             'kvserve:prefix_cache_hits_total{model_name="m"} 170.0\n'
                             'kvserve:prefix_cache_hits_created{model_name="m"} 1.7e9\n')
    assert server_hit_rate(before, after) == pytest.approx(150 / 200)
    vllm = parse_prometheus('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40\n'
                            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 60\n'
                            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 25\n')
    assert server_hit_rate({}, vllm) == pytest.approx(0.25)
    assert server_hit_rate({}, {}) is None  # llama.cpp: no such counters
    assert server_hit_rate(after, after) is None  # nothing looked up
