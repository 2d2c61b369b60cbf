"""Request bodies: fields outside OpenAI's and vLLM's sets are ignored, and each is logged once by name."""

from __future__ import annotations

import logging

import pytest

from kvserve.server.protocol import ChatCompletionRequest


def test_an_unknown_field_is_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5, "max_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="kvserve.server.protocol"):
        first = ChatCompletionRequest.model_validate(body)
        ChatCompletionRequest.model_validate(body)
    assert first.temperature is None and first.max_tokens == 3
    logged = [r.getMessage() for r in caplog.records if "temprature" in r.getMessage()]
    assert logged == ["ignoring the unknown field 'temprature' of ChatCompletionRequest (logged once)"]
