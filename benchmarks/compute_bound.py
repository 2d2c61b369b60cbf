"""The fp32 compute bound of a workload: its FLOPs over this machine's measured GEMM FLOP/s.

FLOPs of one request with p prompt and n output tokens, over T = p + n - 1 forward positions (the last
sampled token is never fed back):

    linear layers   2 * matmul_params_per_token * T      (q/k/v/o and the MLP of every layer)
    LM head         2 * vocab * hidden * n               (only rows that are sampled)
    attention       4 * layers * heads * head_dim * sum_{t=1..T} t   (QK^T and PV over the causal context)

Norms, rotary, activations and embedding lookups are left out: they are a rounding error next to the GEMMs.
The peak is the best rate measured over a large square GEMM and the model's own shapes, so the bound is a
lower bound on the time any fp32 engine needs on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

NUM_WARMUP = 2
NUM_REPEATS = 5
SQUARE_SIZE = 2048
LM_HEAD_ROWS = 64  # a decode step's worth of sampled rows


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelDims:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
        )

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies through: attention projections and the gated MLP, all layers."""
        q_and_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.num_layers * (q_and_o + k_and_v + mlp)

    def gemm_shapes(self, num_tokens: int) -> dict[str, tuple[int, int, int]]:
        """(m, k, n) of the model's GEMMs in a step of ``num_tokens`` tokens (q/k/v and gate/up fused)."""
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return {
            "qkv": (num_tokens, self.hidden, qkv_width),
            "o_proj": (num_tokens, self.num_heads * self.head_dim, self.hidden),
            "gate_up": (num_tokens, self.hidden, 2 * self.intermediate),
            "down": (num_tokens, self.intermediate, self.hidden),
            "lm_head": (LM_HEAD_ROWS, self.hidden, self.vocab_size),
        }


def request_flops(dims: ModelDims, num_prompt_tokens: int, num_output_tokens: int) -> float:
    num_positions = num_prompt_tokens + num_output_tokens - 1
    linear = 2 * dims.matmul_params_per_token * num_positions
    lm_head = 2 * dims.vocab_size * dims.hidden * num_output_tokens
    context_sum = num_positions * (num_positions + 1) // 2
    attention = 4 * dims.num_layers * dims.num_heads * dims.head_dim * context_sum
    return float(linear + lm_head + attention)


def workload_flops(dims: ModelDims, lengths: Iterable[tuple[int, int]]) -> float:
    """Total FLOPs of requests given as (num_prompt_tokens, num_output_tokens) pairs."""
    return sum(request_flops(dims, p, n) for p, n in lengths)


def gemm_flops_per_s(m: int, k: int, n: int) -> float:
    """Best FLOP/s of an fp32 [m, k] x [k, n] torch.matmul over a few timed repeats, after a warm-up."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    for _ in range(NUM_WARMUP):
        torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def measure_gemm_rates(dims: ModelDims, num_tokens: int) -> dict[str, dict[str, Any]]:
    """FLOP/s of a large square GEMM and of each model GEMM shape at ``num_tokens`` tokens per step."""
    shapes = {f"square_{SQUARE_SIZE}": (SQUARE_SIZE, SQUARE_SIZE, SQUARE_SIZE), **dims.gemm_shapes(num_tokens)}
    return {name: {"shape": list(mkn), "flops_per_s": gemm_flops_per_s(*mkn)} for name, mkn in shapes.items()}


def compute_bound(dims: ModelDims, lengths: list[tuple[int, int]], num_tokens: int) -> dict[str, Any]:
    """The workload's FLOPs, the measured GEMM rates, the peak among them and the bound time (seconds)."""
    rates = measure_gemm_rates(dims, num_tokens)
    peak = max(r["flops_per_s"] for r in rates.values())
    flops = workload_flops(dims, lengths)
    return {"flops": flops, "gemm_rates": rates, "peak_flops_per_s": peak, "bound_s": flops / peak}

