"""The listening socket of a server or router, and the URL it is reached at."""

from __future__ import annotations

import socket

MAX_PORT = 65535


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` for uvicorn to serve on: bound before anything says it listens, so that
    a port in use or a bad host is one ValueError naming them (the CLI prints it) instead of uvicorn's log line."""
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"--port must be in 0..{MAX_PORT}, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 host in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
