"""Programmatic dependent launch (PDL) of kvserve's Triton kernels on Hopper and later GPUs.

A decode step is a chain of short kernels, each waiting for the one before: inside a CUDA graph a kernel starts ~2
us after the previous one ends (the profile of a Llama-3-8B step in docs/results/session15-h200: ~0.4 ms of its 5 ms
between kernels). Launched with PDL (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, which stream capture
keeps as a programmatic edge of the graph), a kernel may be scheduled while the kernel before it still runs, once
every program of that one has signalled (``griddepcontrol.launch_dependents``) or it has ended; it then waits
(``griddepcontrol.wait``) until the one before has ended and its writes are visible, before reading or writing
anything. Both are a kernel's first step (``enter_chain``). Every kernel launched this way waits before any access
to memory, and so ends after the kernel before it: ordering stays transitive along the chain, whatever sits between
(a kernel launched without PDL, cuBLAS, waits for everything before it as a stream always does).

``pdl_options(device)`` gives a launch's keyword arguments: ``PDL`` (the kernels' constexpr: whether to emit
the two instructions) and, where PDL is on, ``launch_pdl``. PDL is on for CUDA devices of compute capability 9.0
or more while ``ENABLED`` (``gpu_decode_step.py --no-pdl`` turns it off, an A/B of it), once a probe kernel has
run under PDL on the device, eagerly and inside a captured CUDA graph; Triton's interpreter, which cannot run the
instructions, runs the kernels on CPU tensors, so without them.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

logger = logging.getLogger(__name__)

ENABLED = True


@triton.jit
def enter_chain(PDL: tl.constexpr):
    """A kernel's first step under PDL: wait until the kernel launched before it has ended and its writes are
    visible (before any access to memory), then let the kernel launched after it be scheduled. That one waits in
    turn, so it may start early without harm; its programs are scheduled only once every program of this kernel
    has passed here, so they take no multiprocessor a program of this one still needs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_options(device: torch.device) -> dict[str, bool]:
    """A Triton launch's keyword arguments for PDL on ``device``: ``{"PDL": False}`` where it is off."""
    on = ENABLED and device.type == "cuda" and _supported(device.index)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def _probe_kernel(x, PDL: tl.constexpr):
    enter_chain(PDL)
    tl.store(x, tl.load(x) + 1)


def _supported(index: int | None) -> bool:
    """Whether PDL runs on CUDA device ``index``: found once (every launch asks)."""
    index = torch.cuda.current_device() if index is None else index
    if index not in _probed:
        if gdc_wait is None or torch.cuda.get_device_capability(index)[0] < 9:
            _probed[index] = False
        elif torch.cuda.is_current_stream_capturing():  # no probe inside a capture: plain launches until one runs
            return False
        else:
            _probed[index] = _probe(torch.device("cuda", index))
    return _probed[index]


_probed: dict[int, bool] = {}


def _probe(device: torch.device) -> bool:
    """Whether launches under PDL run on ``device``, eagerly and captured in a CUDA graph (a driver without the
    launch attribute, or a capture without programmatic edges, would fail every step): PDL stays off, with a
    warning, where they do not."""
    try:
        x = torch.zeros(1, dtype=torch.int32, device=device)
        for _ in range(2):
            _probe_kernel[(1,)](x, PDL=True, launch_pdl=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(2):
                _probe_kernel[(1,)](x, PDL=True, launch_pdl=True)
        graph.replay()
        torch.cuda.synchronize(device)
        if int(x.item()) != 4:  # two launches eagerly, two replayed (capturing runs none)
            raise RuntimeError(f"the probe counted {int(x.item())}, not 4")
        return True
    except Exception as error:  # any refusal of the launch attribute: the kernels launch plainly instead
        logger.warning("Triton kernels launch without programmatic dependent launch on %s: %s", device, error)
        return False
