"""The listening socket of a server or router, the URL it is reached at, and the connections it may hold."""

from __future__ import annotations

import logging
import os
import resource
import socket

MAX_PORT = 65535
BACKLOG = 2048  # uvicorn's
LISTEN_FD_ENV = "KVSERVE_LISTEN_FD"  # a socket a data-parallel replica's parent bound and listens on for it
MAX_OPEN_FILES = 65535  # as vLLM and SGLang raise it: a connection is a file descriptor

# uvicorn's protocols for the server and the router: h11, which bounds a request's head (httptools, which uvicorn
# takes where it is installed, read 200 MiB of headers into memory before any check), its 400 in OpenAI's shape;
# no WebSocket (kvserve serves none; with the websockets package installed an upgrade got a bare 403)
UVICORN_PROTOCOLS = {"http": "kvserve.server.h11_protocol:JsonErrorH11Protocol", "ws": "none"}

logger = logging.getLogger(__name__)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` for uvicorn to serve on: made before anything says it listens, so
    that a port in use or a bad host is one ValueError naming them (the CLI prints it) instead of uvicorn's log
    line. Listening at once: two servers may both bind one port with SO_REUSEADDR until one listens."""
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"--port must be in 0..{MAX_PORT}, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


def serving_socket(host: str, port: int) -> socket.socket:
    """The socket a server serves on: the one its parent made for it (``$KVSERVE_LISTEN_FD``: a data-parallel
    replica's, made before any replica started, so that no other process could take its port meanwhile), else
    ``listening_socket(host, port)``."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)  # not for this server's own children
    return listening_socket(host, port) if fd is None else socket.socket(fileno=int(fd))


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 host in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to the hard one (at most ``MAX_OPEN_FILES``): at the usual
    1,024, a thousand idle connections, which need no API key to open, locked every client out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open-file limit from %d: %s", soft, error)
