"""How kvserve's processes log: uvicorn's warnings for a connection upgrade kvserve does not serve are dropped, and
so are the access lines of probes answered 200."""

from __future__ import annotations

import logging

import pytest

from kvserve import logs


def test_uvicorns_upgrade_warnings_are_dropped_and_its_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    """Any client sending `Connection: Upgrade` wrote two WARNING lines a request, one telling the operator to
    install a WebSocket library, which kvserve turns off on purpose (the request is answered as plain HTTP)."""
    uvicorn_log = logging.getLogger("uvicorn.error")  # the logger uvicorn's protocols warn on
    # caught by a handler of its own, whether or not an earlier uvicorn.Config stopped it propagating to the root,
    # where caplog's handler would catch each record a second time
    propagates, uvicorn_log.propagate = uvicorn_log.propagate, False
    uvicorn_log.addHandler(caplog.handler)
    try:
        logs.configure_logging("info")
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            uvicorn_log.warning("Unsupported upgrade request.")
            uvicorn_log.warning("No supported WebSocket library detected. Please use \"pip install "
                                "'uvicorn[standard]'\", or install 'websockets' or 'wsproto' manually.")
            uvicorn_log.warning("Invalid HTTP request received.")
        assert [record.getMessage() for record in caplog.records] == ["Invalid HTTP request received."]
    finally:
        uvicorn_log.removeFilter(logs._not_an_upgrade_warning)
        uvicorn_log.removeHandler(caplog.handler)
        uvicorn_log.propagate = propagates


def test_answered_probes_leave_no_access_line_and_requests_and_failed_probes_do(
        caplog: pytest.LogCaptureFixture) -> None:
    """A router asks each replica's /health and /metrics every second: two access lines a second at rest."""
    access_log = logging.getLogger("uvicorn.access")
    propagates, access_log.propagate = access_log.propagate, False
    access_log.addHandler(caplog.handler)
    try:
        logs.configure_logging("info")
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            for method, path, status in [("GET", "/health", 200), ("GET", "/metrics", 200), ("HEAD", "/health", 200),
                                         ("GET", "/health", 503), ("POST", "/v1/completions", 200),
                                         ("GET", "/health?verbose=1", 200)]:
                access_log.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", method, path, "1.1", status)
        assert [record.getMessage() for record in caplog.records] == [
            '127.0.0.1:5000 - "GET /health HTTP/1.1" 503', '127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200',
            '127.0.0.1:5000 - "GET /health?verbose=1 HTTP/1.1" 200']
    finally:
        access_log.removeFilter(logs._not_an_answered_probe)
        access_log.removeHandler(caplog.handler)
        access_log.propagate = propagates
