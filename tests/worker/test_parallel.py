"""Tensor parallelism through the whole engine, over gloo on CPU: TP=2 (and 4) gives transformers' greedy tokens for
every family (and with KV heads replicated, and Gemma 3's sliding layers in KV cache groups that free their blocks),
under chunked prefill, prefix hits and preemption; the features that live on rank 0, and LoRA adapters (each rank
its part, installed and removed between the same steps), give what TP=1 gives; a dead
worker and a shape that does not split are clear errors that leave no process behind. Each engine starts worker
processes (a few seconds each): the tests share them where they can.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.engine_args import EngineArgs
from kvserve.model.checkpoint import make_checkpoint
from kvserve.model.lora_adapter import LoRAAdapter
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.worker import parallel
from kvserve.worker.parallel import Failed, InitKV, Ready, Shutdown, TensorParallelError, WorkerGroup
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy
from tests.engine.test_llm_equality import MAX_NEW, _prompts

# a small pool, a small step and small blocks: prompts are prefilled in chunks and requests get preempted
SQUEEZED = dict(dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)


def _close(llm: LLM) -> None:
    workers = llm.engine.core.runner.peers.workers
    llm.engine.close()
    assert not any(w.is_alive() for w in workers)


@pytest.fixture(scope="module")
def one_kv_head_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return make_checkpoint(tmp_path_factory.mktemp("gemma3-1kv"), "gemma3", "tiny-1kv", seed=0)


# by default the families that differ most: biases on q/k/v; a tied head with q/k norms; Gemma's norms, sliding
# layers and a single KV head that each rank holds whole. Slow: the others, and 4 ranks (each KV head on 2 ranks)
FAMILIES = [("qwen2", 2), ("qwen3", 2), ("gemma3-1kv", 2)] + [
    pytest.param(arch, size, marks=pytest.mark.slow)
    for arch, size in [("qwen3", 4), ("llama", 2), ("mistral", 2), ("gemma3", 2)]
]


@pytest.mark.parametrize("family, size", FAMILIES)
def test_tp_greedy_equals_transformers(family: str, size: int, tiny_checkpoints,
                                       request: pytest.FixtureRequest) -> None:
    path = (request.getfixturevalue("one_kv_head_checkpoint") if family == "gemma3-1kv"
            else tiny_checkpoints[family])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, [5, 40, 17, 1, 33, 9])
    prompts.append(prompts[1][:24] + prompts[4][:5])  # shares whole blocks with the second prompt: a prefix hit
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    num_threads = torch.get_num_threads()
    llm = LLM(str(path), tensor_parallel_size=size, **SQUEEZED)
    assert torch.get_num_threads() == max(1, num_threads // size)  # rank 0's share of the cores
    # Gemma 3's sliding layers free their blocks in KV cache groups of their own, laid out alike on every rank
    assert llm.stats()["kv_cache_groups"] == (2 if family.startswith("gemma3") else 1)
    assert_squeezed_run(llm, prompts, expected, _close)
    assert torch.get_num_threads() == num_threads  # given back


def assert_squeezed_run(llm: LLM, prompts: list[list[int]], expected: list[list[int]],
                        close: Callable[[LLM], None]) -> None:
    """On the ``SQUEEZED`` pool: greedy tokens equal ``expected``, with preemptions and prefix hits on the way,
    and every block free at the end; ``close`` runs whatever fails."""
    try:
        assert [o[0] for o in greedy_token_ids(llm, prompts, MAX_NEW)] == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert_all_blocks_free(llm)
    finally:
        close(llm)


def _rank_zero_features(llm: LLM, prompt: list[int]) -> tuple[list[list[int]], list[float]]:
    """n > 1, seeded sampling, logprobs, prompt logprobs, a grammar and speculation (all on rank 0): the tokens
    of every sample, and every logprob returned."""
    params = [
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    samples = [c for o in outs for c in o.outputs]
    positions = [pos for c in samples for pos in c.logprobs or []] + outs[0].prompt_logprobs[1:]
    return [c.token_ids for c in samples], [v.logprob for pos in positions for v in pos.values()]


def test_tp2_rank_zero_features_equal_tp1(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    prompt = _prompts(512, [20])[0] * 2  # repeats itself: ngram speculation finds drafts
    options = dict(dtype="float32", num_kv_blocks=64, speculative_method="ngram")
    want_tokens, want_logprobs = _rank_zero_features(LLM(path, **options), prompt)
    llm = LLM(path, tensor_parallel_size=2, **options)
    try:
        tokens, logprobs = _rank_zero_features(llm, prompt)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        assert llm.stats()["spec_decode_num_draft_tokens"] > 0
        assert_all_blocks_free(llm)
    finally:
        _close(llm)


# one batch mixing two adapters and the base model; then adapter 1 removed, adapter 3 loaded, and another batch
LORA_BATCHES = (("first", None, "second", "first", "second", None), ("third", "second", None, "third", None, "second"))


def _lora_batches(llm: LLM, prompts: list[list[int]], adapters: dict[str | None, LoRARequest | None]
                  ) -> list[list[list[int]]]:
    """Each of ``LORA_BATCHES``' greedy tokens, adapter 1 removed between them."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    batches = []
    for names in LORA_BATCHES:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=[adapters[name] for name in names])
        batches.append([list(o.outputs[0].token_ids) for o in outs])
        if adapters["first"].lora_int_id in llm.list_loras():
            assert llm.remove_lora(adapters["first"].lora_int_id)
    return batches


