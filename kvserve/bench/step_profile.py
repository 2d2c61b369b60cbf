"""Where kvserve's engine step time goes: ops recorded by ``torch.profiler`` grouped by kind, and the rest of
the steps' wall time as Python/framework overhead. ``kvserve bench throughput --profile`` drives it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import profile

from kvserve.attention.cpu_paged import DECODE_KERNEL_RANGE, PREFILL_KERNEL_RANGE
from kvserve.model.layers.cpu_fused_ops import FUSED_OPS_RANGE
from kvserve.model.layers.ggml import GGML_GEMM_RANGE
from kvserve.model.layers.ggml_qdot import GGML_QDOT_RANGE
from kvserve.model.layers.prepacked import SMALL_GEMM_RANGE

OP_NAMESPACES = ("aten::", "mkldnn::")
# kvserve's own C kernels, as record_function ranges; the fused elementwise ops count as "other ops"
KERNEL_RANGES = (DECODE_KERNEL_RANGE, PREFILL_KERNEL_RANGE, SMALL_GEMM_RANGE, GGML_GEMM_RANGE, GGML_QDOT_RANGE,
                 FUSED_OPS_RANGE)
# Ops called from Python, grouped by name; ops nested inside them count toward their caller.
OP_GROUPS = {
    "GEMMs": {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm",
              "mkldnn::_linear_pointwise", SMALL_GEMM_RANGE, GGML_GEMM_RANGE, GGML_QDOT_RANGE},
    "attention + KV": {"aten::scaled_dot_product_attention", "aten::index_select", "aten::index_copy_",
                       "aten::index_put_", "aten::gather", DECODE_KERNEL_RANGE, PREFILL_KERNEL_RANGE},
    "sampling": {"aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::log_softmax",
                 "aten::multinomial"},
}


@dataclass
class StepProfile:
    """Where the profiled steps' time went: op time by group; the rest of their wall time is Python/framework
    overhead (the profiler's own small per-op cost included)."""

    every: int
    num_calls: int = 0
    num_steps: int = 0
    num_profiled_steps: int = 0
    wall_s: float = 0.0
    groups_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys([*OP_GROUPS, "other ops"], 0.0))

    def collect(self, prof: profile) -> None:
        for event in top_level_ops(prof.events()):
            group = next((g for g, names in OP_GROUPS.items() if event.name in names), "other ops")
            self.groups_s[group] += event.cpu_time_total / 1e6

    def summary(self) -> dict[str, Any]:
        groups = {**self.groups_s, "Python/framework": self.wall_s - sum(self.groups_s.values())}
        return {"num_steps": self.num_steps, "num_profiled_steps": self.num_profiled_steps,
                "wall_s": self.wall_s, "groups_s": groups}


def top_level_ops(events: Sequence[FunctionEvent]) -> list[FunctionEvent]:
    """Ops (and kvserve's own kernels) called from Python: their inclusive times add up without counting
    nested ops twice."""
    return [e for e in events if _is_op(e.name) and not _has_op_ancestor(e)]


def _is_op(name: str) -> bool:
    return name.startswith(OP_NAMESPACES) or name in KERNEL_RANGES


def _has_op_ancestor(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def format_profile(summary: dict[str, Any]) -> str:
    if not summary["num_profiled_steps"]:
        return f"kvserve ran {summary['num_steps']} steps, fewer than --profile-every: none was profiled"
    wall = summary["wall_s"]
    lines = [f"kvserve step time: {summary['num_profiled_steps']} of {summary['num_steps']} steps profiled "
             f"(eager), {wall:.2f} s"]
    lines += [f"  {group:<18}{s:>8.2f} s {s / wall:>5.0%}" for group, s in summary["groups_s"].items()]
    return "\n".join(lines)
