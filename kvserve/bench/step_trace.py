"""Where a run's step time goes when the host cannot see into the device: the time at which each engine step's
tokens come back, with the step's shape, and a least-squares fit of the steps' periods to that shape.
``kvserve bench throughput --step-trace`` drives it.

A step's period is the time from the previous step's tokens coming back to its own. When the device is the
bottleneck (and the overlapped scheduler queues each step before the one before is read back) that is the
step's device time; when the host is, the host's time shows up in the fit's per-step or per-row terms. The fit
splits the periods into a cost per step, per decode row (sampling, a GEMM row), per context token a decode row
attends over (the KV it reads) and per prefill token (its GEMM FLOPs and attention), and says what share of the
run's time each term explains. Where two terms move together through a run (decode rows and their context
tokens, in a run of equal prompts), the fit may split their time between them in any proportion (one may come
out negative): their sum is what holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.sched.output import SchedulerOutput

TERMS = ("per_step", "per_decode_row", "per_context_token", "per_prefill_token")


@dataclass
class StepTrace:
    """What ``LLMEngine.observe_steps`` calls: one row per step read back, [time, decode rows, their context tokens,
    prefill tokens], in segments (one per ``LLM.generate`` call: the time between two calls is no step's)."""

    segments: list[list[tuple[float, int, int, int]]] = field(default_factory=list)

    def new_segment(self) -> None:
        self.segments.append([])

    def __call__(self, sched_out: SchedulerOutput) -> None:
        decodes = context = prefill = 0
        for request in sched_out.requests:
            if request.is_decode:
                decodes += 1
                context += request.start_pos + request.num_tokens
            else:
                prefill += request.num_tokens
        if not self.segments:
            self.new_segment()
        self.segments[-1].append((time.perf_counter(), decodes, context, prefill))

    def summary(self) -> dict[str, Any]:
        """The fit's coefficients (seconds per unit of each term), each term's share of the traced time, R²."""
        steps = [np.array(rows, dtype=np.float64) for rows in self.segments if len(rows) > 1]
        periods = np.concatenate([np.diff(rows[:, 0]) for rows in steps]) if steps else np.zeros(0)
        if len(periods) < 2 * len(TERMS):
            return {"num_steps": len(periods)}
        shape = np.column_stack([np.ones(len(periods)), np.concatenate([rows[1:, 1:] for rows in steps])])
        coefficients, *_ = np.linalg.lstsq(shape, periods, rcond=None)
        explained = shape * coefficients
        residual = periods - explained.sum(axis=1)
        total = float(periods.sum())
        return {
            "num_steps": len(periods), "traced_s": total,
            "seconds": dict(zip(TERMS, map(float, coefficients))),
            "share": dict(zip(TERMS, (float(s) for s in explained.sum(axis=0) / total))),
            "r2": float(1 - (residual**2).sum() / ((periods - periods.mean()) ** 2).sum()),
            "mean_decode_rows": float(shape[:, 1].mean()),
        }


def format_step_trace(summary: dict[str, Any]) -> str:
    if "seconds" not in summary:
        return f"step trace: {summary['num_steps']} steps, too few to fit"
    s, share = summary["seconds"], summary["share"]
    return (f"step trace: {summary['num_steps']} steps over {summary['traced_s']:.1f} s, mean "
            f"{summary['mean_decode_rows']:.0f} decode rows; fit (R² {summary['r2']:.2f}): "
            f"{s['per_step'] * 1e3:.2f} ms a step ({share['per_step']:.0%}), "
            f"{s['per_decode_row'] * 1e6:.1f} us a decode row ({share['per_decode_row']:.0%}), "
            f"{s['per_context_token'] * 1e9:.1f} ns a context token ({share['per_context_token']:.0%}), "
            f"{s['per_prefill_token'] * 1e6:.1f} us a prefill token ({share['per_prefill_token']:.0%})")
