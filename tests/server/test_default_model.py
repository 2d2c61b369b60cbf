"""`kvserve serve` with no model argument serves the default model, SmolLM2-135M-Instruct, which knows Paris."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from kvserve.config import DEFAULT_MODEL
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    server = ServerProcess(["--max-model-len", "1024", "--kv-cache-memory", "0.25"], tmp_path_factory.mktemp("logs"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_default_model_answers_a_chat_over_http(default_server: ServerProcess) -> None:
    client = default_server.openai()
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=32,
    )
    assert "Paris" in reply.choices[0].message.content
    assert 0 < reply.usage.completion_tokens <= 32 and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0


def test_the_server_lays_out_the_dense_copies_after_health_answers(default_server: ServerProcess) -> None:
    """The GGUF's dense copies (for steps of many tokens) come after start-up, on a thread of their own."""
    deadline = time.monotonic() + 60
    while "dense layouts of" not in default_server.log():
        assert time.monotonic() < deadline, default_server.log()
        time.sleep(0.1)
    assert "before the dense layouts under way" in default_server.log()
    assert re.search(r"dense layouts of \d+ layers ready for batched steps", default_server.log())
    client = default_server.openai()
    reply = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", temperature=0,
                                      max_tokens=4)
    assert reply.usage.completion_tokens == 4


def test_sigterm_while_the_dense_layouts_are_under_way_exits_0(tmp_path: Path) -> None:
    """The layouts' thread stops at its next layer: no torch op is cut off by the interpreter's exit."""
    server = ServerProcess(["--max-model-len", "1024", "--kv-cache-memory", "0.25"], tmp_path)
    try:
        server.wait_ready()
        server.terminate()
        assert server.process.wait(30) == 0
    finally:
        server.kill()
    assert "terminate called" not in server.log() and "Traceback" not in server.log()
