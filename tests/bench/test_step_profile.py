"""The step profile's grouping: aten ops, oneDNN's prepacked GEMMs and kvserve's own attention, GGUF block and
fused-op kernels."""

from __future__ import annotations

import gguf
import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.attention.cpu_paged import DECODE_KERNEL_RANGE, PREFILL_KERNEL_RANGE, CpuPagedBackend
from kvserve.bench.step_profile import OP_GROUPS, StepProfile, top_level_ops
from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.cpu_fused_ops import FUSED_OPS_RANGE, CpuFusedOps
from kvserve.model.layers.ggml import GGML_GEMM_RANGE, GGMLGemm
from kvserve.model.layers.ggml_qdot import GGML_QDOT_RANGE, QDotGemm
from kvserve.model.layers.linear import linear_from_tensors
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod
from tests.attention.test_cpu_paged import make_step
from tests.attention.test_torch_ref import LAYER
from tests.model.test_ggml import blocks_of


def test_each_kind_of_op_lands_in_its_group() -> None:
    step = make_step([(40, 1), (90, 1), (10, 12)], 2, head_dim=64, block_size=16, num_kv_heads=1, group=2)
    backend = CpuPagedBackend()
    meta = backend.build_metadata(step.inputs, {None})
    linear = linear_from_tensors(torch.randn(256, 128), None, CpuPrepackedLinearMethod(None))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = linear(torch.randn(8, 128))
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=0.1)  # writes K/V, then the kernel
        logits.argmax(-1)
        torch.relu(logits)
        CpuFusedOps().act_and_mul(GatedMLP(8, 128, "silu", bias=False), logits)
        blocks = blocks_of(torch.randn(64, 128), gguf.GGMLQuantizationType.Q4_1)
        GGMLGemm().batched(torch.randn(12, 128), blocks, None)  # the block kernels: GEMMs too
        QDotGemm().batched(torch.randn(12, 128), blocks, None)
    names = {event.name for event in top_level_ops(prof.events())}
    assert FUSED_OPS_RANGE in names and not any(FUSED_OPS_RANGE in group for group in OP_GROUPS.values())
    assert "mkldnn::_linear_pointwise" in names and "mkldnn::_linear_pointwise" in OP_GROUPS["GEMMs"]
    for kernel in (DECODE_KERNEL_RANGE, PREFILL_KERNEL_RANGE):
        assert kernel in names and kernel in OP_GROUPS["attention + KV"]
    for kernel in (GGML_GEMM_RANGE, GGML_QDOT_RANGE):
        assert kernel in names and kernel in OP_GROUPS["GEMMs"]
    profiled = StepProfile(every=2)
    profiled.collect(prof)
    assert set(profiled.groups_s) == {"GEMMs", "attention + KV", "sampling", "other ops"}
    assert all(seconds > 0 for seconds in profiled.groups_s.values()), profiled.groups_s
