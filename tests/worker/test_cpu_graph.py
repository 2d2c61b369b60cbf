"""CPU step graphs: replayed decode steps give exactly the eager steps' tokens and hidden states, for every family
and through chunked prefill, prefix hits, preemption, samples and quantized KV; kernel calls are recorded on the
recording thread only; a step that reads a value into Python, or whose graph would pass the memory budget, stays
eager."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvserve import LLM
from kvserve.model.checkpoint import ARCHITECTURES
from kvserve.model.layers.cpu_fused_ops import cpu_fused_ops
from kvserve.model.layers.norm import RMSNorm
from kvserve.native import recording
from kvserve.worker import cpu_graph
from kvserve.worker.cpu_graph import MAX_GRAPH_TOKENS, UnreplayableStep, _StepRecorder
from tests.conftest import assert_all_blocks_free, greedy_token_ids

MAX_NEW = 10


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 17, 1, 33, 9)]


def graphs_of(llm: LLM):
    return llm.engine.core.runner.graphs


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_replayed_steps_give_the_eager_tokens_for_every_family(tiny_checkpoints, arch: str) -> None:
    path = str(tiny_checkpoints[arch])
    eager = LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True)
    assert graphs_of(eager) is None
    expected = greedy_token_ids(eager, prompts(), MAX_NEW)
    assert eager.stats()["num_graph_replays"] == 0

    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    assert greedy_token_ids(llm, prompts(), MAX_NEW) == expected
    graphs = graphs_of(llm)
    assert graphs.num_replays > 0 and set(graphs.graphs) <= {(n, ()) for n in range(1, MAX_GRAPH_TOKENS + 1)}
    assert llm.stats()["num_graph_replays"] == graphs.num_replays
    assert_all_blocks_free(llm)


def test_chunks_prefix_hits_preemption_samples_and_quantized_kv_replay_exactly(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    for kv_cache_dtype in ("auto", "int8"):
        options = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
        eager = LLM(path, num_kv_blocks=64, enforce_eager=True, **options)
        expected = greedy_token_ids(eager, prompts(), MAX_NEW, n=2)

        cached = LLM(path, num_kv_blocks=64, **options)
        assert greedy_token_ids(cached, prompts(), MAX_NEW, n=2) == expected
        assert greedy_token_ids(cached, prompts(), MAX_NEW, n=2) == expected  # prefix hits now
        assert cached.stats()["prefix_cache_hits"] > 0 and graphs_of(cached).num_replays > 0
        assert_all_blocks_free(cached)

        small = LLM(path, num_kv_blocks=14, block_size=4, **options)
        assert greedy_token_ids(small, prompts(), MAX_NEW, n=2) == expected
        assert small.stats()["num_preemptions"] > 0 and graphs_of(small).num_replays > 0
        assert_all_blocks_free(small)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_replay_equals_the_eager_forward_bit_for_bit(tiny_checkpoints, arch: str, kv_cache_dtype: str) -> None:
    llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", num_kv_blocks=64, max_num_seqs=3,
              kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.core.runner
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = runner._forward

    def both(batch):
        replayed = forward(batch).clone()
        meta = runner.step_metadata(batch.attn)
        eager = runner.model(batch.input_ids, batch.positions, meta, runner.kv)  # rewrites the same K/V
        hidden.append((replayed, eager))
        return replayed

    runner._forward = both
    greedy_token_ids(llm, prompts()[:3], MAX_NEW)
    assert runner.graphs.num_replays > 0
    for replayed, eager in hidden:
        assert torch.equal(replayed, eager)


def test_kernel_calls_are_recorded_on_the_recording_thread_only() -> None:
    """Two engines of one process record step graphs at once, each its own thread's calls (one slot for the
    process failed every step of the second engine while the first recorded)."""
    ops = cpu_fused_ops()
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(2, 64)
    calls: list[str] = []
    others: list[str] = []

    def record_elsewhere() -> None:
        with recording(lambda function, args: others.append(function.name)):
            ops.rms_norm(norm, x)
            ops.rms_norm(norm, x)

    with recording(lambda function, args: calls.append(function.name)):
        ops.rms_norm(norm, x)
        other = threading.Thread(target=record_elsewhere)
        other.start()
        other.join()
        with pytest.raises(RuntimeError, match="already open in this thread"):
            with recording(lambda *_: None):
                pass
    assert calls == ["kvserve_add_rms_norm_f32"] and others == ["kvserve_add_rms_norm_f32"] * 2
    ops.rms_norm(norm, x)  # closed: nothing more is recorded
    assert calls == ["kvserve_add_rms_norm_f32"]


def test_recording_a_step_graph_imports_no_torch_dynamo(tiny_checkpoints) -> None:
    """torch wraps a dispatch mode's ``__torch_dispatch__`` to keep torch.compile out of it, importing torch._dynamo
    at its first call: 2-3 s of a process's first decode step on a small CPU (and of a server's warm-up)."""
    import subprocess
    import sys

    script = ("import sys; from kvserve import LLM, SamplingParams; "
              "llm = LLM(sys.argv[1], dtype='float32', num_kv_blocks=16); "
              "llm.generate(['ab'], SamplingParams(max_tokens=3, ignore_eos=True)); "
              "print(bool(llm.engine.core.runner.graphs.graphs), 'torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoints["llama"])], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]  # a step graph recorded; torch._dynamo never imported


def test_reading_a_value_into_python_makes_a_step_unreplayable() -> None:
    x = torch.randn(4)
    with pytest.raises(UnreplayableStep, match="_local_scalar_dense"):
        with _StepRecorder():
            (x * 2).sum().item()


def test_allocations_are_not_replayed_and_an_in_place_op_replays_into_its_input() -> None:
    x, index = torch.zeros(4, 3), torch.tensor([2])
    with _StepRecorder() as recorder:
        made = x.new_empty(1, 3)
        made.fill_(1.0)
        x.index_copy_(0, index, made)
    replayed = [call.op for call in recorder.calls]
    assert torch.ops.aten.new_empty.default not in replayed
    assert replayed == [torch.ops.aten.fill_.Scalar, torch.ops.aten.index_copy_.default]
    x.zero_()
    for call in recorder.calls:
        call()
    assert x[2].tolist() == [1.0, 1.0, 1.0] and x[[0, 1, 3]].abs().sum() == 0


def test_a_step_that_reads_a_value_runs_eagerly_with_the_same_tokens(tiny_checkpoints, monkeypatch) -> None:
    path = str(tiny_checkpoints["llama"])
    expected = greedy_token_ids(LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True), prompts(), MAX_NEW)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    model = llm.engine.core.runner.model
    forward = type(model).forward

    def reads_a_value(self, input_ids, positions, attn, kv, lora=None):
        int(input_ids.sum())  # a host read inside the forward: no graph can replay that
        return forward(self, input_ids, positions, attn, kv, lora)

    monkeypatch.setattr(type(model), "forward", reads_a_value)
    assert greedy_token_ids(llm, prompts(), MAX_NEW) == expected
    graphs = graphs_of(llm)
    assert graphs.graphs == {} and graphs.eager_sizes and graphs.num_replays == 0


def test_sizes_past_the_memory_budget_stay_eager(tiny_checkpoints, monkeypatch) -> None:
    path = str(tiny_checkpoints["llama"])
    expected = greedy_token_ids(LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True), prompts(), MAX_NEW)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    first = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    greedy_token_ids(first, prompts()[:1], 3)
    one_token_bytes = graphs_of(first).num_bytes  # the one-token graph's own tensors
    assert one_token_bytes > 0
    monkeypatch.setattr(cpu_graph, "MAX_GRAPH_BYTES", 3 * one_token_bytes)  # room for sizes 1 and 2 at most
    assert greedy_token_ids(llm, prompts(), MAX_NEW) == expected
    graphs = graphs_of(llm)
    assert graphs.eager_sizes and graphs.num_bytes <= 3 * one_token_bytes
    assert max((n for n, _ in graphs.graphs), default=0) <= 2


def test_steps_past_the_rope_tables_first_reach_run_eagerly_and_exactly(tiny_checkpoints, monkeypatch) -> None:
    """The rope tables cover ``MAX_ROPE_TABLE_POSITIONS`` at first and grow as steps reach further: a graph
    recorded over the first tables, replayed past them, read out of bounds (tables capped at 16 here)."""
    from kvserve.model.layers import rotary

    path = str(tiny_checkpoints["llama"])
    short = [[5, 6], [7, 8, 9], [10, 11, 12, 13]]  # decodes replayed below position 16, then past it
    expected = greedy_token_ids(LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True), short, 30)
    monkeypatch.setattr(rotary, "MAX_ROPE_TABLE_POSITIONS", 16)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    assert greedy_token_ids(llm, short, 30) == expected
    assert graphs_of(llm).num_replays > 0


def test_graphs_are_recorded_anew_when_torch_s_thread_count_changes(tiny_checkpoints) -> None:
    """A kernel call is recorded with the thread count it ran with: replayed after ``torch.set_num_threads``
    changed it, a step's 41 kernel calls kept asking for the old count (the cores oversubscribed)."""
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    threads = torch.get_num_threads()
    greedy_token_ids(llm, prompts()[:1], 4)
    graphs = graphs_of(llm)
    recorded = graphs.graphs[1, ()]
    odd_count = 7  # no kernel's last argument but a thread count is likely to be 7
    assert threads in last_kernel_args(recorded) and odd_count not in last_kernel_args(recorded)
    try:
        torch.set_num_threads(odd_count)
        greedy_token_ids(llm, prompts()[:1], 4)
        rerecorded = graphs.graphs[1, ()]
        assert rerecorded is not recorded and odd_count in last_kernel_args(rerecorded)
    finally:
        torch.set_num_threads(threads)


def last_kernel_args(graph) -> set[int]:
    """The last arguments of a graph's kernel calls: most kernels take their thread count there."""
    return {call.args[-1].value for call in graph.calls if isinstance(call, cpu_graph._KernelCall)}
