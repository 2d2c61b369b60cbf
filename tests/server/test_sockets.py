"""The open-file limit a server or router raises as it starts (a connection is a file descriptor)."""

from __future__ import annotations

import resource

from kvserve.server.sockets import MAX_OPEN_FILES, raise_open_file_limit


def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    """At the usual soft limit of 1,024, a thousand idle connections (no key needed to open one) locked every
    client out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        raise_open_file_limit()
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised == (MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
