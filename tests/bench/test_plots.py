"""``--plot`` writes PNGs that load: latency distributions, and throughput and P99 latency against rate."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image

from kvserve.bench.metrics import RequestRecord, record_dict, summarize
from kvserve.bench.plots import write_plots


def run(rate: float | str, scale: float) -> dict:
    """A run of three requests (and a failed one) with latencies growing with ``scale``."""
    records = [RequestRecord(3, start=0.0, chunk_times=[0.1 * scale * k, 0.1 * scale * k + 0.02,
                                                        0.1 * scale * k + 0.05],
                             end=0.1 * scale * k + 0.05, prompt_tokens=10, completion_tokens=3,
                             counted_from_usage=True) for k in (1, 2, 3)]
    records.append(RequestRecord(3, error="HTTP 500: boom"))
    return {"request_rate": rate, **summarize(records, 1.0 * scale), "requests": [record_dict(r) for r in records]}


def assert_pngs(paths: list[Path], names: list[str]) -> None:
    assert [p.name for p in paths] == names
    for path in paths:
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # something is drawn


def test_a_single_run_gets_its_latency_distributions(tmp_path: Path) -> None:
    paths = write_plots([run("inf", 1.0)], tmp_path / "plots", "kvserve random")
    assert_pngs(paths, ["ttft.png", "tpot.png", "e2e.png"])


def test_a_sweep_also_gets_throughput_and_p99_against_rate(tmp_path: Path) -> None:
    runs = [run(1.0, 1.0), run(4.0, 2.0), run("inf", 3.0)]
    paths = write_plots(runs, tmp_path, "kvserve random")
    assert_pngs(paths, ["ttft.png", "tpot.png", "e2e.png", "throughput_vs_rate.png", "p99_latency_vs_rate.png"])
