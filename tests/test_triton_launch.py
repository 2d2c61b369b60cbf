"""Programmatic dependent launch of the Triton kernels (``kvserve/triton_launch.py``): on for Hopper-class CUDA
devices while enabled, off elsewhere (the interpreter's CPU tensors included); a kernel compiled with it waits for
the kernel before and releases the next as its first instructions, and without it has neither."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kvserve import triton_launch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_pdl_is_off_off_cuda_and_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_launch.pdl_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(triton_launch, "_supported", lambda index: True)
    assert triton_launch.pdl_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(triton_launch, "ENABLED", False)
    assert triton_launch.pdl_options(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.setattr(triton_launch, "ENABLED", True)
    monkeypatch.setattr(triton_launch, "_supported", lambda index: False)  # before Hopper
    assert triton_launch.pdl_options(torch.device("cuda", 0)) == {"PDL": False}


def test_a_device_where_launches_under_pdl_fail_keeps_them_off_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe: here the interpreter cannot run the PDL instructions and a CPU has no graphs to capture."""
    with caplog.at_level("WARNING"):
        assert triton_launch._probe(torch.device("cpu")) is False
    assert "launch without programmatic dependent launch on cpu" in caplog.text


SCRIPT = """
import torch
from tests.hopper_compile import compile_for_hopper
from kvserve.model.layers.triton_fused_ops import act_and_mul_kernel
for pdl in (True, False):
    compiled = compile_for_hopper(act_and_mul_kernel, out=torch.bfloat16, gate_up=torch.bfloat16, stride_out=4096,
                                  stride_in=8192, n=4096, ACT=0, BLOCK=1024, PDL=pdl)
    body = compiled.asm["ptx"].split("{", 1)[1]
    lines = [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith(".reg")]
    first_load = next(i for i, line in enumerate(lines) if "ld.global" in line)
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    print(pdl, [line for line in lines if "griddepcontrol" in line], wait is not None and wait < first_load)
"""


def test_a_kernel_compiled_with_pdl_waits_then_releases_the_next_before_its_work() -> None:
    """Compiled for sm_90 in a process without the interpreter: the wait and the release come before any load."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with_pdl, without = result.stdout.splitlines()[-2:]
    assert with_pdl == "True ['griddepcontrol.wait ;', 'griddepcontrol.launch_dependents ;'] True"
    assert without == "False [] False"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper-class GPU")
def test_pdl_is_on_on_a_hopper_gpu() -> None:
    """The probe ran under PDL, eagerly and from a captured graph, and counted every launch."""
    assert triton_launch.pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
