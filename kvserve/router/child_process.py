"""A replica's server process: its command, and what it runs before kvserve: it dies with the process that
started it."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def serve_command(argv: list[str], *flags: str) -> list[str]:
    """``kvserve ARGV`` (``serve ...``) with the replica's own ``flags`` (its port, its host) right after the
    subcommand, where no ``--`` among the user's words (``--served-model-name a b -- MODEL``) makes them
    positional."""
    return [sys.executable, "-m", "kvserve.cli", argv[0], *flags, *argv[1:]]


def die_with_parent() -> None:
    """A ``preexec_fn``: SIGTERM this process when its parent ends however it ends, ``kill -9`` included (Linux;
    elsewhere nothing), so that no replica is left holding its port: not after the router, nor after the Ray
    actor that a restart then starts again on the same port."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
