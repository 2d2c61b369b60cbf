"""StepProfiler: ``torch.profiler`` traces of the engine's steps between a ``start`` and a ``stop`` (vLLM's
``start_profile`` / ``stop_profile``), one trace a pair, written as vLLM's workers write theirs: Chrome trace JSON,
gzipped, named ``<worker>.<time in ns>.pt.trace.json.gz`` in the directory the start named (Perfetto and
TensorBoard read it). Each step is a range (``STEP_RANGE``), kvserve's C kernels ranges of their own
(``native.kernel_range``), CPU activity always and CUDA's on a GPU. Shapes and Python stacks are not recorded
(vLLM's ``VLLM_TORCH_PROFILER_RECORD_SHAPES`` / ``WITH_STACK`` are not read): a stack per op multiplies a CPU
step's time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from kvserve.native import kernel_range

logger = logging.getLogger(__name__)

TRACE_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM's: where the offline LLM's traces go when it names none
WORKER_NAME = "kvserve-engine"
STEP_RANGE = "LLMEngine.step"


class StepProfiler:
    """The profiler of one engine, started and stopped on the thread that steps it."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._trace_path = ""

    @property
    def is_profiling(self) -> bool:
        return self._profile is not None

    def start(self, trace_dir: str) -> None:
        """Record from now on, for a trace in ``trace_dir`` (made if missing); RuntimeError if already recording."""
        if self._profile is not None:
            raise RuntimeError("the profiler is running already: stop_profile first")
        os.makedirs(trace_dir, exist_ok=True)
        self._trace_path = os.path.join(trace_dir, f"{WORKER_NAME}.{time.time_ns()}.pt.trace.json.gz")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, on_trace_ready=self._write)
        profile.start()
        self._profile = profile
        logger.info("profiling the engine's steps into %s", trace_dir)

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path. RuntimeError naming ``start_profile`` where none
        is recording."""
        if self._profile is None:
            raise RuntimeError("stop_profile without a start_profile: the profiler is not running")
        profile, self._profile = self._profile, None
        profile.stop()
        return self._trace_path

    def step_range(self) -> contextlib.AbstractContextManager:
        """A step's range in the trace (nothing while not recording)."""
        return kernel_range(STEP_RANGE)

    def _write(self, profile: torch.profiler.profile) -> None:
        profile.export_chrome_trace(self._trace_path)
        logger.info("profile trace written to %s", self._trace_path)


def trace_dir_from_environment() -> str | None:
    """vLLM's ``$VLLM_TORCH_PROFILER_DIR``, None where unset or empty."""
    return os.environ.get(TRACE_DIR_ENV) or None
