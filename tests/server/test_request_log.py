"""``--enable-log-requests``: a line as each request is queued and one as it ends, over the model-free server."""

from __future__ import annotations

import logging
from typing import Iterator

import httpx
import pytest

from kvserve.cli import build_parser
from kvserve.cli_serve import server_settings
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.request_log import RequestLog
from tests.server.test_app_fake_engine import MODEL, InProcessServer, wait_until

LOGGER = "kvserve.server.request_log"


@pytest.fixture(scope="module")
def logged() -> Iterator[InProcessServer]:
    server = InProcessServer(request_log=RequestLog(enabled=True, max_log_len=6))
    yield server
    server.stop()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_request_is_logged_as_queued_and_as_finished(logged: InProcessServer,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    answer = httpx.post(f"{logged.url}/v1/completions", headers={"X-Request-Id": "abc"},
                        json={"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0}).json()
    assert answer["id"] == "cmpl-abc"
    wait_until(lambda: len(lines(caplog)) == 2, "the request's two lines")
    queued, ended = lines(caplog)
    # the prompt cut to --max-log-len's 6 characters; the engine's own id beside the answer's
    assert queued.startswith("request cmpl-abc (engine id cmpl-") and "queued: prompt: 'hello ', params: " in queued
    assert "max_tokens=3" in queued and "hello world" not in queued
    assert ended.startswith("request cmpl-abc finished after ")
    assert ended.endswith("11 prompt tokens (0 cached), 3 output tokens, finish reasons: length")


def test_token_ids_and_a_batch_are_logged_a_line_each(logged: InProcessServer,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    httpx.post(f"{logged.url}/v1/completions", headers={"X-Request-Id": "two"},
               json={"model": MODEL, "prompt": [list(range(65, 75)), [66]], "max_tokens": 2}).raise_for_status()
    wait_until(lambda: len(lines(caplog)) == 4, "two lines for each prompt")
    queued = [line for line in lines(caplog) if " queued: " in line]
    assert queued[0].startswith("request cmpl-two-0 (engine id cmpl-") and queued[0].split(")", 1)[0].endswith("-0")
    assert "prompt_token_ids: [65, 66, 67, 68, 69, 70] (10 tokens)" in queued[0]
    assert "prompt_token_ids: [66] (1 tokens)" in queued[1] and queued[1].startswith("request cmpl-two-1 ")
    ended = sorted(line for line in lines(caplog) if " finished after " in line)
    assert ended[0].startswith("request cmpl-two-0 ") and "10 prompt tokens" in ended[0]
    assert ended[1].startswith("request cmpl-two-1 ") and "1 prompt tokens" in ended[1]


def test_a_chat_logs_its_rendered_prompt(logged: InProcessServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    httpx.post(f"{logged.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
    wait_until(lambda: len(lines(caplog)) == 2, "the chat's two lines")
    queued = lines(caplog)[0]
    assert queued.startswith("request chatcmpl-") and "prompt: '<user>', prompt_token_ids: [60, 117, " in queued
    assert "(19 tokens)" in queued  # '<user>hi<assistant>


def test_a_client_gone_midway_is_logged_as_aborted(logged: InProcessServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{logged.url}/v1/completions", headers={"X-Request-Id": "gone"}, json=body) as r:
        next(r.iter_lines())  # the first chunk, then the client hangs up
    wait_until(lambda: any(" was aborted " in line for line in lines(caplog)), "the aborted request's line")
    ended = [line for line in lines(caplog) if " was aborted " in line]
    assert ended == [line for line in ended if line.startswith("request cmpl-gone was aborted (its client went away)")]
    logged.wait_idle()


def test_a_request_refused_as_it_is_queued_is_logged_as_refused(logged: InProcessServer,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    refused = httpx.post(f"{logged.url}/v1/completions", headers={"X-Request-Id": "big"},
                         json={"model": MODEL, "prompt": "x", "max_tokens": 1000})
    assert refused.status_code == 400
    wait_until(lambda: len(lines(caplog)) == 2, "the refused request's two lines")
    assert lines(caplog)[1].startswith("request cmpl-big was refused (ValueError: prompt + max_tokens is over")


def test_a_client_gone_before_any_output_is_logged_as_aborted(caplog: pytest.LogCaptureFixture) -> None:
    """The line was written only once a first output came: a request its client left before then had none."""
    caplog.set_level(logging.INFO, LOGGER)
    server = InProcessServer(step_seconds=1.0, request_log=RequestLog(enabled=True))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "left"}, timeout=0.3,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        wait_until(lambda: len(lines(caplog)) == 2, "the request's end")
    finally:
        server.stop()
    assert lines(caplog)[1].startswith("request cmpl-left was aborted (its client went away) after ")


def test_requests_are_not_logged_by_default(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    server = InProcessServer()
    try:
        httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                   ).raise_for_status()
    finally:
        server.stop()
    assert lines(caplog) == []


def test_the_flags_reach_the_settings() -> None:
    parse = build_parser("serve").parse_args
    assert server_settings(parse(["serve", "m"])).request_log == RequestLog()
    settings = server_settings(parse(["serve", "m", "--enable-log-requests", "--max-log-len", "0"]))
    assert settings.request_log == RequestLog(enabled=True, max_log_len=0)
    with pytest.raises(ValueError, match="--max-log-len must be >= 0, got -1"):
        server_settings(parse(["serve", "m", "--enable-log-requests", "--max-log-len", "-1"]))


def test_a_request_the_engine_failed_is_logged_as_failed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    server = InProcessServer(request_log=RequestLog(enabled=True))
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", headers={"X-Request-Id": "dies"}, json=body,
                          timeout=30) as response:
            lines_read = response.iter_lines()
            next(lines_read)
            server.fake.step_error = RuntimeError("device lost")
            list(lines_read)
        wait_until(lambda: any(" failed " in line for line in lines(caplog)), "the failed request's line")
    finally:
        server.stop()
    (ended,) = [line for line in lines(caplog) if " queued: " not in line]
    assert ended.startswith("request cmpl-dies failed (EngineDeadError: ") and "device lost" in ended


def test_the_params_lists_and_texts_are_cut_to_max_log_len(caplog: pytest.LogCaptureFixture) -> None:
    """An allowed_token_ids of the whole vocabulary and a thousand bad words wrote a 1.4 MB line for one request."""
    caplog.set_level(logging.INFO, LOGGER)
    params = SamplingParams(allowed_token_ids=list(range(40_000)), bad_words=["word"] * 1000, stop="s" * 500,
                            structured_outputs=StructuredOutputsParams(regex="a" * 10_000))
    RequestLog(enabled=True, max_log_len=6).queued("r", "r", ["hello world"], params)
    (line,) = lines(caplog)
    assert "allowed_token_ids=[0, 1, 2, 3, 4, 5] (40000 items)" in line and "(1000 items)" in line
    assert "stop='ssssss' (500 characters)" in line
    assert f"structured_outputs=Struct... ({len(repr(params.structured_outputs))} characters)" in line
    assert len(line) < 1000
    assert "allowed_token_ids=None" in RequestLog(enabled=True, max_log_len=None)._params(SamplingParams())
