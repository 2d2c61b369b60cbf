"""FP8 linear layers for any checkpoint (``--quantization fp8``): weights in e4m3 with a scale per output
channel, made at load; activations in e4m3 with a scale per token, made at each step; the product by
``torch._scaled_mm`` (fp8 tensor cores on CUDA GPUs that have them, compute capability 8.9 and up: Ada, Hopper;
oneDNN on CPU), as vLLM's dynamic per-token FP8 does.

A scale is the row's largest magnitude / 448 (e4m3's largest finite value), so every value maps into range and
is rounded to e4m3's 3 mantissa bits: each weight and each activation moves by at most 1/16 of its magnitude
(half a step of 2^-3 relative). The twin is ``reference_fp8_linear``: the same codes dequantized, then
``F.linear``. On the default model the chosen tokens' logprobs move as tests/engine/test_real_models.py states.
A tied LM head stays as loaded (the logits are what sampling reads; see ``registry.load_model``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_CUDA_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada and Hopper


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [m, k] in e4m3, with its fp32 scale [m, 1] (a row of zeros takes a tiny scale)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_unsupported(device: torch.device) -> str | None:
    """Why ``--quantization fp8`` cannot run on ``device`` (None: it can)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CUDA_CAPABILITY:
        found = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return f"{torch.cuda.get_device_name(device)} (compute capability {found}) has no fp8 tensor cores (8.9+)"
    return None


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Loads the weight as ``UnquantizedLinearMethod`` does, then keeps it only in e4m3 (``fp8_weight`` [n, k],
    ``fp8_scale`` [1, n]); ``apply`` quantizes each row of x and multiplies with ``torch._scaled_mm`` into x's
    dtype."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.fp8_weight, scale = quantize_rows(layer.weight.detach())
        layer.fp8_scale = scale.T.contiguous()
        del layer.weight  # this layer's reference; a tied head's embeddings keep theirs

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], layer.out_features)
        codes, scale = quantize_rows(rows)
        y = torch._scaled_mm(codes, layer.fp8_weight.T, scale_a=scale, scale_b=layer.fp8_scale, out_dtype=x.dtype)
        if layer.bias is not None:
            y += layer.bias
        return y.view(*x.shape[:-1], layer.out_features)


def reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``Fp8LinearMethod``: x and the fp32 ``weight`` rounded to e4m3 per row as it does,
    dequantized, then ``F.linear`` in fp32."""
    x_codes, x_scale = quantize_rows(x)
    w_codes, w_scale = quantize_rows(weight)
    return F.linear(x_codes.float() * x_scale, w_codes.float() * w_scale, bias)
