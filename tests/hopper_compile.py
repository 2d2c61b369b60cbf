"""Compile kvserve's Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter, which runs the kernels in CI, accepts code its compiler refuses (a module global that is
not a ``tl.constexpr``, say), so the kernels' tests could pass while no GPU could run them. Compiling needs no
GPU: Triton's front end, LLVM and the ptxas its wheel carries run on the CPU. Run as a script, in a process
where TRITON_INTERPRET is unset (the kernels must be real ``JITFunction``s)::

    python -m tests.hopper_compile attention|ggml|fused|weight_only|skinny|sample [-v]

prints one line per case that fails (with ``-v``, each case's registers, spills and shared memory) and exits 1
if any did. ``tests/test_hopper_compile.py`` runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                  torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}


def compile_for_hopper(kernel: triton.JITFunction, options: dict[str, int] | None = None, **args: Any) -> Any:
    """Compile ``kernel`` to a cubin for sm_90 (``options``: num_warps, num_stages): a torch dtype stands for a
    pointer to it, an int for an int32 argument, a float for an fp32 one; constexpr parameters take their
    values (``PDL`` True unless given). Pointers, and ints that are multiples of 16, are marked 16-divisible, as
    Triton's launcher marks aligned tensors and such ints at run time (what lets loads be wide). Returns the
    compiled kernel."""
    signature, constexprs, attrs = {}, {}, {}
    args = {"PDL": True, **args}  # as Hopper launches them: under programmatic dependent launch (triton_launch)
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.dtype):
            signature[param.name] = _POINTER_TYPES[value]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
            if isinstance(value, int) and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                          options=options)


def attention_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """Store, decode, merge and prefill kernels, as ``TritonPagedBackend`` launches them: every model dtype at SmolLM2's
    and Llama-3's head shapes, and bf16 over each quantized cache encoding the kernels read."""
    from kvserve.attention import triton_kernels as kernels
    from kvserve.attention.triton_paged import dot_depth

    combos = [(dtype, dtype, *shape) for dtype in (torch.bfloat16, torch.float16, torch.float32)
              for shape in ((3, 64), (4, 128))]
    combos += [(torch.bfloat16, torch.bfloat16, 4, 8), (torch.float32, torch.float32, 2, 4)]  # heads under a dot's K
    combos += [(torch.bfloat16, cache, 4, 128) for cache in (torch.int8, torch.float8_e4m3fn, torch.uint8)]
    cases = []
    for dtype, cache, group, head_dim in combos:  # a uint8 cache: int4 codes packed two a byte
        quant = (kernels.UNQUANTIZED if cache == dtype else kernels.INT4 if cache == torch.uint8
                 else kernels.SCALED).value
        common = dict(q=dtype, k_cache=cache, v_cache=cache, k_scales=torch.float16 if quant else cache,
                      v_scales=torch.float16 if quant else cache, stride_qt=1, stride_qh=1, stride_slot=1,
                      stride_head=1, scale_stride_slot=1, block_tables=torch.int32, stride_table=1,
                      seq_lens=torch.int32, scale_log2=1.0, window=1, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=16,
                      BLOCK_N=64, BLOCK_D=dot_depth(head_dim), QUANT=quant,
                      QUANT_GROUP=64 if cache == torch.uint8 else head_dim,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32", UPCAST_DOTS=False)
        name = f"{str(dtype)[6:]} q, {str(cache)[6:]} cache, group {group}, head_dim {head_dim}"
        for split, merge in ((False, False), (True, False), (True, True)):
            cases.append((f"decode ({name}, split {split}, merge {merge})", kernels.paged_decode_kernel, dict(
                common, out=torch.float32 if split else dtype, stride_ot=1, stride_oh=1, stride_os=1,
                lse=torch.float32, merged=dtype, stride_mt=1, stride_mh=1, counters=torch.int32, BLOCK_G=16,
                STORE_LSE=split, MERGE=merge, shared_lens=torch.int32, PREFIX_SLOTS=2 if merge else 0)))
        cases.append((f"cascade prefix ({name})", kernels.cascade_prefix_kernel, dict(
            common, out=torch.float32, stride_ot=1, stride_oh=1, stride_os=1, lse=torch.float32,
            shared_lens=torch.int32, order=torch.int32, num_decodes=1, num_slots=1, DECODES_PER_TILE=64 // group,
            BLOCK_M=64)))
        cases.append((f"prefill ({name})", kernels.paged_prefill_kernel, dict(
            common, out=dtype, stride_ot=1, stride_oh=1, query_starts=torch.int32, query_lens=torch.int32,
            QUERIES_PER_TILE=64 // group, BLOCK_M=64)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rope in (False, True):
            cases.append((f"store ({dtype}, rope {rope})", kernels.store_kv_kernel, dict(
                k_cache=dtype, v_cache=dtype, k=dtype, v=dtype, slots=torch.int64, stride_kt=1, stride_kh=1,
                stride_vt=1, stride_vh=1, stride_block=1, stride_slot=1, stride_head=1, num_kv_heads=1, q=dtype,
                stride_qt=1, stride_qh=1, num_heads=1, cos=dtype, sin=dtype, stride_cos=1, HEAD_DIM=128,
                PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, ROPE=rope, BLOCK_QH=32 if rope else 1)))
    for dtype in (torch.bfloat16, torch.float32):
        cases.append((f"merge ({dtype})", kernels.merge_splits_kernel, dict(
            out=dtype, stride_ot=1, stride_oh=1, partial=torch.float32, lse=torch.float32, num_splits=1,
            shared_lens=torch.int32, HEAD_DIM=128, BLOCK_S=32, BLOCK_D=128, PREFIX_SLOTS=2)))
    return cases


def ggml_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """The GGUF block GEMM for every type it reads in bf16 at both row tiles it launches, and one type of each
    block family (32 values, K-quant super-blocks) in fp16 and fp32."""
    from gguf import GGMLQuantizationType as Q

    from kvserve.model.layers import triton_ggml

    types = sorted(triton_ggml.TRITON_TYPES)
    combos = [(qtype, torch.bfloat16, block_m) for qtype in types for block_m in (16, 64)]
    combos += [(qtype, dtype, 16) for qtype in (Q.Q4_1, Q.Q4_K) for dtype in (torch.float16, torch.float32)]
    cases = []
    for qtype, dtype, block_m in combos:
        groups = triton_ggml.BLOCK_VALUES[qtype] // triton_ggml.GROUP_VALUES
        cases.append((f"{qtype.name} ({str(dtype)[6:]}, BLOCK_M {block_m})", triton_ggml.ggml_gemm_kernel, dict(
            x=dtype, w=torch.uint8, bias=dtype, y=dtype, M=1, N=1, K=1, stride_xm=1, stride_ym=1, row_bytes=1,
            QTYPE=int(qtype), BLOCK_BYTES=triton_ggml.BLOCK_BYTES[qtype], GROUPS=groups, HAS_BIAS=True,
            BLOCK_M=block_m, BLOCK_N=64)))
    return cases


def fused_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """The elementwise kernels of ``triton_fused_ops`` in each model dtype, every variant of the norm."""
    from kvserve.model.layers import triton_fused_ops as fused

    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype)[6:]
        for residual, x_norm in ((False, False), (True, False), (True, True)):
            cases.append((f"add_rms_norm ({name}, residual {residual}, x_norm {x_norm})", fused.add_rms_norm_kernel,
                          dict(out=dtype, residual=dtype, x=dtype, x_norm_weight=dtype, weight=dtype, stride_out=1,
                               stride_res=1, stride_x=1, n=1, offset=1.0, eps=1.0, HAS_RESIDUAL=residual,
                               HAS_X_NORM=x_norm, BLOCK_N=4096, options={"num_warps": fused.norm_warps(4096)})))
        cases.append((f"head_rms_norm ({name})", fused.head_rms_norm_kernel, dict(
            heads=dtype, stride_t=1, weight=dtype, num_heads=1, head_dim=1, offset=1.0, eps=1.0, BLOCK_H=32,
            BLOCK_D=128)))
        cases.append((f"rotary ({name})", fused.rotary_kernel, dict(
            qk=dtype, stride_t=1, cos=dtype, sin=dtype, stride_cos=1, num_heads=1, HALF=64, BLOCK_H=64, BLOCK_HALF=64)))
        for act in (0, 1):
            cases.append((f"act_and_mul ({name}, act {act})", fused.act_and_mul_kernel, dict(
                out=dtype, gate_up=dtype, stride_out=1, stride_in=1, n=1, ACT=act, BLOCK=fused.ACT_BLOCK)))
    return cases


def weight_only_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """The weight-only GEMM at every tile shape its autotuning tries, INT4 and INT8 in bf16, and one shape of each
    in fp16 and fp32; the dequantize kernel."""
    from kvserve.model.layers import triton_weight_only as weight_only

    # Llama-3-8B's o projection in groups of 128: every stride and size 16-divisible, as at run time
    configs = weight_only.DECODE_CONFIGS + weight_only.BATCH_CONFIGS
    combos = [(config, int4, torch.bfloat16) for config in configs for int4 in (True, False)]
    combos += [(configs[0], int4, dtype) for int4 in (True, False) for dtype in (torch.float16, torch.float32)]
    cases = []
    for config, int4, dtype in combos:
        tiles = ", ".join(f"{name} {value}" for name, value in config.kwargs.items())
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        cases.append((f"{'INT4' if int4 else 'INT8'} ({str(dtype)[6:]}, {tiles}, {options})",
                      weight_only.weight_only_gemm_kernel, dict(
            x=dtype, codes=torch.uint8 if int4 else torch.int8, scales=torch.float16, offsets=torch.float16,
            bias=dtype, y=dtype, M=3, N=4096, K=4096, stride_xm=4096, stride_codes=2048 if int4 else 4096,
            stride_scales=32 if int4 else 1, stride_ym=4096, group_size=128 if int4 else 4096, INT4=int4,
            HAS_OFFSET=int4, HAS_BIAS=False, **config.kwargs, options=options)))
    for int4 in (True, False):  # the dequantized GEMM's weight, in bf16
        cases.append((f"dequantize {'INT4' if int4 else 'INT8'}", weight_only.dequantize_kernel, dict(
            codes=torch.uint8 if int4 else torch.int8, scales=torch.float16, offsets=torch.float16,
            out=torch.bfloat16, N=4096, K=4096, stride_codes=2048 if int4 else 4096, stride_scales=32 if int4 else 1,
            stride_out=4096, group_size=128 if int4 else 4096, INT4=int4, HAS_OFFSET=int4, BLOCK_N=32, BLOCK_K=64)))
    return cases


def skinny_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """The skinny GEMM at every tile shape its autotuning tries, on dense bf16 weights plain (Llama-3-8B's o
    projection) and gated (its down projection), the first shape of one row in fp16 and fp32 too; and on
    weight-only INT4 (groups of 128) and INT8 codes, at the shapes the groups allow."""
    from kvserve.model.layers import triton_skinny as skinny

    cases = []
    for rows, configs in skinny.CONFIGS.items():
        for config in configs:
            first = rows == 1 and config is configs[0]
            tiles = ", ".join(f"{name} {value}" for name, value in config.kwargs.items())
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            formats = [("dense", dtype) for dtype in ((torch.bfloat16, torch.float16, torch.float32) if first
                                                      else (torch.bfloat16,))]
            formats += [(scheme, torch.bfloat16) for scheme in ("int4", "int8")
                        if scheme == "int8" or 128 % config.kwargs["BLOCK_K"] == 0]
            for scheme, dtype in formats:
                for act, k in ((-1, 4096), (0, 14336)):
                    codes, int4 = scheme != "dense", scheme == "int4"
                    cases.append((f"{rows} rows, {scheme}, ACT {act} ({str(dtype)[6:]}, {tiles}, {options})",
                                  skinny.skinny_gemm_kernel, dict(
                        x=dtype, w=torch.uint8 if int4 else torch.int8 if codes else dtype, scales=torch.float16,
                        offsets=torch.float16, bias=dtype, y=dtype, M=rows, N=4096, K=k,
                        stride_xm=k if act < 0 else 2 * k, stride_wn=k // 2 if int4 else k,
                        stride_scales=k // 128 if int4 else 1, stride_ym=4096, group_size=128 if int4 else k,
                        CODES=codes, INT4=int4, HAS_OFFSET=int4, ACT=act, HAS_BIAS=False, BLOCK_M=rows,
                        **config.kwargs, options=options)))
    return cases


def sample_cases() -> list[tuple[str, triton.JITFunction, dict[str, Any]]]:
    """The first max's two kernels (the parts of each row of logits, then their merge) in every model dtype, at
    Llama-3's vocabulary."""
    from kvserve.sample import triton_first_max as first_max

    cases = [(f"first max parts ({str(dtype)[6:]})", first_max.first_max_parts_kernel, dict(
        x=dtype, part_values=torch.float32, part_index=torch.int32, V=128256, stride_row=128256, part_len=2048,
        num_parts=63, BLOCK=first_max.BLOCK)) for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    return cases + [("first max merge", first_max.first_max_merge_kernel, dict(
        part_values=torch.float32, part_index=torch.int32, out=torch.int64, num_parts=63, V=128256, BLOCK_P=64))]


CASES = {"attention": attention_cases, "ggml": ggml_cases, "fused": fused_cases, "weight_only": weight_only_cases,
         "skinny": skinny_cases, "sample": sample_cases}


def resource_usage(compiled: Any) -> str:
    """The cubin's registers, local (spilled) memory and shared memory (cuobjdump, as Triton's wheel carries it):
    what the driver would report once a GPU loads it."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                                text=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL):(\d+)", report))
    return (f"{usage.get('REG', '?')} registers, {usage.get('LOCAL', '?')} bytes of local memory, "
            f"{compiled.metadata.shared} bytes of shared memory")


def main(family: str, verbose: bool = False) -> int:
    failed, cases = 0, CASES[family]()
    for name, kernel, args in cases:
        try:
            compiled = compile_for_hopper(kernel, **args)
            if verbose:
                print(f"{name}: {resource_usage(compiled)}")
        except Exception as error:  # report every case, not only the first
            failed += 1
            print(f"FAILED {name}: {type(error).__name__}: {str(error)[-2000:]}")
    print(f"{len(cases) - failed} of {len(cases)} {family} cases compiled for sm_90 with triton {triton.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], verbose="-v" in sys.argv[2:]))
