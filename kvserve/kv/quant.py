"""KV cache quantization in plain PyTorch: the encodings ``KVCacheStorage`` stores, and the reference that the C
kernels' own dequantization (``attention/csrc/paged_*.c``) is tested against.

Each encoding quantizes a token's row of one KV head (``head_dim`` values) in groups, each with its own fp16
parameters (``params``, ``[..., params_per_row]`` beside the data, ``params_per_group`` for each group in order)::

    int8  symmetric    q = round(x / s) in [-127, 127],    s = max|x| / 127                  x ~ q * s
    fp8   e4m3         f = fp8_e4m3fn(x / s),              s = max|x| / 448                  x ~ f * s
    int4  asymmetric   q = round((x - z) / s) in [0, 15],  s = (max x - min x) / 15, z = min x   x ~ q * s + z

int8 and fp8 take the whole row as one group and keep s (head_dim 64: 66 bytes a row against fp32's 256, 3.9x,
and bf16's 128, 1.94x; an fp32 s made that 68 bytes, short of 3.8x and 1.9x). int4 takes groups of the largest
power of two dividing head_dim, at most 64 (``INT4_MAX_GROUP``), with s and z each: 36 bytes a row at head_dim
64 (7.1x fp32, 3.6x bf16), 144 at 256. Each encoding quantizes with the fp16 parameters it stores (int8 and fp8
round s up, so that no value is clamped), so a value moves by at most half a step of the grid it is stored on;
a group whose s underflows fp16 (max |x| under about 1e-5) is stored as zeros. int4 packs two values a byte,
byte i of a group holding value i in its low nibble and value i + group / 2 in its high one, so that a vector
of bytes unpacks into two runs of consecutive values.

int4 stores keys rotated: each group of a key row goes through the normalized Walsh-Hadamard transform H
(``hadamard``, orthogonal and its own inverse) before it is quantized. Keys have outlier channels, a few
values many times the rest, and one outlier stretches its group's grid over all the others; H spreads it
across the group. Scores need no unrotation, since q . k = Hq . Hk: the kernels rotate the queries instead
(the C kernels with ``kv/csrc/int4_groups.h``, the Triton ones through ``rotate_queries``), and
``dequantize(..., keys=True)`` gives back the keys themselves. Perplexity of 2,048 tokens of a fixed text
against the fp32 cache, layouts tried by quantizing K and V as they were written (docs/results/session20-emr/
int4-groups-experiment.txt): Gemma 3 270M (head_dim 256) +599% with whole-row groups, +25% with groups of 64,
+4.3% with groups of 64 and rotated keys; SmolLM2 (head_dim 64, one group a row) +8.3% before rotating keys,
+5.1% after. As built (``benchmarks/kv_quality.py``): Gemma 3 +5.4%, SmolLM2 +4.6%. Values quantize well as
they are (int4 values alone: +0.2-0.5%), so they are not rotated, and outputs need no unrotation either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvserve.kv.encodings import KV_ENCODING_NAMES

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_MAX = 15
INT4_MAX_GROUP = 64  # int4 values per group at most: 64 keeps 3.5x bf16's tokens at every head_dim
FP16_MAX = 65504.0

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVCacheDtype:
    """How stored K and V elements are encoded: a data dtype holding ``values_per_element`` values each
    (2 for int4 packed in uint8), and, for quantized encodings, the parameters of each group in
    ``scale_dtype``: a scale, and a zero point after it where ``has_zero_point``. A group is a token's whole
    row of one KV head, or, with ``max_group``, runs of at most that many of its values (``group_size``)."""

    name: str  # what flags and stats call it: "float32", "bfloat16", "int8", "fp8", "int4"
    data_dtype: torch.dtype
    scale_dtype: torch.dtype | None = None  # None: unquantized, the data are the values themselves
    values_per_element: int = 1
    has_zero_point: bool = False
    max_group: int = 0  # 0: a group is a whole row
    rotates_keys: bool = False  # keys are stored Walsh-Hadamard rotated, group by group (module docstring)
    # the stored layout's name in block keys and block files where it is not ``name``: a block stored in one
    # layout is never read as another's (int4's first layout, whole rows and keys as they are, was "int4")
    layout_name: str = ""

    def __post_init__(self) -> None:
        if self.values_per_element < 1:
            raise ValueError(f"values_per_element must be >= 1, got {self.values_per_element}")
        if self.scale_dtype is None and (self.values_per_element != 1 or not self.data_dtype.is_floating_point
                                         or self.has_zero_point or self.max_group or self.rotates_keys):
            raise ValueError(f"KV dtype {self.name!r}: only float data may be stored without scales, one value each")
        if self.max_group < 0 or self.max_group & (self.max_group - 1):
            raise ValueError(f"KV dtype {self.name!r}: max_group must be 0 or a power of two, got {self.max_group}")

    @classmethod
    def unquantized(cls, dtype: torch.dtype) -> KVCacheDtype:
        """The values stored as they are, in ``dtype``."""
        return cls(_dtype_name(dtype), dtype)

    @property
    def has_scales(self) -> bool:
        return self.scale_dtype is not None

    @property
    def layout(self) -> str:
        """The name blocks stored in this encoding are keyed and filed under."""
        return self.layout_name or self.name

    @property
    def params_per_group(self) -> int:
        """Parameters stored per group: 0 (unquantized), 1 (a scale) or 2 (scale, zero point)."""
        return 0 if self.scale_dtype is None else 1 + self.has_zero_point

    def group_size(self, head_dim: int) -> int:
        """Values per group in a row of ``head_dim``: the whole row, or with ``max_group`` the largest power of
        two that divides ``head_dim``, at most ``max_group`` (a power of two, so that groups can be rotated)."""
        return min(head_dim & -head_dim, self.max_group) if self.max_group else head_dim

    def params_per_row(self, head_dim: int) -> int:
        """Parameters stored per token per KV head: those of every group of its row."""
        return self.params_per_group * (head_dim // self.group_size(head_dim))

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes that one token's K (or V) of one KV head takes: its data plus its parameters."""
        scale_dtype = self.scale_dtype
        param_bytes = scale_dtype.itemsize * self.params_per_row(head_dim) if scale_dtype is not None else 0
        return head_dim // self.values_per_element * self.data_dtype.itemsize + param_bytes


