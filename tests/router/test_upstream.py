"""router.upstream, the router's HTTP/1.1 client, against a raw socket server that answers with given bytes, cut
into given pieces: every framing (chunked, Content-Length, to the end of the connection), connection reuse, the
failures the router tells apart (refused: ConnectFailed; broken after the send: UpstreamLost; silent:
UpstreamTimeout), and a reused connection the replica closed unread (sent again on a new one)."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import time

import pytest

from kvserve.router.upstream import ConnectFailed, Origin, Upstream, UpstreamLost, UpstreamTimeout
from tests.server.conftest import free_port

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b"data: 1\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
CHUNKED = CHUNKED_HEAD + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\nx-trailer: t\r\n\r\n"


class ByteServer:
    """Answers each request on a connection with ``answer``, written in ``piece``-byte pieces (or in the pieces
    given as a list; none: it never answers) a millisecond apart, then closes the connection if ``close``;
    records each request's bytes and counts connections. With ``num_answers``, a connection's request after
    that many is read and answered with ``last`` only, then the connection closed (with a reset if ``reset``):
    a replica that closed a kept-alive connection the router had just written to; with ``die`` it also stops
    listening first (a replica killed with the request in its socket)."""

    def __init__(self, answer: bytes | list[bytes], piece: int = 1 << 20, close: bool = False,
                 num_answers: int | None = None, last: bytes = b"", reset: bool = False, die: bool = False) -> None:
        if isinstance(answer, bytes):
            answer = [answer[start : start + piece] for start in range(0, len(answer), piece)]
        self.pieces, self.close = answer, close
        self.num_answers, self.last, self.reset, self.die = num_answers, last, reset, die
        self.requests: list[bytes] = []
        self.num_connections = 0
        self.handlers: set[asyncio.Task] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Origin:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return Origin("http", "127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc_info: object) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self.handlers.add(asyncio.current_task())
        self.writers.append(writer)
        try:
            for num_answered in range(1 << 30):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"content-length: (\d+)", head).group(1))
                self.requests.append(head + await reader.readexactly(length))
                if num_answered == self.num_answers:
                    if self.die:
                        self.server.close()
                    writer.write(self.last)
                    await writer.drain()
                    if self.reset:  # SO_LINGER 0: the close sends a reset
                        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                   struct.pack("ii", 1, 0))
                    break
                for piece in self.pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001 if len(self.pieces) > 1 else 0)
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_a_chunked_answer_in_any_pieces_is_the_events_and_the_connection_is_reused(piece: int) -> None:
    server = ByteServer(CHUNKED, piece)

    async def scenario() -> list[tuple[int, str, bytes]]:
        upstream = Upstream()
        async with server as origin:
            answers = []
            for _ in range(2):
                response = await upstream.request(b"POST", origin, b"/v1/completions", b'{"a": 1}',
                                                  [(b"authorization", b"Bearer k")])
                answers.append((response.status, response.headers["content-type"], await response.read()))
            await upstream.aclose()
            return answers

    answers = run(scenario())
    assert answers == [(200, "text/event-stream", b"".join(EVENTS))] * 2
    assert server.num_connections == 1
    assert server.requests[0].endswith(b"\r\nauthorization: Bearer k\r\n\r\n{\"a\": 1}")
    assert re.match(rb"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:\d+\r\ncontent-length: 8\r\n",
                    server.requests[0]), server.requests[0]


def test_receive_hands_on_each_piece_as_it_arrives() -> None:
    """A stream is relayed, not collected: events that arrive apart come out of receive() apart."""
    first = len(CHUNKED_HEAD) + len(b"9;ext=1\r\ndata: 1\n\n\r\n")
    server = ByteServer([CHUNKED[:first], CHUNKED[first:]])  # the head and the first event, then the rest

    async def scenario() -> list[bytes]:
        upstream = Upstream()
        async with server as origin:
            response = await upstream.request(b"POST", origin, b"/", b"")
            parts = []
            while part := await response.receive():
                parts.append(part)
            return parts

    parts = run(scenario())
    assert parts == [EVENTS[0], b"".join(EVENTS[1:])]


def test_content_length_and_read_to_the_end_of_the_connection() -> None:
    sized = ByteServer(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\nContent-Type: application/json\r\n\r\n"
                       b"{\"a\"}", piece=3)
    unsized = ByteServer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end", piece=4, close=True)

    async def scenario() -> list[tuple[int, bytes, int]]:
        upstream = Upstream()
        answers = []
        for server in (sized, unsized):
            async with server as origin:
                response = await upstream.request(b"GET", origin, b"/x")
                answers.append((response.status, await response.read(), len(upstream._idle.get(origin, ()))))
        return answers

    assert run(scenario()) == [(404, b'{"a"}', 1), (200, b"to the end", 0)]  # the second not kept: it was closed


def test_an_idle_connection_older_than_max_idle_seconds_is_not_reused() -> None:
    server = ByteServer(CHUNKED)

    async def scenario() -> None:
        upstream = Upstream(max_idle_seconds=0.0)
        async with server as origin:
            for _ in range(2):
                await (await upstream.request(b"POST", origin, b"/", b"")).read()

    run(scenario())
    assert server.num_connections == 2


def test_failures_before_and_after_the_send_are_told_apart() -> None:
    async def scenario() -> None:
        upstream = Upstream(connect_timeout=2.0)
        with pytest.raises(ConnectFailed):  # nothing listens: the request was never sent
            await upstream.request(b"POST", Origin("http", "127.0.0.1", free_port()), b"/", b"")
        async with ByteServer(b"", close=True) as origin:  # takes the request, closes without an answer
            with pytest.raises(UpstreamLost):
                await upstream.request(b"POST", origin, b"/", b"")
        async with ByteServer(CHUNKED_HEAD + b"5\r\nabc", close=True) as origin:  # a chunk cut short
            response = await upstream.request(b"POST", origin, b"/", b"")
            with pytest.raises(UpstreamLost):
                await response.read()
        async with ByteServer(CHUNKED_HEAD + b"zz\r\n", close=True) as origin:  # not a chunk size
            response = await upstream.request(b"POST", origin, b"/", b"")
            with pytest.raises(UpstreamLost):
                await response.read()
        async with ByteServer(b"SSH-2.0-OpenSSH\r\n\r\n", close=True) as origin:  # not HTTP
            with pytest.raises(UpstreamLost):
                await upstream.request(b"POST", origin, b"/", b"")

    run(scenario())


def test_close_before_the_end_closes_the_connection_and_receive_then_ends() -> None:
    server = ByteServer(CHUNKED_HEAD + b"3\r\nabc\r\n")  # a stream that never ends

    async def scenario() -> tuple[bytes, bytes, int]:
        upstream = Upstream()
        async with server as origin:
            response = await upstream.request(b"POST", origin, b"/", b"")
            first = await response.receive()
            pending = asyncio.create_task(response.receive())
            await asyncio.sleep(0.05)
            response.close()  # as the router does when its client leaves
            return first, await asyncio.wait_for(pending, 5), len(upstream._idle.get(origin, ()))

    assert run(scenario()) == (b"abc", b"", 0)


@pytest.mark.parametrize("url, origin", [
    ("http://127.0.0.1:8001", Origin("http", "127.0.0.1", 8001)),
    ("https://replica.example", Origin("https", "replica.example", 443)),
    ("http://h/prefix", Origin("http", "h", 80)),
])
def test_origin_parse(url: str, origin: Origin) -> None:
    assert Origin.parse(url) == origin


def test_the_host_header_brackets_an_ipv6_address() -> None:
    assert Origin.parse("http://[::1]:8001").host_header == b"[::1]:8001"
    assert Origin.parse("http://127.0.0.1:8001").host_header == b"127.0.0.1:8001"


def test_a_url_without_a_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="http://HOST"):
        Origin.parse("localhost:8001")


JSON_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize("reset", [False, True])
def test_a_reused_connection_closed_before_any_answer_is_sent_again_on_a_new_one(reset: bool) -> None:
    """The replica closed a kept-alive connection (EOF or reset) that the request had just been written to,
    without a byte of answer: as HTTP clients do with stale connections, the request goes on a new one."""
    server = ByteServer(JSON_ANSWER, num_answers=1, reset=reset)

    async def scenario() -> list[tuple[int, bytes]]:
        upstream = Upstream()
        async with server as origin:
            answers = []
            for _ in range(2):
                response = await upstream.request(b"POST", origin, b"/", b"{}")
                answers.append((response.status, await response.read()))
            return answers

    assert run(scenario()) == [(200, b"{}")] * 2
    assert server.num_connections == 2 and len(server.requests) == 3  # the second request sent twice


def test_a_stale_connection_to_a_replica_gone_is_connect_failed() -> None:
    """The replica closed the reused connection unread and listens no more (it died): the request never
    started, so the router may send it to another replica."""
    server = ByteServer(JSON_ANSWER, num_answers=1)

    async def scenario() -> None:
        upstream = Upstream(connect_timeout=2.0)
        async with server as origin:
            await (await upstream.request(b"POST", origin, b"/", b"{}")).read()
            server.server.close()  # no new connections; the kept-alive one stays open
            with pytest.raises(ConnectFailed):
                await upstream.request(b"POST", origin, b"/", b"{}")

    run(scenario())


@pytest.mark.parametrize("reset", [False, True])
def test_a_new_connection_closed_unanswered_by_a_replica_that_died_is_connect_failed(reset: bool) -> None:
    """Right after a replica is killed, a new connection can still be taken (by its kernel), then reset: the
    replica is gone and runs nothing, so the request may go elsewhere. One that still listens may have run it."""
    async def scenario() -> None:
        upstream = Upstream(connect_timeout=2.0)
        async with ByteServer(JSON_ANSWER, num_answers=0, reset=reset, die=True) as origin:
            with pytest.raises(ConnectFailed):
                await upstream.request(b"POST", origin, b"/", b"{}")
        async with ByteServer(JSON_ANSWER, num_answers=0, reset=reset) as origin:
            with pytest.raises(UpstreamLost):
                await upstream.request(b"POST", origin, b"/", b"{}")

    run(scenario())


def test_a_reused_connection_cut_after_part_of_the_answer_is_lost_not_sent_again() -> None:
    """Once a byte of the answer came, the replica had the request: sending it again could run it twice."""
    server = ByteServer(JSON_ANSWER, num_answers=1, last=b"HTTP/1.1 200 OK\r\ncontent-")

    async def scenario() -> None:
        upstream = Upstream()
        async with server as origin:
            await (await upstream.request(b"POST", origin, b"/", b"{}")).read()
            with pytest.raises(UpstreamLost):
                await upstream.request(b"POST", origin, b"/", b"{}")

    run(scenario())
    assert server.num_connections == 1


def test_a_replica_that_sends_no_answer_is_given_up_on_after_the_timeout() -> None:
    server = ByteServer([])  # reads the request, never answers (a stopped or deadlocked replica)

    async def scenario() -> float:
        upstream = Upstream(response_timeout=0.2)
        async with server as origin:
            start = time.monotonic()
            with pytest.raises(UpstreamTimeout, match="sent no answer within 0.2 s"):
                await asyncio.wait_for(upstream.request(b"POST", origin, b"/", b"{}"), 5)
            return time.monotonic() - start

    assert 0.2 <= run(scenario()) < 5


def test_a_stream_that_goes_silent_is_given_up_on_after_the_timeout() -> None:
    server = ByteServer(CHUNKED_HEAD + b"3\r\nabc\r\n")  # one event, then nothing (the stream never ends)

    async def scenario() -> tuple[bytes, int]:
        upstream = Upstream(response_timeout=0.2)
        async with server as origin:
            response = await upstream.request(b"POST", origin, b"/", b"")
            first = await response.receive()
            with pytest.raises(UpstreamTimeout, match="sent nothing for 0.2 s"):
                await asyncio.wait_for(response.receive(), 5)
            return first, len(upstream._idle.get(origin, ()))

    assert run(scenario()) == (b"abc", 0)  # the connection closed, not pooled


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Upstream(response_timeout=0)


@pytest.mark.parametrize("answer, why", [
    (CHUNKED_HEAD + b"2\r\nabcdef\r\n0\r\n\r\n", "sent a bad chunk"),  # its surplus was read as a size: a hang
    (CHUNKED_HEAD + b"0x2\r\nab\r\n0\r\n\r\n", "sent a bad chunk"),  # int() took 0x, _ and a sign
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
     "a transfer coding the router cannot read: gzip, chunked"),  # read to the end of a kept-alive connection
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 4\r\n\r\n{}{}", "not one number: 2, 4"),
    (b"HTTP/1.1 999 Odd\r\ncontent-length: 2\r\n\r\n{}", "a status out of range"),  # the client got no answer
])
def test_an_answer_framed_as_the_router_cannot_read_is_lost_not_relayed_wrong(answer: bytes, why: str) -> None:
    """A replica (any server `--worker` names) whose answer's framing is malformed: the router relayed wrong bytes
    and then waited for `--upstream-timeout`, or left its client without an answer."""
    server = ByteServer(answer)

    async def scenario() -> None:
        async with server as origin:
            response = await Upstream().request(b"POST", origin, b"/", b"")
            await response.read()

    with pytest.raises(UpstreamLost, match=re.escape(why)):
        run(asyncio.wait_for(scenario(), 5))
