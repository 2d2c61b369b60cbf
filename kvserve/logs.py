"""How kvserve's processes log: one format for kvserve's loggers and uvicorn's (its access log included), with
the time, and the process id, since a deployment's replicas write to one stream; at the level ``--log-level`` sets;
uvicorn's warnings for a connection upgrade kvserve does not serve dropped, and so are the access lines of probes
answered 200 (``/health``, ``/metrics``): a router asks each replica both every second, 34 MB of log a day at rest.

Imports nothing but the standard library: ``kvserve serve --help`` and the router define their flags from it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
# uvicorn's two warnings for every request that asks to upgrade its connection: kvserve serves no WebSocket on
# purpose (``server/sockets.py``), the request is answered as plain HTTP, and the advice to install a WebSocket
# library is wrong here; two headers from any client, no key needed, wrote two lines a request
UPGRADE_WARNINGS = ("Unsupported upgrade request.", "No supported WebSocket library detected.")
PROBE_PATHS = ("/health", "/metrics")


def add_log_arguments(parser: argparse.ArgumentParser, access_log: bool = True) -> None:
    """``--log-level``, and with ``access_log`` vLLM's ``--disable-uvicorn-access-log`` (a router polls each
    replica's /health and /metrics every second: two access lines a second with no traffic)."""
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="kvserve's and uvicorn's logs (default: %(default)s)")
    if access_log:
        parser.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                            help="no line for each HTTP request (kvserve's own INFO lines stay; default: off)")


def configure_logging(level: str) -> None:
    """kvserve's loggers, and uvicorn's (``uvicorn_logging`` leaves them to propagate here), at ``level``; uvicorn's
    ``UPGRADE_WARNINGS`` dropped."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    logging.getLogger("uvicorn.error").addFilter(_not_an_upgrade_warning)
    logging.getLogger("uvicorn.access").addFilter(_not_an_answered_probe)


def _not_an_upgrade_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(UPGRADE_WARNINGS)


def _not_an_answered_probe(record: logging.LogRecord) -> bool:
    """uvicorn's access line (its arguments: client, method, path, HTTP version, status) unless it is a probe
    answered 200; a probe that failed is kept."""
    args = record.args
    if not isinstance(args, tuple) or len(args) != 5:
        return True
    _, method, path, _, status = args
    return not (method in ("GET", "HEAD") and path in PROBE_PATHS and status == 200)


def uvicorn_logging(level: str, access_log: bool = True) -> dict[str, Any]:
    """``uvicorn.Config``'s logging options: its loggers configured by ``configure_logging``, not its own."""
    return {"log_config": None, "log_level": level, "access_log": access_log}
