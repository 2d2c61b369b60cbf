"""KV cache quantization in plain PyTorch: the encodings ``KVCacheStorage`` stores, and the reference that the C
kernels' own dequantization (``attention/csrc/paged_*.c``) is tested against.

Each encoding quantizes one group, a token's row of one KV head (``head_dim`` values), with its own parameters
(``params``, ``[..., params_per_group]`` beside the data)::

    int8  symmetric    q = round(x / s) in [-127, 127],    s = max|x| / 127                  x ~ q * s
    fp8   e4m3         f = fp8_e4m3fn(x / s),              s = max|x| / 448                  x ~ f * s
    int4  asymmetric   q = round((x - z) / s) in [0, 15],  s = (max x - min x) / 15, z = min x   x ~ q * s + z

Parameters are fp16: int8 and fp8 keep s (head_dim 64: 66 bytes a row against fp32's 256, 3.9x, and bf16's
128, 1.94x; an fp32 s made that 68 bytes, short of 3.8x and 1.9x), int4 s and z (36 bytes, 7.1x). Each
encoding quantizes with the fp16 parameters it stores (int8 and fp8 round s up, so that no value is clamped),
so a value moves by at most half a step of the grid it is stored on; a group whose s underflows fp16 (max |x|
under about 1e-5) is stored as zeros and packs two values a byte, byte i of a row holding value i in its low nibble and value
i + head_dim / 2 in its high one, so that a vector of bytes unpacks into two runs of consecutive values.
A group is the whole head row: sub-groups of 32 would cost int4 4 more bytes a row (6.4x) and were not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_MAX = 15
FP16_MAX = 65504.0

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheDtype:
    """How stored K and V elements are encoded: a data dtype holding ``values_per_element`` values each
    (2 for int4 packed in uint8), and, for quantized encodings, the parameters of each group (a token's row of
    one KV head) in ``scale_dtype``: a scale, and a zero point after it where ``has_zero_point``."""

    name: str  # what flags and stats call it: "float32", "bfloat16", "int8", "fp8", "int4"
    data_dtype: torch.dtype
    scale_dtype: torch.dtype | None = None  # None: unquantized, the data are the values themselves
    values_per_element: int = 1
    has_zero_point: bool = False

    def __post_init__(self) -> None:
        if self.values_per_element < 1:
            raise ValueError(f"values_per_element must be >= 1, got {self.values_per_element}")
        if self.scale_dtype is None and (self.values_per_element != 1 or not self.data_dtype.is_floating_point
                                         or self.has_zero_point):
            raise ValueError(f"KV dtype {self.name!r}: only float data may be stored without scales, one value each")

    @classmethod
    def unquantized(cls, dtype: torch.dtype) -> KVCacheDtype:
        """The values stored as they are, in ``dtype``."""
        return cls(_dtype_name(dtype), dtype)

    @property
    def has_scales(self) -> bool:
        return self.scale_dtype is not None

    @property
    def params_per_group(self) -> int:
        """Parameters stored per token per KV head: 0 (unquantized), 1 (a scale) or 2 (scale, zero point)."""
        return 0 if self.scale_dtype is None else 1 + self.has_zero_point

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes that one token's K (or V) of one KV head takes: its data plus its parameters."""
        param_bytes = _element_size(self.scale_dtype) * self.params_per_group if self.scale_dtype is not None else 0
        return head_dim // self.values_per_element * _element_size(self.data_dtype) + param_bytes


ENCODINGS = {
    "int8": KVCacheDtype("int8", torch.int8, torch.float16),
    "fp8": KVCacheDtype("fp8", torch.float8_e4m3fn, torch.float16),
    "int4": KVCacheDtype("int4", torch.uint8, torch.float16, values_per_element=2, has_zero_point=True),
}


def kv_cache_dtype(name: str, dtype: torch.dtype) -> KVCacheDtype:
    """The encoding ``--kv-cache-dtype name`` stores a model of ``dtype`` in ("auto": ``dtype`` unquantized)."""
    if name == "auto":
        return KVCacheDtype.unquantized(dtype)
    if name not in ENCODINGS:
        raise ValueError(f"kv_cache_dtype={name!r} is not one of auto, {', '.join(ENCODINGS)}")
    return ENCODINGS[name]


def quantize(x: torch.Tensor, encoding: KVCacheDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([..., head_dim], any float dtype) as (data [..., head_dim // values_per_element], params
    [..., params_per_group]) in ``encoding``, one group per row of the last dimension."""
    x = x.float()
    if encoding.name == "int4":
        return _quantize_int4(x)
    limit = INT8_MAX if encoding.name == "int8" else FP8_MAX
    scale = _half_at_least(x.abs().amax(-1, keepdim=True) / limit)
    scaled = x * _reciprocal(scale.float())
    if encoding.name == "int8":
        return _round_(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    if encoding.name == "fp8":
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    raise ValueError(f"{encoding.name!r} is not a quantized KV encoding")


def dequantize(data: torch.Tensor, params: torch.Tensor, encoding: KVCacheDtype, dtype: torch.dtype) -> torch.Tensor:
    """The values ([..., head_dim], ``dtype``) that ``quantize`` encoded as ``data`` and ``params``."""
    if encoding.name == "int4":
        codes = torch.cat([data & 0xF, data >> 4], dim=-1).float()
        scale, zero = params.float().unbind(-1)
        return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).to(dtype)
    return (data.float() * params.float()).to(dtype)


def _half_at_least(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as the nearest fp16 not below it (up to fp16's largest): the row's largest value then maps
    inside the code range, never clamped, also where fp16's grid is coarse (subnormal scales, under 6e-5)."""
    half = scale.clamp(max=FP16_MAX).half()
    return torch.where(half.float() < scale, torch.nextafter(half, torch.full_like(half, FP16_MAX)), half)


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds with the fp16 scale and zero point it stores, so that every value stays within half a step."""
    x = x + 0.0  # -0 as 0: the minimum and maximum of a row of zeros then have one sign whatever the order
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    zero = low.clamp(-FP16_MAX, FP16_MAX).half().float()
    scale = ((high - zero) / INT4_MAX).clamp(max=FP16_MAX).half().float()
    codes = _round_((x - zero) * _reciprocal(scale)).clamp_(0, INT4_MAX).to(torch.uint8)
    half = x.shape[-1] // 2
    data = codes[..., :half] | (codes[..., half:] << 4)
    return data, torch.cat([scale, zero], dim=-1).half()


# 1.5 * 2^23: fp32 x + C - C is x rounded to an integer, half to even (IEEE's own rounding), for |x| < 2^22
_ROUNDING_CONSTANT = 12582912.0


def _round_(x: torch.Tensor) -> torch.Tensor:
    """``x.round_()`` for fp32 codes below 2^22 in magnitude (quantized values are at most 127), bit for bit.
    torch's CPU round opens a parallel region from 4,096 elements (add from 32,768): a decode step's write of
    32 tokens then waited for a second thread, up to a scheduler slice (12 ms) on a busy machine, per layer."""
    return x.add_(_ROUNDING_CONSTANT).sub_(_ROUNDING_CONSTANT)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 for an all-zero group (whose codes are then all 0)."""
    return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
