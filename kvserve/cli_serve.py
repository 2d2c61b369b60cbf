"""The flags of ``kvserve serve``: the server's own, then every engine option.

Apart from ``server/launch.py``, which runs the server, so that defining them (and ``kvserve serve --help``)
imports neither FastAPI and uvicorn nor transformers and torch: ``cli.py`` imports ``server.launch`` only when
``serve`` runs.
"""

from __future__ import annotations

import argparse

from kvserve.engine_args import EngineArgs
from kvserve.logs import add_log_arguments
from kvserve.server.cors import add_cors_arguments
from kvserve.server.request_log import add_request_log_arguments
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES
from kvserve.server.tools import TOOL_CALL_PARSERS


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvserve serve``: the server's own, then every engine option (MODEL defaults to the packaged
    default model)."""
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients use in 'model' (default: MODEL as given)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize and /detokenize "
                             "(/health and /metrics stay open; default: $KVSERVE_API_KEY, which `ps` does not "
                             "show, else no key)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="answer 503 (Retry-After) while more requests than this wait (default: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies are answered 413 (default: %(default)s, 4 MiB)")
    add_log_arguments(parser)
    add_cors_arguments(parser)
    add_request_log_arguments(parser)
    parser.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                        help="the format of the model's own tool calls, read under tool_choice auto (auto: the one "
                             "the chat template uses; hermes where the template takes no tools; default: "
                             "%(default)s)")
    EngineArgs.add_cli_args(parser)