def test_tp2_lora_adapters_equal_tp1(tiny_checkpoints, tmp_path) -> None:
    """Every rank installs its part of each adapter and removes it, between the same steps: TP=2 gives TP=1's
    tokens for batches mixing adapters (of every projection; of some, rsLoRA) and the base model, an adapter
    removed and another loaded between them."""
    path = tiny_checkpoints["qwen2"]
    made = {
        "first": make_lora_adapter(path, tmp_path / "first", seed=1),
        "second": make_lora_adapter(path, tmp_path / "second", rank=4, seed=2, use_rslora=True,
                                    targets=("q_proj", "v_proj", "down_proj")),
        "third": make_lora_adapter(path, tmp_path / "third", seed=3,
                                   targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
    }
    adapters = {None: None, **{name: LoRARequest(name, i, str(made[name])) for i, name in enumerate(made, start=1)}}
    prompts = _prompts(512, [5, 23, 12, 1, 9, 17])
    options = dict(dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    alone = LLM(str(path), **options)
    want = _lora_batches(alone, prompts, adapters)
    base = [o[0] for o in greedy_token_ids(alone, prompts, MAX_NEW)]
    for names, tokens in zip(LORA_BATCHES, want):  # not vacuous: each adapter moves some rows off the base model's
        assert {name for name, got, b in zip(names, tokens, base) if got != b} == set(names) - {None}
    llm = LLM(str(path), tensor_parallel_size=2, **options)
    try:
        assert _lora_batches(llm, prompts, adapters) == want
        assert llm.list_loras() == {2, 3}
        assert_all_blocks_free(llm)
    finally:
        _close(llm)


def test_a_killed_worker_ends_the_run_with_an_error_naming_it(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    worker = llm.engine.core.runner.peers.workers[0].process
    assert greedy_token_ids(llm, [[5, 6, 7]], 4)  # runs
    killer = threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(TensorParallelError, match=rf"worker rank 1 \(pid {worker.pid}\) died"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4,
                     SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
    killer.join()
    assert not worker.is_alive()
    with pytest.raises(TensorParallelError, match="stopped after an earlier failure"):
        greedy_token_ids(llm, [[5, 6, 7]], 4)
    assert not multiprocessing.active_children()


def test_a_shape_that_does_not_split_is_an_error_at_start_up(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("options, named", [
    (dict(quantization="int8"), "quantization='int8'"),
    (dict(kv_offload_memory=1.0), "kv_offload_memory"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(distributed_executor_backend="slurm"), "distributed_executor_backend must be one of mp, ray"),
])
def test_combinations_not_supported_yet_are_refused_by_name(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineArgs(**{"tensor_parallel_size": 2, **options}).create_engine_config()


def test_the_ray_backend_without_ray_says_how_to_get_it(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"--distributed-executor-backend ray needs Ray: "
                                          r"pip install 'kvserve\[ray\]'"):  # the configuration's check
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").create_engine_config()
    with pytest.raises(ImportError, match=r"--distributed-executor-backend ray needs Ray"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
            distributed_executor_backend="ray")
    assert not multiprocessing.active_children()


def test_the_ray_backend_with_one_rank_runs_it_here(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # not needed: there is nothing to place
    path = str(tiny_checkpoints["llama"])
    with caplog.at_level(logging.INFO, logger="kvserve.engine.llm_engine"):
        llm = LLM(path, dtype="float32", num_kv_blocks=64, distributed_executor_backend="ray")
    assert "nothing to place, the one rank runs in this process" in caplog.text
    assert greedy_token_ids(llm, [[5, 6, 7]], 6) == greedy_token_ids(LLM(path, dtype="float32", num_kv_blocks=64),
                                                                     [[5, 6, 7]], 6)


class _FakeWorker:
    """A worker alive until joined: the pipes are what the test drives."""

    def __init__(self, pid: int) -> None:
        self.name, self.exitcode = f"pid {pid}", None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float) -> None:
        self.exitcode = 0

    def kill(self) -> None:
        self.exitcode = -9

    def end_reason(self) -> str:
        return f"exit code {self.exitcode}"


def _group_of_fakes(num_workers: int) -> tuple[WorkerGroup, list]:
    pipes = [multiprocessing.Pipe() for _ in range(num_workers)]
    workers = [_FakeWorker(100 + rank) for rank in range(1, num_workers + 1)]
    return WorkerGroup(workers, [ours for ours, _ in pipes], torch.get_num_threads()), [theirs for _, theirs in pipes]


def test_workers_may_answer_in_any_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "LOAD_TIMEOUT_SECONDS", 5.0)
    group, worker_ends = _group_of_fakes(3)
    for end in worker_ends[1:]:  # the others are ready (model loaded, KV pool allocated) before the first
        end.send(Ready())
        end.send(Ready())
    first_ready = threading.Timer(0.3, lambda: [worker_ends[0].send(Ready()) for _ in range(2)])
    first_ready.start()
    group.init_kv_cache(num_blocks=5, max_model_len=64)
    first_ready.join()
    assert all(end.recv() == InitKV(5, 64) for end in worker_ends)
    group.close()


def test_a_worker_that_fails_to_start_is_named() -> None:
    group, worker_ends = _group_of_fakes(2)
    worker_ends[0].send(Ready())
    worker_ends[1].send(Failed("CheckpointError: the checkpoint is missing 1 tensor(s)"))
    with pytest.raises(TensorParallelError, match=r"worker rank 2 \(pid 102\) failed to load the model: "
                                                  "CheckpointError"):
        group.init_kv_cache(num_blocks=5, max_model_len=64)


def test_a_group_dropped_unclosed_stops_its_workers_and_releases_what_they_held() -> None:
    """An LLM dropped without close(): its Ray placement group stayed, and the next group waited for its CPUs;
    rank 0 kept half its threads."""
    released = []
    threads = torch.get_num_threads()
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    workers = [_FakeWorker(101), _FakeWorker(102)]
    group = WorkerGroup(workers, [ours for ours, _ in pipes], threads, lambda: released.append(True))
    torch.set_num_threads(1)
    try:
        del group
        gc.collect()
        assert released == [True] and all(not worker.is_alive() for worker in workers)
        assert all(isinstance(theirs.recv(), Shutdown) for _, theirs in pipes)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)


def test_lora_adapters_reach_every_worker_on_the_steps_pipe() -> None:
    """Rank 0 sends an adapter's install and removal down each worker's pipe, where its loop installs the adapter
    (rank 0's copy: the same content) and removes it on its runner, in the order sent."""
    group, worker_ends = _group_of_fakes(2)
    adapter = LoRAAdapter("mine", Path(), 1, 2.0, "d1", {"m": (torch.ones(1, 3), torch.arange(2.0)[:, None])})
    group.add_lora(5, adapter)
    group.remove_lora(5)
    group.close()  # Shutdown: the loop's end
    for end in worker_ends:
        calls: list[tuple] = []
        runner = types.SimpleNamespace(add_lora=lambda i, a: calls.append(("add", i, a)),
                                       remove_lora=lambda i: calls.append(("remove", i)))
        parallel._serve(runner, end)
        assert [call[:2] for call in calls] == [("add", 5), ("remove", 5)]
        sent = calls[0][2]
        assert (sent.name, sent.digest, sent.scale) == ("mine", "d1", 2.0)
        assert all(torch.equal(x, y) for x, y in zip(sent.weights["m"], adapter.weights["m"]))


def test_a_collective_that_times_out_while_every_worker_runs_says_one_is_stalled() -> None:
    group, _ = _group_of_fakes(2)
    with pytest.raises(TensorParallelError, match="timed out after 120 s while every worker still runs: one is "
                                                  "stalled"):
        with group.stepping():
            raise RuntimeError("[gloo] Timed out waiting 120000ms for recv operation to complete")


def test_a_worker_that_dies_before_it_joins_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Named before rank 0 joins the group, whose rendezvous would wait its whole 120 s timeout for it."""
    from torch import distributed as dist

    joined = []
    monkeypatch.setattr(parallel, "join_group", lambda *args: joined.append(args))

    def launch(address: tuple[str, int]) -> tuple[list, list]:
        workers = [_FakeWorker(101), _FakeWorker(102)]
        arrived = dist.TCPStore(*address, 3, is_master=False)
        arrived.set("kvserve-tp-arrived/1", b"")  # rank 1 comes as far as joining; rank 2 dies on its way
        workers[1].exitcode = 1
        return workers, [multiprocessing.Pipe()[0] for _ in workers]

    spec = types.SimpleNamespace(device_type="cpu", num_threads=torch.get_num_threads())
    with pytest.raises(TensorParallelError, match=r"worker rank 2 \(pid 102\) died \(exit code 1\)"):
        parallel.form_group(spec, 3, "127.0.0.1", launch)
    assert not joined
