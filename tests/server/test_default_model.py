"""`kvserve serve` with no model argument serves the default model, SmolLM2-135M-Instruct, which knows Paris."""

from __future__ import annotations

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
        server.kill()


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
