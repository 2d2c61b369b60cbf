"""``--distributed-executor-backend ray``: tensor-parallel ranks as Ray actors on a local Ray cluster. TP=2 gives
transformers' greedy tokens (and TP=1's) under chunked prefill, prefix hits and preemption; a killed actor and a
group Ray cannot place are clear errors that leave nothing placed. Needs Ray (``pip install 'kvserve[ray]'``),
which CI does not install; the error without Ray is tested in test_parallel.py, which runs without it."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.sources import ModelLocation  # noqa: E402
from kvserve.worker import ray_workers  # noqa: E402
from kvserve.worker.model_runner import RunnerOptions  # noqa: E402
from kvserve.worker.parallel import TensorParallelError, WorkerSpec  # noqa: E402
from tests.conftest import greedy_token_ids, hf_greedy  # noqa: E402
from tests.engine.test_llm_equality import MAX_NEW, _prompts  # noqa: E402
from tests.worker.test_parallel import SQUEEZED, assert_squeezed_run  # noqa: E402

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
# a rank reserves its share of the torch threads in its bundle: the cluster holds both ranks' shares
NUM_CPUS = 2 * max(1, torch.get_num_threads() // 2)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()


def _close(llm: LLM) -> None:
    llm.engine.close()
    assert not any(worker.is_alive() for worker in llm.engine.core.runner.peers.workers)
    _assert_nothing_placed()


def _assert_nothing_placed() -> None:
    """The placement group removed and the actors gone: the cluster's CPUs are all free again."""
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < NUM_CPUS:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ray_tp2_greedy_equals_transformers_and_tp1(family: str, tiny_checkpoints, cluster) -> None:
    path = tiny_checkpoints[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, [5, 40, 17, 1, 33, 9])
    prompts.append(prompts[1][:24] + prompts[4][:5])  # shares whole blocks with the second prompt: a prefix hit
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert [o[0] for o in greedy_token_ids(LLM(str(path), **SQUEEZED), prompts, MAX_NEW)] == expected
    assert_squeezed_run(LLM(str(path), **SQUEEZED, **RAY), prompts, expected, _close)


def test_a_killed_actor_ends_the_run_with_an_error_naming_it(tiny_checkpoints, cluster) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, **RAY)
    worker = llm.engine.core.runner.peers.workers[0]
    assert greedy_token_ids(llm, [[5, 6, 7]], 4)  # runs
    killer = threading.Timer(0.2, ray.kill, (worker.actor,))
    killer.start()
    with pytest.raises(TensorParallelError, match=rf"worker rank 1 \({worker.name}\) died \(.*killed by `ray.kill`"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4,
                     SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
    killer.join()
    with pytest.raises(TensorParallelError, match="stopped after an earlier failure"):
        greedy_token_ids(llm, [[5, 6, 7]], 4)
    _assert_nothing_placed()


def test_an_actor_that_fails_to_start_is_named(tmp_path, cluster) -> None:
    missing = ModelLocation("hf_dir", tmp_path / "missing", "missing")
    spec = WorkerSpec(missing, torch.float32, "cpu", RunnerOptions(block_size=4), num_threads=1)
    group = ray_workers.start_ray_workers(spec, 2, torch.device("cpu"))
    with pytest.raises(TensorParallelError, match=rf"worker rank 1 \({group.workers[0].name}\) failed to load the "
                                                  "model: .*missing"):
        group.init_kv_cache(num_blocks=8, max_model_len=64)
    assert not group.workers[0].is_alive()
    _assert_nothing_placed()


def test_a_group_ray_cannot_place_is_an_error(tiny_checkpoints, cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(ray_workers, "_cpus", lambda spec: NUM_CPUS)  # each rank asks for the whole cluster
    num_threads = torch.get_num_threads()
    with pytest.raises(TensorParallelError, match=r"Ray could not place the tensor-parallel group within 1 s: 2 "
                                                  r"bundles .* STRICT_PACK"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, **RAY)
    assert torch.get_num_threads() == num_threads
    _assert_nothing_placed()


class _Group:
    """What ``_check_inherited`` reads of a placement group: its bundles."""

    def __init__(self, *bundles: dict[str, float]) -> None:
        self.bundle_specs = list(bundles)


def test_an_inherited_placement_group_needs_a_bundle_per_rank() -> None:
    cpu = WorkerSpec(ModelLocation("hf_dir", Path("m"), "m"), torch.float32, "cpu", RunnerOptions(16), 1)
    cuda = dataclasses.replace(cpu, device_type="cuda")
    group = _Group({"CPU": 0.5}, {"CPU": 0.5})
    assert ray_workers._check_inherited(group, cpu, 2) is group
    with pytest.raises(TensorParallelError, match="3 needs a bundle per rank"):
        ray_workers._check_inherited(group, cpu, 3)
    with pytest.raises(TensorParallelError, match="each with a GPU"):
        ray_workers._check_inherited(group, cuda, 2)
    assert ray_workers._rank_resources(group, True, cpu, 1) == {"num_cpus": 0.5, "num_gpus": 0}
