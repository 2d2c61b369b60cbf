"""Helpers to run a kvserve model over paged KV the way the engine does, and to compare it with transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kvserve.attention.backend import AttentionBackend, AttentionInputs
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.model.base import CausalLM
from kvserve.model.registry import build_model, select_fused_ops

BLOCK_SIZE = 16


def load_ours(directory: Path, backend: AttentionBackend) -> CausalLM:
    """Our model for a checkpoint directory, in fp32 on CPU (with the fused ops the engine selects for that), read
    with nothing but safetensors."""
    model = build_model(AutoConfig.from_pretrained(directory), backend, torch.float32, "cpu",
                        fused_ops=select_fused_ops(torch.device("cpu"), torch.float32))
    model.load_weights(load_file(directory / "model.safetensors").items())
    return model.eval()


def load_hf(directory: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """Token ids drawn past the special tokens (ids < 8), so that no prompt contains an eos."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab_size, (length,), generator=generator).tolist()


class PagedRunner:
    """Steps a model over a paged KV cache: one flat batch of chunks per step, decodes first.

    Each sequence owns scattered blocks (interleaved with the other sequences' and in reverse order), so a
    model or backend that assumed contiguous blocks would fail.
    """

    def __init__(self, model: CausalLM, backend: AttentionBackend, num_seqs: int, max_len: int) -> None:
        self.model, self.backend = model, backend
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, BLOCK_SIZE, torch.float32)
        self.kv = KVCacheStorage(spec, 1 + num_seqs * blocks_per_seq, "cpu")  # block 0: never used
        self.block_ids = [
            [1 + seq + j * num_seqs for j in reversed(range(blocks_per_seq))] for seq in range(num_seqs)
        ]
        self.num_computed = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run ``{seq: new token ids}`` as one batch; returns each sequence's logits, one row per new token."""
        order = sorted(chunks, key=lambda seq: len(chunks[seq]) != 1)  # decodes first, as the runner does
        input_ids = torch.tensor([t for seq in order for t in chunks[seq]])
        positions = torch.cat([self._positions(seq, len(chunks[seq])) for seq in order])
        inputs = self._attention_inputs(order, [len(chunks[seq]) for seq in order], positions)
        meta = self.backend.build_metadata(inputs, self.model.sliding_windows())
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(input_ids, positions, meta, self.kv))
        for seq in order:
            self.num_computed[seq] += len(chunks[seq])
        return dict(zip(order, logits.split([len(chunks[seq]) for seq in order])))

    def _positions(self, seq: int, num_new: int) -> torch.Tensor:
        return torch.arange(self.num_computed[seq], self.num_computed[seq] + num_new)

    def _attention_inputs(self, order: list[int], query_lens: list[int], positions: torch.Tensor) -> AttentionInputs:
        seq_lens = [self.num_computed[seq] + n for seq, n in zip(order, query_lens)]
        tables = torch.tensor([self.block_ids[seq] for seq in order], dtype=torch.int32)
        row_of_token = torch.repeat_interleave(torch.arange(len(order)), torch.tensor(query_lens))
        blocks = tables[row_of_token, positions // BLOCK_SIZE].long()
        query_start = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        return AttentionInputs(
            num_decodes=num_decodes,
            query_start_loc=query_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=blocks * BLOCK_SIZE + positions % BLOCK_SIZE,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            block_size=BLOCK_SIZE,
        )


@dataclass
class Family:
    """One tiny checkpoint loaded twice: by transformers (the reference) and by kvserve."""

    arch: str
    directory: Path
    hf: PreTrainedModel
    ours: CausalLM
    backend: AttentionBackend

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def runner(self, num_seqs: int, max_len: int = 128) -> PagedRunner:
        return PagedRunner(self.ours, self.backend, num_seqs, max_len)


@pytest.fixture(scope="module")
def families(tiny_checkpoints: dict[str, Path]) -> dict[str, Family]:
    backend = TorchRefBackend()
    return {
        arch: Family(arch, directory, load_hf(directory), load_ours(directory, backend), backend)
        for arch, directory in tiny_checkpoints.items()
    }


# Triton's kernels run compiled on a GPU, through the interpreter elsewhere (tests/conftest.py sets it)
TRITON_INTERPRETED = not torch.cuda.is_available()
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# the activation dtypes of the tensor-core paths: bf16 on a GPU alone
HALF_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
    TRITON_INTERPRETED, reason="Triton's interpreter gets bf16 dots wrong (and truncates to bf16)")])]


def assert_within_half_precision_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                          bias: torch.Tensor) -> None:
    """A tensor-core GEMM's result ``y`` in x's dtype (fp16 / bf16) for fp32 ``weight`` values: each weight
    rounded to the dtype (at most u of it, u the unit roundoff), the products summed in fp32, the output rounded
    (u of it), so |y - exact| <= 2u (|x| . |w| + |bias|), exact on x as rounded."""
    assert y.dtype == x.dtype
    expected = x.float() @ weight.T + bias.float()
    bound = 2 * UNIT_ROUNDOFF[x.dtype] * (x.float().abs() @ weight.abs().T + bias.float().abs()) + 1e-6
    assert ((y.float() - expected).abs() <= bound).all(), float(((y.float() - expected).abs() / bound).max())
