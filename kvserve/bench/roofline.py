"""``kvserve bench roofline``: what this machine allows a model, so every result can be stated as a share of it.

Measured: the memory bandwidth of a large tensor copy (bytes read + written over the time) and the best GEMM
FLOP/s over a large square ``torch.matmul`` and the model's own GEMM shapes, per dtype. From the model's size,
the upper bounds they put on tokens/s (everything else a step does only adds time):

    decode, batch 1       bandwidth / weight bytes per token       every weight is read once per generated token
    decode, large batch   GEMM FLOP/s / (2 x params per token)     the weight read is shared by the whole batch
    prefill               GEMM FLOP/s / (2 x linear params)        the LM head runs for the last position only

"params per token" are the weights a generated token multiplies through: every linear layer and the LM head
(not the embedding table, which is a lookup). A workload's compute bound is its FLOPs over the GEMM peak
(``workload_flops``); for one request with p prompt and n output tokens, over T = p + n - 1 forward
positions (the last sampled token is never fed back):

    linear layers   2 * linear_params_per_token * T
    LM head         2 * vocab * hidden * n                  (only rows that are sampled)
    attention       4 * layers * heads * head_dim * sum_{t=1..T} t   (QK^T and PV over the causal context)

Norms, rotary, activations and embedding lookups are left out: they are a rounding error next to the GEMMs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from kvserve.bench.report import check_output_path, write_result_json
from kvserve.config import DEFAULT_MODEL
from kvserve.device import parse_dtype, resolve_device
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

LM_HEAD_ROWS = 64  # a decode step's worth of sampled rows
DEFAULT_GEMM_SIZE = {"cpu": 2048, "cuda": 8192}
NUM_WARMUP = 2


@dataclass(frozen=True)
class ModelSize:
    """The dimensions that decide a decoder's bytes and FLOPs per token."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSize:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def linear_params_per_token(self) -> int:
        """Weights every forward position multiplies through: attention projections and the gated MLP."""
        q_and_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.num_layers * (q_and_o + k_and_v + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden

    @property
    def params_per_token(self) -> int:
        """Weights a generated token multiplies through (and reads from memory): linear layers and LM head."""
        return self.linear_params_per_token + self.lm_head_params

    @property
    def num_params(self) -> int:
        """All weights: embeddings, linear layers, an untied LM head, and the norms."""
        lm_head = 0 if self.tie_word_embeddings else self.lm_head_params
        norms = (2 * self.num_layers + 1) * self.hidden
        return self.vocab_size * self.hidden + self.linear_params_per_token + lm_head + norms

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

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


# ---------------------------------------------------------------------------------------------------- bounds


def token_bounds(size: ModelSize, copy_bytes_per_s: float, gemm_flops_per_s: float,
                 weight_dtype: torch.dtype) -> dict[str, float]:
    """Upper bounds on tokens/s for weights of ``weight_dtype`` at the given bandwidth and GEMM rate."""
    return {
        "decode_batch1_tokens_per_s": copy_bytes_per_s / (size.params_per_token * weight_dtype.itemsize),
        "decode_large_batch_tokens_per_s": gemm_flops_per_s / (2 * size.params_per_token),
        "prefill_tokens_per_s": gemm_flops_per_s / (2 * size.linear_params_per_token),
    }


def fraction_of_bound(measured: float, bound: float) -> float:
    """A measured rate as a share of its bound (tokens/s over tokens/s, or bound time over measured time)."""
    return measured / bound


def request_flops(size: ModelSize, num_prompt_tokens: int, num_output_tokens: int) -> float:
    num_positions = num_prompt_tokens + num_output_tokens - 1
    linear = 2 * size.linear_params_per_token * num_positions
    lm_head = 2 * size.lm_head_params * num_output_tokens
    context_sum = num_positions * (num_positions + 1) // 2
    attention = 4 * size.num_layers * size.num_heads * size.head_dim * context_sum
    return float(linear + lm_head + attention)


def workload_flops(size: ModelSize, lengths: Iterable[tuple[int, int]]) -> float:
    """Total FLOPs of requests given as (num_prompt_tokens, num_output_tokens) pairs."""
    return sum(request_flops(size, p, n) for p, n in lengths)


# ----------------------------------------------------------------------------------------------- measurement


def _best_seconds(run: Callable[[], Any], device: torch.device, num_repeats: int) -> float:
    """The fastest of ``num_repeats`` timed calls after a warm-up, synchronizing around each on CUDA."""
    for _ in range(NUM_WARMUP):
        run()
    best = float("inf")
    for _ in range(num_repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device: torch.device, num_bytes: int, num_repeats: int = 5) -> float:
    """Bytes/s of copying a ``num_bytes`` tensor (each byte read once and written once)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / _best_seconds(lambda: target.copy_(source), device, num_repeats)


def measure_gemm_flops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                       num_repeats: int = 5) -> float:
    """FLOP/s of a [m, k] x [k, n] ``torch.matmul`` in ``dtype``."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return 2 * m * k * n / _best_seconds(lambda: torch.matmul(a, b, out=out), device, num_repeats)


def measure_gemm_peak(size: ModelSize, dtype: torch.dtype, device: torch.device, square: int, num_tokens: int,
                      num_repeats: int = 5) -> dict[str, Any]:
    """FLOP/s of a ``square``-sized GEMM and of the model's GEMMs at ``num_tokens`` tokens, and the best of them."""
    shapes = {f"square_{square}": (square, square, square), **size.gemm_shapes(num_tokens)}
    rates = {name: {"shape": list(mkn), "flops_per_s": measure_gemm_flops(*mkn, dtype, device, num_repeats)}
             for name, mkn in shapes.items()}
    return {"shapes": rates, "peak_flops_per_s": max(r["flops_per_s"] for r in rates.values())}


def model_size(model: str) -> ModelSize:
    """The size of ``model`` (resolved as kvserve resolves it) from its config; no weights are read."""
    return ModelSize.from_hf_config(load_checkpoint(resolve_model(model), torch.float32, "dummy").hf_config)


# ------------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"a packaged model name, a Hugging Face directory or a GGUF file "
                             f"(default {DEFAULT_MODEL})")
    add_probe_arguments(parser)
    parser.add_argument("--dtypes", default="auto",
                        help="weight dtypes to measure GEMMs in and bound, comma-separated (default: auto, the "
                             "device's run dtype: float32 on CPU, bfloat16 on CUDA; a CPU without native bf16 "
                             "takes minutes for bfloat16's probes)")
    parser.add_argument("--copy-mib", type=int, default=256,
                        help="size of the tensor copied to measure bandwidth (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--label", default=None, help="a name for this run in tables and compare")
    parser.add_argument("--result-json", default=None)


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The GEMM probe's sizes and the threads, shared with ``kvserve bench throughput``'s compute bound."""
    parser.add_argument("--gemm-size", type=int, default=None,
                        help="side of the square GEMM probe (default 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--gemm-tokens", type=int, default=512,
                        help="tokens per step in the probe of the model's own GEMM shapes (default: %(default)s)")
    parser.add_argument("--num-repeats", type=int, default=5,
                        help="timed repeats per probe, the best counting (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def check_probe_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming a probe flag below 1: a probe of no size or no repeat measures nothing, and the
    bounds drawn from it would be zeros."""
    for name in ("gemm_size", "gemm_tokens", "num_repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def gemm_size(args: argparse.Namespace, device: torch.device) -> int:
    return args.gemm_size or DEFAULT_GEMM_SIZE[device.type]


def main(args: argparse.Namespace) -> int:
    check_probe_arguments(args)
    if args.copy_mib < 1:
        raise ValueError(f"--copy-mib must be >= 1, got {args.copy_mib}")
    if args.result_json is not None:
        check_output_path(args.result_json, "--result-json")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(resolve_device(args.device))
    dtypes = [parse_dtype(name, device.type) for name in args.dtypes.split(",") if name]
    if not dtypes:
        raise ValueError(f"--dtypes {args.dtypes!r} names no dtype")
    size = model_size(args.model)
    result = measure_roofline(size, device, dtypes, args)
    label = args.label or f"roofline {args.model} {device.type}"
    if args.result_json:  # first: a reader of the report that has gone (a pager quit) loses no finished run
        write_result_json(args.result_json, {"kind": "roofline", "label": label, **result}, args)
    print(format_roofline(result, label))
    return 0


def measure_roofline(size: ModelSize, device: torch.device, dtypes: list[torch.dtype],
                     args: argparse.Namespace) -> dict[str, Any]:
    """Every measured rate and the bounds they put on ``size`` for each weight dtype."""
    copy_bytes_per_s = measure_copy_bandwidth(device, args.copy_mib * 2**20, args.num_repeats)
    gemm, bounds = {}, {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        print(f"measuring {name} GEMMs ...", file=sys.stderr, flush=True)  # a slow dtype is not silence
        gemm[name] = measure_gemm_peak(size, dtype, device, gemm_size(args, device), args.gemm_tokens,
                                       args.num_repeats)
        bounds[name] = token_bounds(size, copy_bytes_per_s, gemm[name]["peak_flops_per_s"], dtype)
    model = {
        "name": args.model, "num_params": size.num_params, "params_per_token": size.params_per_token,
        "linear_params_per_token": size.linear_params_per_token, "num_layers": size.num_layers,
        "kv_bytes_per_token": {name: size.kv_bytes_per_token(dtype) for name, dtype in zip(gemm, dtypes)},
    }
    return {"device": _device_name(device), "threads": torch.get_num_threads(), "model": model,
            "copy_bytes_per_s": copy_bytes_per_s, "gemm": gemm, "bounds": bounds}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def format_roofline(result: dict[str, Any], title: str) -> str:
    model = result["model"]
    lines = [f"== {title} ==",
             f"device {result['device']}, {result['threads']} threads",
             f"copy bandwidth: {result['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)"]
    for name, gemm in result["gemm"].items():
        shapes = ", ".join(f"{shape} {r['flops_per_s'] / 1e9:.0f}" for shape, r in gemm["shapes"].items())
        lines.append(f"GEMM {name}: peak {gemm['peak_flops_per_s'] / 1e9:.1f} GFLOP/s ({shapes})")
    kv = ", ".join(f"{n / 1024:.1f} KiB at {name}" for name, n in model["kv_bytes_per_token"].items())
    lines.append(f"model {model['name']}: {model['num_params'] / 1e6:.1f}M params, "
                 f"{model['params_per_token'] / 1e6:.1f}M per generated token, {model['num_layers']} layers, "
                 f"KV {kv} per token")
    lines.append(f"{'upper bounds, tok/s':<22}{'decode batch 1':>16}{'decode large batch':>20}{'prefill':>12}")
    for name, b in result["bounds"].items():
        lines.append(f"{name + ' weights':<22}{b['decode_batch1_tokens_per_s']:>16.1f}"
                     f"{b['decode_large_batch_tokens_per_s']:>20.1f}{b['prefill_tokens_per_s']:>12.1f}")
    return "\n".join(lines)
