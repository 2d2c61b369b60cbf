"""``kvserve serve --data-parallel-backend ray``: replicas placed as Ray actors on a local Ray cluster behind the
router, a replica whose server dies restarted by Ray, and nothing left running after SIGTERM. Needs Ray
(``pip install 'kvserve[ray]'``), which CI does not install."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.router.test_router_e2e import checkpoint, complete, serve_flags  # noqa: F401 (a fixture)
from tests.server.conftest import free_port

pytest.importorskip("ray")


def replicas_up(url: str) -> int:
    try:
        health = httpx.get(f"{url}/health", timeout=1)
    except httpx.TransportError:
        return 0
    return len(health.json().get("replicas_up", [])) if health.status_code == 200 else 0


def wait_for(condition, seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def replica_pids(port: int) -> list[str]:
    """The replica servers on ``port`` (``serve_command`` puts a replica's --host and --port right after serve)."""
    found = subprocess.run(["pgrep", "-f", f"kvserve.cli serve .*--port {port}( |$)"], capture_output=True,
                           text=True)
    return found.stdout.split()


def test_ray_replicas_serve_restart_and_stop(checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    port = free_port()
    log_path = tmp_path / "ray-dp.log"
    env = {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *serve_flags(checkpoint),
                                    "--port", str(port), "--data-parallel-size", "2", "--data-parallel-backend",
                                    "ray", "--replica-cpus", "0.5"], stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: replicas_up(url) == 2, 180, log_path)
        assert complete(url, "hello")["choices"][0]["text"]
        (victim,) = replica_pids(port + 1)
        os.kill(int(victim), signal.SIGKILL)  # the server dies; its actor lives on until the supervisor sees it
        wait_for(lambda: replica_pids(port + 1) not in ([], [victim]) and replicas_up(url) == 2, 180, log_path)
        assert "restarting its actor" in log_path.read_text()
        assert [complete(url, f"after {i}")["choices"][0]["text"] is not None for i in range(4)] == [True] * 4
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    assert replica_pids(port + 1) == [] and replica_pids(port + 2) == []
