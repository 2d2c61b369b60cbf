"""Figures computed from scripted request timings are exact."""

from __future__ import annotations

import pytest

from kvserve.bench.client import RequestResult
from kvserve.bench.summary import distribution_ms, format_table, parse_goodput, summarize


def result(ttft: float, itl: list[float], prompt: int = 10, cached: int | None = 4, turn: int | None = None
           ) -> RequestResult:
    """A finished request whose chunks came at ttft, then at the given gaps (one token a chunk)."""
    n = 1 + len(itl)
    return RequestResult(n, ok=True, prompt_tokens=prompt, completion_tokens=n, cached_tokens=cached, ttft=ttft,
                         itl=itl, e2e=ttft + sum(itl), turn=turn)


def test_throughput_latencies_and_hit_rate_are_exact() -> None:
    results = [result(0.1, [0.02, 0.02, 0.02]), result(0.3, [0.05]), RequestResult(5, error="HTTP 500: boom")]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 500: boom": 1})
    assert (s["input_tokens"], s["output_tokens"]) == (20, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_throughput"] == 13.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["max"] == pytest.approx(300)
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 50) / 2)  # (e2e - ttft) / (tokens - 1)
    assert s["itl_ms"]["median"] == pytest.approx(20) and s["itl_ms"]["max"] == pytest.approx(50)
    assert s["e2e_ms"]["median"] == pytest.approx(((0.1 + 0.06) + (0.3 + 0.05)) / 2 * 1000)
    assert s["prefix_cache_hit_rate"] == pytest.approx(8 / 20)
    assert "error x1: HTTP 500: boom" in format_table(s, "t")


def test_percentiles_interpolate_like_numpy() -> None:
    dist = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert dist["median"] == pytest.approx(50.5) and dist["p90"] == pytest.approx(90.1)
    assert dist["p99"] == pytest.approx(99.01) and dist["max"] == pytest.approx(100)
    assert distribution_ms([]) is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_goodput(["ttft:150", "tpot:30"])
    assert slos == {"ttft": pytest.approx(0.15), "tpot": pytest.approx(0.03)}
    results = [result(0.1, [0.02, 0.02]), result(0.2, [0.01]), result(0.1, [0.05])]  # only the first meets both
    assert summarize(results, 4.0, slos)["goodput"] == pytest.approx(0.25)


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:fast"])
def test_bad_goodput_specs_name_the_problem(bad: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_a_server_without_cached_tokens_has_no_hit_rate_and_turns_are_split() -> None:
    results = [result(0.5, [0.01], cached=None, turn=0, prompt=1000), result(0.05, [0.01], cached=None, turn=1,
                                                                             prompt=1100)]
    s = summarize(results, 1.0)
    assert s["prefix_cache_hit_rate"] is None
    assert s["ttft_ms_by_turn"]["0"]["mean"] == pytest.approx(500) and s["ttft_ms_by_turn"]["1"]["mean"] == 50
    assert s["prompt_tokens_by_turn"] == {"0": 1000, "1": 1100}
