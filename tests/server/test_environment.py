"""The environment a server reads: its API key (vLLM's too), and vLLM's other variables, named as unread."""

from __future__ import annotations

import logging

from kvserve.server.environment import warn_of_vllm_environment


def test_vllms_variables_that_nothing_reads_are_named_with_their_counterparts(monkeypatch, caplog) -> None:
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("VLLM_SOMETHING_NEW", "1")
    monkeypatch.setenv("VLLM_API_KEY", "read")  # read as the API key: not warned about
    with caplog.at_level(logging.WARNING, "kvserve.server.environment"):
        warn_of_vllm_environment()
    assert [r.getMessage() for r in caplog.records] == [
        "$VLLM_LOGGING_LEVEL is vLLM's and kvserve does not read it; use --log-level",
        "$VLLM_SOMETHING_NEW is vLLM's and kvserve does not read it",
    ]