# The codes the C kernels know each encoding by (kv/csrc/encodings.h): float32 is the attention kernels' RAW;
# the K/V store copies any unquantized cache as RAW
C_ENCODING_CODES = {"float32": 0, "int8": 1, "fp8": 2, "int4": 3}

ENCODINGS = {
    "int8": KVCacheDtype("int8", torch.int8, torch.float16),
    "fp8": KVCacheDtype("fp8", torch.float8_e4m3fn, torch.float16),
    "int4": KVCacheDtype("int4", torch.uint8, torch.float16, values_per_element=2, has_zero_point=True,
                         max_group=INT4_MAX_GROUP, rotates_keys=True, layout_name="int4-g64-hadamard-keys"),
}
# the configuration validates --kv-cache-dtype against the torch-free names, so the two lists must agree
assert tuple(ENCODINGS) == KV_ENCODING_NAMES, f"kv/encodings.py names {KV_ENCODING_NAMES}, ENCODINGS {tuple(ENCODINGS)}"


def kv_cache_dtype(name: str, dtype: torch.dtype) -> KVCacheDtype:
    """The encoding ``--kv-cache-dtype name`` stores a model of ``dtype`` in ("auto": ``dtype`` unquantized)."""
    if name == "auto":
        return KVCacheDtype.unquantized(dtype)
    if name not in ENCODINGS:
        raise ValueError(f"kv_cache_dtype={name!r} is not one of auto, {', '.join(ENCODINGS)}")
    return ENCODINGS[name]


