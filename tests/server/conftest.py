"""Real ``kvserve serve`` processes on 127.0.0.1 over a tiny seeded checkpoint, for black-box HTTP tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

STARTUP_TIMEOUT_S = 90.0
MODEL_NAME = "tiny-llama"
NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvserve serve`` in a subprocess; its output goes to a log file (a pipe nobody reads would block it)."""

    def __init__(self, serve_args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        command = [sys.executable, "-m", "kvserve.cli", "serve", *serve_args, "--port", str(self.port)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             **kwargs)

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """A test's end: SIGTERM (an idle server drains at once, and a coverage run keeps what the server ran),
        then SIGKILL should it still run 10 s later."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics, e.g. ``metric("kvserve:prompt_tokens_total")``."""
        return scrape(httpx.get(f"{self.url}/metrics").text, name, **labels)


def scrape(text: str, name: str, **labels: str) -> float:
    label_pattern = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{label_pattern}[^}}]*}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    if match is None:
        raise KeyError(f"{name} {labels} is not in /metrics")
    return float(match.group(1))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.model.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "llama", "llama", "tiny", seed=0)


@pytest.fixture(scope="session")
def start_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A factory: ``start_server(*flags)`` -> a healthy ServerProcess, killed at the end of the session."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(*flags: str, wait: bool = True) -> ServerProcess:
        server = ServerProcess(
            [str(tiny_checkpoint), "--served-model-name", MODEL_NAME, "--num-kv-blocks", str(NUM_KV_BLOCKS),
             "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu", *flags],
            log_dir,
        )
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """The shared server most tests talk to."""
    return start_server()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


# The scripted model-free servers the Responses and Messages tests share (each module gets its own): a text answer,
# a Hermes tool call, a Qwen3 thinking; imported as used, the scripts living beside the engine that spells them.
@pytest.fixture(scope="module")
def talker() -> Iterator:
    from tests.server.test_responses import ANSWER, scripted_server

    yield from scripted_server(ANSWER)


@pytest.fixture(scope="module")
def caller() -> Iterator:
    from tests.server.test_responses import CALL, scripted_server

    yield from scripted_server(f"Checking.\n{CALL}")


@pytest.fixture(scope="module")
def thinker() -> Iterator:
    from tests.server.test_reasoning import SCRIPT
    from tests.server.test_responses import scripted_server

    yield from scripted_server(SCRIPT, reasoning_parser="qwen3")
