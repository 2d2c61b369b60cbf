"""Request bodies: fields outside OpenAI's and vLLM's sets are ignored, and each is logged once by name; OpenAI's
own fields are honoured, accepted where they change nothing, or refused by name."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest


def test_an_unknown_field_is_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5, "max_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="kvserve.server.protocol"):
        first = ChatCompletionRequest.model_validate(body)
        ChatCompletionRequest.model_validate(body)
    assert first.temperature is None and first.max_tokens == 3
    logged = [r.getMessage() for r in caplog.records if "temprature" in r.getMessage()]
    assert logged == ["ignoring the unknown field 'temprature' of ChatCompletionRequest (logged once)"]


MESSAGES = [{"role": "user", "content": "hi"}]


def test_fields_that_change_nothing_are_accepted() -> None:
    body = {"messages": MESSAGES, "service_tier": "auto", "metadata": {"team": "a"}, "prompt_cache_key": "k",
            "store": False, "safety_identifier": "user-1", "user": "u"}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params().n == 1


@pytest.mark.parametrize("extra, fragment", [
    ({"store": True}, "store is not supported"),
    ({"verbosity": "low"}, "verbosity is not supported"),
    ({"service_tier": "flex"}, "service_tier"),
])
def test_openai_fields_kvserve_does_not_implement_are_refused_by_name(extra: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra})


def test_best_of_is_honoured_only_as_n() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).to_sampling_params().n == 2
    with pytest.raises(ValidationError, match="best_of other than n"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 3})