def quantize(x: torch.Tensor, encoding: KVCacheDtype, keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([..., head_dim], any float dtype) as (data [..., head_dim // values_per_element], params
    [..., params_per_row]) in ``encoding``; ``keys``: ``x`` holds keys, stored rotated where the encoding
    says so."""
    x = x.float()
    group = encoding.group_size(x.shape[-1])
    if keys and encoding.rotates_keys:
        x = hadamard(x, group)
    groups = x.unflatten(-1, (-1, group))
    if encoding.name == "int4":
        data, params = _quantize_int4(groups)
        return data.flatten(-2), params.flatten(-2)
    limit = INT8_MAX if encoding.name == "int8" else FP8_MAX
    scale = _half_at_least(groups.abs().amax(-1, keepdim=True) / limit)
    scaled = groups * _reciprocal(scale.float())
    if encoding.name == "int8":
        return _round_(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).flatten(-2), scale.flatten(-2)
    if encoding.name == "fp8":
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2), scale.flatten(-2)
    raise ValueError(f"{encoding.name!r} is not a quantized KV encoding")


def dequantize(data: torch.Tensor, params: torch.Tensor, encoding: KVCacheDtype, dtype: torch.dtype,
               keys: bool = False) -> torch.Tensor:
    """The values ([..., head_dim], ``dtype``) that ``quantize`` encoded as ``data`` and ``params`` (``keys``:
    as ``quantize`` was told, the keys rotated back)."""
    head_dim = data.shape[-1] * encoding.values_per_element
    group = encoding.group_size(head_dim)
    data = data.unflatten(-1, (-1, group // encoding.values_per_element))
    params = params.float().unflatten(-1, (-1, encoding.params_per_group))
    if encoding.name == "int4":
        codes = torch.cat([data & 0xF, data >> 4], dim=-1).float()
        values = codes * params[..., :1] + params[..., 1:]
    else:
        values = data.float() * params
    values = values.flatten(-2)
    if keys and encoding.rotates_keys:
        values = hadamard(values, group)
    return values.to(dtype)


def hadamard(x: torch.Tensor, group: int) -> torch.Tensor:
    """Each run of ``group`` (a power of two) values along ``x``'s last dimension times the normalized
    Walsh-Hadamard matrix, which is symmetric and orthogonal, so applying it twice gives ``x`` back. Computed
    as the fast transform's butterflies, log2(group) stages of (a + b, a - b), then a multiply by
    1 / sqrt(group): ``csrc/kv_store.c`` does the same fp32 operations in the same order, for the same bits."""
    shape = x.shape
    y = x.reshape(-1, group)
    span = 1
    while span < group:
        pairs = y.view(-1, group // (2 * span), 2, span)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        span *= 2
    return (y.view(shape) * _inverse_sqrt(group)).to(x.dtype)


def rotate_queries(q: torch.Tensor, encoding: KVCacheDtype) -> torch.Tensor:
    """``q`` ([..., head_dim]) rotated as the cache's keys are, so that its scores against the stored keys are
    those against the keys themselves; ``q`` itself where keys are stored as they are. One matrix multiply (the
    transform's matrix, cached), since a step's queries are rotated on every layer."""
    if not encoding.rotates_keys:
        return q
    group = encoding.group_size(q.shape[-1])
    matrix = _hadamard_matrix(group, q.dtype, q.device)
    return torch.matmul(q.unflatten(-1, (-1, group)), matrix).flatten(-2)


@functools.cache
def _hadamard_matrix(group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return hadamard(torch.eye(group), group).to(dtype=dtype, device=device)


def _inverse_sqrt(group: int) -> float:
    """1 / sqrt(group) as the fp32 the kernels multiply by (exact for 4^n: 64 gives 0.125)."""
    return float(torch.tensor(group ** -0.5, dtype=torch.float32))


def _half_at_least(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as the nearest fp16 not below it (up to fp16's largest): the row's largest value then maps
    inside the code range, never clamped, also where fp16's grid is coarse (subnormal scales, under 6e-5)."""
    half = scale.clamp(max=FP16_MAX).half()
    return torch.where(half.float() < scale, torch.nextafter(half, torch.full_like(half, FP16_MAX)), half)


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups (the last dimension of ``x``) as packed codes and (scale, zero point); rounds with the fp16
    parameters it stores, so that every value stays within half a step."""
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
