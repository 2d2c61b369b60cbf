"""What a replica's server process runs before kvserve: it dies with the process that started it."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """A ``preexec_fn``: SIGTERM this process when its parent ends however it ends, ``kill -9`` included (Linux;
    elsewhere nothing), so that no replica is left holding its port: not after the router, nor after the Ray
    actor that a restart then starts again on the same port."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
