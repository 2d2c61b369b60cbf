"""``kvserve router`` starts without the engine: the CLI hands ``router`` to its own parser before building the
one that imports torch and transformers, so the router process never loads them (layer rule: router -> server
for the error shape only)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = ("torch", "transformers", "kvserve.engine", "kvserve.config", "kvserve.model", "kvserve.worker")

STARTS_THE_ROUTER = f"""
import sys
import uvicorn

def run(app, **kwargs):  # the app is built and about to be served: what has been imported by now
    print(" ".join(m for m in {ENGINE_MODULES!r} if m in sys.modules) or "none")

uvicorn.run = run
from kvserve.cli import main
sys.exit(main(["router", "--worker", "http://127.0.0.1:9", "--worker", "http://127.0.0.1:10", "--port", "0",
               "--routing-policy", "round_robin"]))
"""


def test_starting_the_router_imports_neither_torch_nor_transformers() -> None:
    done = subprocess.run([sys.executable, "-c", STARTS_THE_ROUTER], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none"


def test_router_help_imports_neither_and_lists_every_flag() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvserve.cli", "router", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}
    for flag in ("--worker", "--host", "--port", "--routing-policy", "cache_aware,round_robin,least_load"):
        assert flag in done.stdout


def test_the_full_parser_still_lists_the_router() -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "router" in done.stdout


def test_a_worker_url_without_a_scheme_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--worker", "localhost:8001"]) == 2
    assert "kvserve: error: a replica URL must be http://HOST[:PORT]" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_replica_processes_end_with_a_router_killed_on_the_spot() -> None:
    """A router killed with SIGKILL runs no cleanup: its replicas end through the parent-death signal."""
    router = subprocess.Popen([sys.executable, "-c", """
import subprocess, sys, time
from kvserve.router.launch import _die_with_parent  # what LocalReplicas starts each replica with
replica = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=_die_with_parent)
print(replica.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    replica_pid = int(router.stdout.readline())
    router.kill()
    router.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{replica_pid}").exists() and _state(replica_pid) != "Z":
        assert time.monotonic() < deadline, "the replica outlived its router"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
