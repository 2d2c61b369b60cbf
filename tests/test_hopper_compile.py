"""Every Triton kernel compiles for a Hopper GPU (sm_90), on a machine without one (``tests/hopper_compile.py``):
the interpreter that runs the kernels' tests in CI accepts code the compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("family", ["attention", "ggml", "fused", "weight_only", "skinny", "sample"])
def test_triton_kernels_compile_for_hopper(family: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.hopper_compile", family], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "compiled for sm_90" in result.stdout
