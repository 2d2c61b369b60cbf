"""The configuration and the command line's flags are plain data: defining them imports no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_configuration_and_the_serve_flags_import_neither_torch_nor_transformers() -> None:
    """`kvserve serve --help` and `EngineArgs` pay nothing for torch (about 2 s) or transformers. A subprocess,
    since this test process has imported both already."""
    code = ("import sys, kvserve.config, kvserve.engine_args, kvserve.cli_serve; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
