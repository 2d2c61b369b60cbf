"""CUDA step graphs: the capture ladder and the static inputs' padding and sharing groups (on CPU); on a GPU
(``-m gpu``), replayed decode steps give transformers' greedy tokens for every family, through padding, chunked
prefill, prefix hits, preemption, quantized KV and cascade attention, and every block is free afterwards."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM
from kvserve.attention.backend import AttentionInputs
from kvserve.model.checkpoint import ARCHITECTURES
from kvserve.worker.cuda_graph import MAX_CAPTURE_SIZE, CudaStepGraphs, capture_sizes
from kvserve.worker.static_inputs import StaticStepInputs
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

MAX_NEW = 10


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 9, 64, 100, 256, 512, 1000])
def test_the_ladder_holds_max_num_seqs_and_pads_little(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] >= min(max_num_seqs, MAX_CAPTURE_SIZE) and (len(sizes) == 1 or sizes[-2] < max_num_seqs)
    for n in range(1, sizes[-1] + 1):
        padded = next(s for s in sizes if s >= n)
        assert padded - n <= 7 if n <= 64 else (padded - n) / padded < 0.2


def decode_inputs(seq_lens: list[int], width: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
    n = len(seq_lens)
    tables = torch.tensor([[rng.randrange(100) for _ in range(width)] for _ in range(n)], dtype=torch.int32)
    attn = AttentionInputs(
        num_decodes=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor([rng.randrange(1600) for _ in range(n)]), query_lens_list=[1] * n,
        seq_lens_list=seq_lens, block_size=16,
    )
    return torch.tensor([rng.randrange(500) for _ in range(n)]), torch.tensor([s - 1 for s in seq_lens]), attn


def test_a_step_fills_its_rows_and_pads_the_rest_of_its_graph() -> None:
    rng = random.Random(0)
    inputs = StaticStepInputs.allocate(16, 8, 16, torch.device("cpu"), 1, padding_slot=1600)
    inputs.load(*decode_inputs([40] * 16, 8, rng))  # a full step first: every row real
    input_ids, positions, attn = decode_inputs([5, 70, 33], 5, rng)
    graph = inputs.prefix(8)
    graph.load(input_ids, positions, attn)
    assert torch.equal(graph.input_ids[:3], input_ids) and torch.equal(graph.positions[:3], positions)
    assert torch.equal(graph.seq_lens[:3], attn.seq_lens) and torch.equal(graph.slot_mapping[0][:3], attn.slot_mapping)
    assert torch.equal(graph.block_tables[0][:3, :5], attn.block_tables)
    assert not graph.input_ids[3:].any() and not graph.positions[3:].any() and not graph.seq_lens[3:].any()
    assert (graph.slot_mapping[0][3:] == 1600).all()
    assert inputs.input_ids.data_ptr() == graph.input_ids.data_ptr()  # a prefix shares the set's memory
    built = graph.attention_inputs([128] * 8)
    assert built.num_tokens == 8 and built.num_decodes == 8 and built.query_start_loc.tolist() == list(range(9))
    assert built.max_shared_prefix_len == 128  # what any step of the graph may share
    assert not built.shared_prefix_lens.any() and built.sharing_order.tolist() == list(range(8))


def test_a_steps_sharing_groups_are_loaded_and_its_padding_shares_nothing() -> None:
    rng = random.Random(1)
    inputs = StaticStepInputs.allocate(8, 8, 16, torch.device("cpu"), 1, padding_slot=1600)
    input_ids, positions, attn = decode_inputs([70, 40, 70, 66], 5, rng)
    attn = dataclasses.replace(attn, shared_prefix_lens=torch.tensor([64, 0, 64, 64], dtype=torch.int32),
                               sharing_order=torch.tensor([1, 0, 2, 3], dtype=torch.int32), max_shared_prefix_len=64)
    graph = inputs.prefix(8)
    graph.load(input_ids, positions, attn)
    built = graph.attention_inputs([128] * 8)
    assert built.shared_prefix_lens.tolist() == [64, 0, 64, 64, 0, 0, 0, 0]
    assert built.sharing_order.tolist() == [1, 0, 2, 3, 4, 5, 6, 7]  # a padding row in its own place
    graph.load(*decode_inputs([70, 40], 5, rng))  # a step with nothing computed: nothing shared, in order
    assert not built.shared_prefix_lens.any() and built.sharing_order.tolist() == list(range(8))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 17, 1, 33, 9)]


@on_gpu
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_replayed_decode_steps_give_transformers_tokens(tiny_checkpoints, arch: str, enforce_eager: bool) -> None:
    path = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [[hf_greedy(hf, p, MAX_NEW)] for p in prompts()]  # one sample per prompt
    llm = LLM(str(path), dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=8,
              enforce_eager=enforce_eager)
    assert greedy_token_ids(llm, prompts(), MAX_NEW) == expected
    graphs = llm.engine.core.runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs.sizes == [1, 2, 4, 8] and graphs.num_replays > 0
    assert_all_blocks_free(llm)


@on_gpu
def test_chunks_prefix_hits_preemption_and_quantized_kv_through_graphs(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    for kv_cache_dtype in ("auto", "int8"):
        options = dict(dtype="float32", device="cuda", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
        expected = greedy_token_ids(LLM(path, num_kv_blocks=64, enforce_eager=True, **options), prompts(), MAX_NEW, n=2)

        cached = LLM(path, num_kv_blocks=64, **options)
        assert greedy_token_ids(cached, prompts(), MAX_NEW, n=2) == expected
        assert greedy_token_ids(cached, prompts(), MAX_NEW, n=2) == expected  # prefix hits now
        assert cached.stats()["prefix_cache_hits"] > 0 and cached.engine.core.runner.graphs.num_replays > 0
        assert_all_blocks_free(cached)

        small = LLM(path, num_kv_blocks=14, block_size=4, **options)
        assert greedy_token_ids(small, prompts(), MAX_NEW, n=2) == expected
        assert small.stats()["num_preemptions"] > 0 and small.engine.core.runner.graphs.num_replays > 0
        assert_all_blocks_free(small)



@on_gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: windowed layers attend alone
def test_samples_of_one_prompt_share_its_keys_through_graphs(tiny_checkpoints, arch: str) -> None:
    """24 greedy samples of a 100-token prompt: replayed in a graph of 24 decodes, which attends the keys they
    share once per tile of decodes (cascade), each gives transformers' tokens."""
    path = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = prompts(seed=5)[1] * 3  # 120 tokens
    llm = LLM(str(path), dtype="float32", device="cuda", num_kv_blocks=256, block_size=16, max_num_seqs=24)
    assert greedy_token_ids(llm, [prompt], MAX_NEW, n=24)[0] == [hf_greedy(hf, prompt, MAX_NEW)] * 24
    assert 24 in llm.engine.core.runner.graphs.sizes and llm.engine.core.runner.graphs.num_replays > 0
    assert_all_blocks_free(llm)


@on_gpu
def test_a_forward_that_cannot_be_captured_leaves_every_step_eager(tiny_checkpoints, monkeypatch) -> None:
    path = str(tiny_checkpoints["llama"])
    expected = greedy_token_ids(LLM(path, dtype="float32", device="cuda", num_kv_blocks=64, enforce_eager=True),
                                prompts(), MAX_NEW)

    def uncapturable(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaStepGraphs, "_capture_all", uncapturable)
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=8)
    assert greedy_token_ids(llm, prompts(), MAX_NEW) == expected
    graphs = llm.engine.core.runner.graphs
    assert not graphs.graphs and graphs.num_replays == 0
    assert_all_blocks_free(llm)
