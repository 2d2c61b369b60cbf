"""``LLM.start_profile`` / ``stop_profile`` (vLLM's): a gzipped Chrome trace of the steps between them, one a
pair, in the directory named (or vLLM's ``$VLLM_TORCH_PROFILER_DIR``), each step a range and the C attention
kernels ranges of their own; a stop without a start, a second start and no directory are RuntimeErrors naming
them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.attention.cpu_paged import PREFILL_KERNEL_RANGE
from kvserve.engine.profiler import STEP_RANGE
from tests.conftest import greedy_token_ids


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    # eager: a CPU step graph replays the kernels without their ranges
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, enforce_eager=True)


def _event_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as trace:
        return {event.get("name") for event in json.load(trace)["traceEvents"]}


def test_a_start_stop_pair_writes_one_trace_of_the_steps_between(llm: LLM, tmp_path: Path) -> None:
    llm.start_profile(str(tmp_path / "traces"))
    expected = greedy_token_ids(llm, [[5, 6, 7, 8, 9]], 3)
    path = Path(llm.stop_profile())
    assert path.parent == tmp_path / "traces" and path.name.endswith(".pt.trace.json.gz")
    assert list(path.parent.iterdir()) == [path]
    names = _event_names(path)
    assert STEP_RANGE in names and PREFILL_KERNEL_RANGE in names, sorted(n for n in names if n)[:40]
    assert greedy_token_ids(llm, [[5, 6, 7, 8, 9]], 3) == expected  # profiling changes no token
    llm.start_profile(str(tmp_path / "traces"))
    assert Path(llm.stop_profile()) != path and len(list(path.parent.iterdir())) == 2


def test_the_directory_may_come_from_vllms_variable(llm: LLM, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm.start_profile()
    assert Path(llm.stop_profile()).parent == tmp_path


def test_misuse_is_a_runtime_error_naming_it(llm: LLM, tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="stop_profile without a start_profile"):
        llm.stop_profile()
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="running already"):
        llm.start_profile(str(tmp_path))
    llm.stop_profile()
