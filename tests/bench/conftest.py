"""The bench tests drive the same real ``kvserve serve`` process the server tests use."""

from tests.server.conftest import server, start_server, tiny_checkpoint  # noqa: F401  (fixtures)
