"""The socket a server or router listens on, and the open-file limit it raises as it starts (a connection is a
file descriptor)."""

from __future__ import annotations

import os
import resource

import pytest

from kvserve.server.sockets import LISTEN_FD_ENV, MAX_OPEN_FILES, listening_socket, raise_open_file_limit, serving_socket


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


def test_a_second_server_on_the_port_is_refused_as_it_binds() -> None:
    """Both bound with SO_REUSEADDR, two servers started at once both bound the port until one listened: the
    other got uvicorn's traceback, not this error."""
    with listening_socket("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            listening_socket("127.0.0.1", port)


def test_a_replica_serves_on_the_socket_its_parent_made(monkeypatch) -> None:
    made = listening_socket("127.0.0.1", 0)
    monkeypatch.setenv(LISTEN_FD_ENV, str(made.fileno()))
    with serving_socket("127.0.0.1", 1) as served:  # the port of the flags is not bound again
        assert served.fileno() == made.fileno() and served.getsockname() == made.getsockname()
        assert LISTEN_FD_ENV not in os.environ  # not for the replica's own children
