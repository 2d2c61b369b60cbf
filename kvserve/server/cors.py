"""Cross-origin requests (CORS): which web pages' scripts may call a server or the router, with vLLM's flags and
defaults (any origin, method and header, no credentials), so that a browser client that works against vLLM works
here. The answer to a browser's preflight comes before the request guard: a preflight never carries the API key,
and the request that follows it does.

Defining the flags imports nothing beyond the standard library (``kvserve serve --help`` stays light).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

ANY = ("*",)


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ANY
    allowed_methods: tuple[str, ...] = ANY
    allowed_headers: tuple[str, ...] = ANY
    allow_credentials: bool = False

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> CorsPolicy:
        return cls(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                   args.allow_credentials)

    def middleware_options(self) -> dict[str, Any]:
        """Starlette's ``CORSMiddleware`` options for this policy."""
        return {"allow_origins": self.allowed_origins, "allow_methods": self.allowed_methods,
                "allow_headers": self.allowed_headers, "allow_credentials": self.allow_credentials}


def add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's four CORS flags, each list a JSON array of strings as vLLM takes it."""
    for flag, what in (("--allowed-origins", "origins (e.g. '[\"https://chat.example.com\"]')"),
                       ("--allowed-methods", "methods"), ("--allowed-headers", "request headers")):
        parser.add_argument(flag, type=_json_strings, default=list(ANY), metavar="JSON",
                            help=f"the {what} a web page's scripts may use, a JSON array (default: [\"*\"], any)")
    parser.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                        help="let cross-origin requests carry cookies and HTTP authentication (default: off)")


def _json_strings(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON array of strings, got {text!r}")
    return value
