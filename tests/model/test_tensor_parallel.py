"""The split math of the tensor-parallel layers, in one process: every rank's part is built and loaded from the
same full tensors, its collectives left out (a group whose all-reduce leaves the tensor as is), and the ranks'
outputs put together by hand (concatenated or summed) must equal the whole layer's, LoRA adapters' terms included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers import lora
from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.embedding import VocabEmbedding
from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod
from kvserve.model.layers.lora import MASKED_MAX_TOKENS, LoRAMapping, Projections, install_adapter
from kvserve.model.layers.tensor_parallel import ShardingError, TensorParallel, shard_vocab_head
from kvserve.model.lora_adapter import LoRAAdapter, LoRAAdapterError

HIDDEN, HEAD_DIM, MLP_FEATURES, LORA_RANK = 24, 6, 16, 3


class _Done:
    def wait(self) -> None:
        pass


class _OneProcessGroup:
    """Stands in for the other ranks: an all-reduce leaves each rank's partial sum for the test to add up."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        return _Done()


def _ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, size, _OneProcessGroup()) for rank in range(size)]


def _bind(*layers: Linear) -> None:
    for layer in layers:
        layer.bind(UnquantizedLinearMethod(), torch.float32)


def _weights(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _attention(num_heads: int, num_kv_heads: int, tp: TensorParallel | None) -> Attention:
    attn = Attention(hidden_size=HIDDEN, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                     layer_idx=0, backend=None, scale=1.0, sliding_window=None, qkv_bias=True, o_bias=True)
    if tp is not None:
        attn.shard(tp)
    _bind(attn.qkv_proj, attn.o_proj)
    tensors = {"q_proj": num_heads, "k_proj": num_kv_heads, "v_proj": num_kv_heads}
    for name, heads in tensors.items():
        attn.qkv_proj.load_weight("weight", _weights(heads * HEAD_DIM, HIDDEN), name)
        attn.qkv_proj.load_weight("bias", _weights(heads * HEAD_DIM), name)
    attn.o_proj.load_weight("weight", _weights(HIDDEN, num_heads * HEAD_DIM))
    attn.o_proj.load_weight("bias", _weights(HIDDEN))
    return attn


def _heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    return qkv.view(qkv.shape[0], -1, HEAD_DIM).split((num_heads, num_kv_heads, num_kv_heads), dim=1)


@pytest.mark.parametrize("num_heads, num_kv_heads, size", [(4, 2, 2), (4, 4, 2), (4, 1, 2), (4, 2, 4), (8, 2, 4)])
def test_attention_projections_split_by_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    whole = _attention(num_heads, num_kv_heads, None)
    x = _weights(5, HIDDEN)
    q, k, v = _heads(whole.qkv_proj(x), num_heads, num_kv_heads)
    group = num_heads // num_kv_heads  # query heads per KV head
    o_in = _weights(5, num_heads * HEAD_DIM)
    partial_sums = []
    for tp in _ranks(size):
        part = _attention(num_heads, num_kv_heads, tp)
        assert part.num_heads == num_heads // size and part.num_kv_heads == max(1, num_kv_heads // size)
        q_r, k_r, v_r = _heads(part.qkv_proj(x), part.num_heads, part.num_kv_heads)
        first_q = tp.rank * part.num_heads
        torch.testing.assert_close(q_r, q[:, first_q: first_q + part.num_heads])
        first_kv = first_q // group  # the KV heads this rank's query heads read, replicated if need be
        torch.testing.assert_close(k_r, k[:, first_kv: first_kv + part.num_kv_heads])
        torch.testing.assert_close(v_r, v[:, first_kv: first_kv + part.num_kv_heads])
        columns = slice(first_q * HEAD_DIM, (first_q + part.num_heads) * HEAD_DIM)
        partial_sums.append(part.o_proj(o_in[:, columns]))
    torch.testing.assert_close(sum(partial_sums), whole.o_proj(o_in))  # the bias added once


def _mlp(tp: TensorParallel | None) -> GatedMLP:
    layer = GatedMLP(HIDDEN, MLP_FEATURES, "silu", bias=True)
    if tp is not None:
        layer.shard(tp)
    _bind(layer.gate_up_proj, layer.down_proj)
    for name in ("gate_proj", "up_proj"):
        layer.gate_up_proj.load_weight("weight", _weights(MLP_FEATURES, HIDDEN) + float(name == "up_proj"), name)
        layer.gate_up_proj.load_weight("bias", _weights(MLP_FEATURES) - float(name == "up_proj"), name)
    layer.down_proj.load_weight("weight", _weights(HIDDEN, MLP_FEATURES))
    layer.down_proj.load_weight("bias", _weights(HIDDEN))
    return layer


def test_mlp_partial_sums_add_up_to_the_whole() -> None:
    x = _weights(3, HIDDEN)
    torch.testing.assert_close(sum(_mlp(tp)(x) for tp in _ranks(2)), _mlp(None)(x))


def _lora_adapter(name: str, shapes: dict[str, tuple[int, int]], seed: int) -> LoRAAdapter:
    """An adapter of rank ``LORA_RANK`` over ``shapes`` (target -> whole (in, out)), its weights keyed by target."""
    generator = torch.Generator().manual_seed(seed)
    weights = {target: (torch.randn(LORA_RANK, n_in, generator=generator),
                        torch.randn(n_out, LORA_RANK, generator=generator)) for target, (n_in, n_out) in shapes.items()}
    return LoRAAdapter(name, Path(), LORA_RANK, 0.5, name, weights)


def _lora_projections(attn: Attention, mlp: GatedMLP) -> Projections:
    packed = [(attn.qkv_proj, ("q_proj", "k_proj", "v_proj")), (mlp.gate_up_proj, ("gate_proj", "up_proj"))]
    return {**{target: (layer, target) for layer, targets in packed for target in targets},
            "o_proj": (attn.o_proj, None), "down_proj": (mlp.down_proj, None)}


@pytest.mark.parametrize("masked_max_tokens", [0, MASKED_MAX_TOKENS], ids=["grouped", "masked"])
@pytest.mark.parametrize("num_heads, num_kv_heads, size", [(4, 2, 2), (4, 1, 2), (8, 2, 4)])
def test_lora_adapters_split_with_their_layers(num_heads: int, num_kv_heads: int, size: int, masked_max_tokens: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank installs its part of two adapters (A whole and its rows of B on q/k/v and gate/up, per projection;
    its columns of A and B whole on o and down, KV heads replicated included): its q/k/v outputs are its slice of
    the whole layer's with the adapters' terms, and its o and MLP partial sums add up to the whole layer's, for
    rows of either adapter and of the base model, by groups of rows and by the masked GEMM pair."""
    monkeypatch.setattr(lora, "MASKED_MAX_TOKENS", masked_max_tokens)
    q, kv = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
    shapes = {"q_proj": (HIDDEN, q), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv), "o_proj": (q, HIDDEN),
              "gate_proj": (HIDDEN, MLP_FEATURES), "up_proj": (HIDDEN, MLP_FEATURES),
              "down_proj": (MLP_FEATURES, HIDDEN)}
    adapters = [_lora_adapter("every", shapes, seed=1),
                _lora_adapter("some", {t: shapes[t] for t in ("k_proj", "o_proj", "up_proj")}, seed=2)]

    def with_adapters(tp: TensorParallel | None) -> tuple[Attention, GatedMLP]:
        attn, mlp = _attention(num_heads, num_kv_heads, tp), _mlp(tp)
        for adapter_id, adapter in enumerate(adapters, start=1):
            install_adapter(_lora_projections(attn, mlp), adapter_id, adapter, torch.float32, torch.device("cpu"))
        return attn, mlp

    x, o_in = _weights(5, HIDDEN), _weights(5, q)
    mapping = LoRAMapping.of_tokens(np.array([1, 0, 2, 1, 2]), torch.device("cpu"))
    assert (mapping.token_groups is not None) == bool(masked_max_tokens)
    whole_attn, whole_mlp = with_adapters(None)
    qkv = whole_attn.qkv_proj(x, mapping)
    assert not torch.allclose(qkv, whole_attn.qkv_proj(x)) and not torch.allclose(whole_mlp(x, mapping), whole_mlp(x))
    o_sums, mlp_sums = [], []
    for tp in _ranks(size):
        attn, mlp = with_adapters(tp)
        qkv_r = attn.qkv_proj(x, mapping)
        for projection, (first, count) in attn.qkv_proj.tp_shard.ranges.items():
            whole_rows = qkv[:, whole_attn.qkv_proj.shard_rows()[projection]]
            torch.testing.assert_close(qkv_r[:, attn.qkv_proj.shard_rows()[projection]],
                                       whole_rows[:, first: first + count])
        first, count = attn.o_proj.tp_shard.ranges[None]
        o_sums.append(attn.o_proj(o_in[:, first: first + count], mapping))
        mlp_sums.append(mlp(x, mapping))
    sums = dict(rtol=1e-4, atol=1e-4)  # fp32 partial sums added in another order than the whole layer's
    torch.testing.assert_close(sum(o_sums), whole_attn.o_proj(o_in, mapping), **sums)
    torch.testing.assert_close(sum(mlp_sums), whole_mlp(x, mapping), **sums)


def test_a_rank_checks_an_adapter_against_the_whole_layer() -> None:
    """A rank holds half of o_proj's input columns and of q_proj's rows; an adapter is checked against the
    checkpoint's shapes: one of the rank's shapes is refused naming the whole ones (not padded into place)."""
    attn, mlp = _attention(4, 2, TensorParallel(1, 2)), _mlp(TensorParallel(1, 2))
    projections = _lora_projections(attn, mlp)
    halves = {"o_proj": (2 * HEAD_DIM, HIDDEN), "q_proj": (HIDDEN, 2 * HEAD_DIM)}
    for target, (n_in, n_out) in halves.items():
        adapter = _lora_adapter("halved", {target: (n_in, n_out)}, seed=3)
        with pytest.raises(LoRAAdapterError, match=rf"'halved': {target}'s lora_A \[{LORA_RANK}, {n_in}\] and lora_B "
                                                   rf"\[{n_out}, {LORA_RANK}\] do not fit the model's {target} "
                                                   rf"\({HIDDEN} in, {4 * HEAD_DIM} out\)"):
            install_adapter(projections, 1, adapter, torch.float32, torch.device("cpu"))
    assert not any(layer.lora for layer, _ in projections.values())


@pytest.mark.parametrize("size", [2, 3])
def test_vocab_parallel_embeddings_and_head(size: int) -> None:
    vocab = 10  # not a multiple of 3: the last rank's rows are padded
    table = _weights(vocab, HIDDEN)
    ids = torch.tensor([0, 3, 9, 4, 4, 7])
    lookups, head_rows = [], []
    for tp in _ranks(size):
        embed = VocabEmbedding(vocab, HIDDEN)
        embed.shard(tp)
        embed.load_weight(table)
        lookups.append(embed(ids))
        head = Linear(HIDDEN, vocab, bias=False)
        shard_vocab_head(head, tp)
        _bind(head)
        head.load_weight("weight", table)
        head_rows.append(head.weight)
    torch.testing.assert_close(sum(lookups), F.embedding(ids, table))
    rows = torch.cat(head_rows)
    torch.testing.assert_close(rows[:vocab], table)
    assert not rows[vocab:].any()


@pytest.mark.parametrize("num_heads, num_kv_heads, size, message", [
    (4, 2, 3, "does not divide the model's 4 attention heads"),
    (6, 4, 3, "does not divide the model's 4 KV heads"),
    (12, 3, 4, "neither a divisor nor a multiple of the model's 3 KV heads"),
])
def test_shapes_that_do_not_split_name_the_problem(num_heads: int, num_kv_heads: int, size: int, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        _attention(num_heads, num_kv_heads, TensorParallel(0, size))


def test_mlp_features_that_do_not_split_name_the_problem() -> None:
    with pytest.raises(ShardingError, match="does not divide the model's 10 intermediate"):
        GatedMLP(HIDDEN, 10, "silu", bias=False).shard(TensorParallel(0, 4))
