"""The split math of the tensor-parallel layers, in one process: every rank's part is built and loaded from the
same full tensors, its collectives left out (a group whose all-reduce leaves the tensor as is), and the ranks'
outputs put together by hand (concatenated or summed) must equal the whole layer's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.embedding import VocabEmbedding
from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod
from kvserve.model.layers.tensor_parallel import ShardingError, TensorParallel, shard_vocab_head

HIDDEN, HEAD_DIM = 24, 6


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


def test_mlp_partial_sums_add_up_to_the_whole() -> None:
    def mlp(tp: TensorParallel | None) -> GatedMLP:
        layer = GatedMLP(HIDDEN, 16, "silu", bias=True)
        if tp is not None:
            layer.shard(tp)
        _bind(layer.gate_up_proj, layer.down_proj)
        for name in ("gate_proj", "up_proj"):
            layer.gate_up_proj.load_weight("weight", _weights(16, HIDDEN) + float(name == "up_proj"), name)
            layer.gate_up_proj.load_weight("bias", _weights(16) - float(name == "up_proj"), name)
        layer.down_proj.load_weight("weight", _weights(HIDDEN, 16))
        layer.down_proj.load_weight("bias", _weights(HIDDEN))
        return layer

    x = _weights(3, HIDDEN)
    torch.testing.assert_close(sum(mlp(tp)(x) for tp in _ranks(2)), mlp(None)(x))


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
