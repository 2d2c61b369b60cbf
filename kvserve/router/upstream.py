"""The router's HTTP/1.1 client to its replicas: keep-alive connections per replica, taken and put back in O(1).

The router sends a few kinds of request to a handful of replicas it knows, so this client does only that: the
request goes out in one write, the status line and headers are read at once, the body is handed on as it
arrives (chunked or ``Content-Length`` framing, every complete chunk in the buffer at once), and a connection
whose response was read to its end goes back to its replica's idle stack for the next request. httpx, which
did this before, spent about half of the router's CPU: its pool polled every connection's socket on each
request, and h11 parsed each chunk in Python.

    request(url, path, body)
      -> an idle connection (the most recent; stale ones closed) or a new one   ConnectFailed: nothing was sent
      -> write the request, read the head                                       UpstreamLost: sent, then broken
                                                                                UpstreamTimeout: no head in time
      -> UpstreamResponse: status, headers; receive() the body until b""        UpstreamLost if it breaks off,
                                                                                UpstreamTimeout if it stalls
      -> read to its end: back on the idle stack; close() before that: the connection is closed (an abort)

An idle connection is reused only within ``max_idle_seconds`` (below the 5 s after which uvicorn, which the
replicas run, closes an idle one). A replica can still close one the router has just written to (it died, or
it was stopped long enough for its keep-alive timer to run out): a reused connection that ends before a byte
of the answer came is taken for that, and the request goes again on a new connection, as HTTP clients do with
stale keep-alive connections (if that connect fails, ``ConnectFailed``: the router tries another replica). A new
connection that ends so is ``ConnectFailed`` too if the replica then refuses connections (it died: whatever it
had begun of the request died with it, and a generation has no effect but its answer, so the request may go
again elsewhere), else ``UpstreamLost`` (it lives, and may be running the request).

A replica that goes silent (stopped, deadlocked, swapping) is given up on after ``response_timeout`` seconds:
the longest wait for the head of its answer (a non-streamed answer's head comes when its generation is done,
so the bound must cover the longest generation: 600 s by default, generous as the request timeouts of other
routers are) and for each next piece of its body (a stream's next event, after a preempted request's wait too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

READ_SIZE = 1 << 16
MAX_HEAD_BYTES = 1 << 16
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk's size: hex digits alone (RFC 9112 section 7.1)
DEFAULT_RESPONSE_TIMEOUT_S = 600.0


class ConnectFailed(Exception):
    """No connection to the replica could be opened: the request was not sent."""


class UpstreamLost(Exception):
    """The connection broke (or the replica answered what is not HTTP/1.1) after the request was sent."""


class UpstreamTimeout(UpstreamLost):
    """The replica sent nothing for ``response_timeout`` seconds (no head, or no next body bytes); the connection
    was closed, which the replica takes as an abort."""


class _NothingReceived(Exception):
    """The connection ended (EOF or reset) before a byte of the answer came."""


@dataclass(frozen=True)
class Origin:
    """Where a replica listens, and the ``host`` header its requests carry."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a replica URL must be http://HOST[:PORT] or https://...; got {url!r}")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))

    @functools.cached_property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{host}:{self.port}".encode()


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def is_open(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Connections to the replicas, and requests over them. One per router, used from its event loop only."""

    def __init__(self, connect_timeout: float = 5.0, max_idle_seconds: float = 2.0,
                 max_idle_per_origin: int = 256, response_timeout: float = DEFAULT_RESPONSE_TIMEOUT_S) -> None:
        if response_timeout <= 0:
            raise ValueError(f"the upstream timeout must be > 0 seconds, got {response_timeout}")
        self.connect_timeout = connect_timeout
        self.max_idle_seconds = max_idle_seconds
        self.max_idle_per_origin = max_idle_per_origin
        self.response_timeout = response_timeout
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def request(self, method: bytes, origin: Origin, path: bytes, body: bytes = b"",
                      headers: list[tuple[bytes, bytes]] | tuple = ()) -> UpstreamResponse:
        """Send one request and read the head of its answer; the body is read from the response.

        A connection that ends before any byte of the answer: a reused one (the replica closed it unread) is
        replaced by a new one and the request sent again; on a new one, ``ConnectFailed`` if the replica now
        refuses connections (it died, and with it whatever it had begun: the request may go elsewhere), else
        ``UpstreamLost`` (it lives and may be running the request)."""
        message = _request_message(method, origin, path, body, headers)
        is_head = method == b"HEAD"
        reused = self._take(origin)
        if reused is not None:
            with contextlib.suppress(_NothingReceived):
                return await self._exchange(origin, reused, message, is_head)
        try:
            return await self._exchange(origin, await self._connect(origin), message, is_head)
        except _NothingReceived as error:
            # A replica killed mid-accept resets the connections its kernel took for it: refused once it is gone
            (await self._connect(origin)).close()
            raise UpstreamLost(f"{origin.host}:{origin.port} broke off before answering: {error}") from error

    async def _exchange(self, origin: Origin, connection: _Connection, message: bytes,
                        is_head: bool) -> UpstreamResponse:
        """Write the request and read the head of the answer; ``_NothingReceived`` if the connection ended
        before a byte of it came."""
        received = bytearray()
        try:
            async with asyncio.timeout(self.response_timeout):
                try:
                    connection.writer.write(message)
                    status, response_headers, head_end = await _read_head(connection.reader, received)
                except (OSError, EOFError, ValueError) as error:  # OSError: a socket's own TimeoutError too
                    connection.close()
                    if not received:
                        raise _NothingReceived(repr(error)) from error
                    why = (f"answered what is not HTTP/1.1 ({error})" if isinstance(error, ValueError) else
                           f"broke off before answering: {error!r}")
                    raise UpstreamLost(f"{origin.host}:{origin.port} {why}") from error
                except BaseException:  # cancelled (or timed out): the connection is mid-request, of no use
                    connection.close()
                    raise
        except TimeoutError:  # only the deadline's: the socket's own is an OSError caught above
            raise UpstreamTimeout(f"{origin.host}:{origin.port} sent no answer within "
                                  f"{self.response_timeout:g} s") from None
        del received[:head_end]  # what remains is the start of the body
        return UpstreamResponse(self, origin, connection, status, response_headers, is_head, received)

    async def get(self, url: str, timeout: float,
                  headers: list[tuple[bytes, bytes]] | tuple = ()) -> tuple[int, list[tuple[str, str]], bytes]:
        """A whole GET answer (status, ``header_list``, body), within ``timeout`` seconds (``UpstreamLost``
        after)."""
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

        async def get() -> tuple[int, list[tuple[str, str]], bytes]:
            response = await self.request(b"GET", Origin.parse(url), path.encode(), headers=headers)
            try:
                return response.status, response.header_list, await response.read()
            finally:
                response.close()

        try:
            return await asyncio.wait_for(get(), timeout)
        except asyncio.TimeoutError:
            raise UpstreamLost(f"{url} did not answer within {timeout} s") from None

    def prune(self) -> None:
        """Close the idle connections too old to reuse (the health loop calls this, so they do not linger)."""
        now = time.monotonic()
        for stack in self._idle.values():
            while stack and (now - stack[0].idle_since > self.max_idle_seconds or not stack[0].is_open()):
                stack.popleft().close()

    async def aclose(self) -> None:
        for stack in self._idle.values():
            while stack:
                stack.pop().close()

    def _take(self, origin: Origin) -> _Connection | None:
        """The most recently used idle connection; older ones are the first to go stale, so one found stale
        means every one below it is too."""
        stack = self._idle.get(origin)
        now = time.monotonic()
        while stack:
            connection = stack.pop()
            if now - connection.idle_since <= self.max_idle_seconds and connection.is_open():
                return connection
            connection.close()
            if now - connection.idle_since > self.max_idle_seconds:
                while stack:
                    stack.pop().close()
        return None

    def _put(self, origin: Origin, connection: _Connection) -> None:
        stack = self._idle.setdefault(origin, deque())
        if len(stack) >= self.max_idle_per_origin or not connection.is_open():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        stack.append(connection)

    async def _connect(self, origin: Origin) -> _Connection:
        context = None
        if origin.scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            context = self._ssl
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(origin.host, origin.port, ssl=context, limit=MAX_HEAD_BYTES),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as error:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {error!r}") from error
        return _Connection(reader, writer)


def _request_message(method: bytes, origin: Origin, path: bytes, body: bytes,
                     headers: list[tuple[bytes, bytes]] | tuple) -> bytes:
    lines = [method, b" ", path, b" HTTP/1.1\r\nhost: ", origin.host_header, b"\r\ncontent-length: ",
             b"%d" % len(body), b"\r\n"]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines += (b"\r\n", body)
    return b"".join(lines)


async def _read_head(reader: asyncio.StreamReader, buffer: bytearray) -> tuple[int, list[tuple[str, str]], int]:
    """The status and headers (lower-case names, in order) of the next final response, and where its head ends in
    ``buffer``; 1xx interim ones are skipped. What is read is appended to ``buffer`` and nothing is removed from
    it, so that after a failure an empty ``buffer`` says that not a byte of the answer came. EOFError if the
    connection ends first."""
    start = 0  # where the head being read begins (after any interim ones)
    while True:
        end = buffer.find(b"\r\n\r\n", start)
        if end < 0:
            if len(buffer) - start > MAX_HEAD_BYTES:
                raise ValueError(f"a response head over {MAX_HEAD_BYTES} bytes")
            data = await reader.read(READ_SIZE)
            if not data:
                raise EOFError("the connection closed")
            buffer += data
            continue
        status_line, *lines = buffer[start:end].decode("latin-1").split("\r\n")
        version, status_text = status_line.split(" ", 2)[:2]
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {status_line!r}")
        status, start = int(status_text), end + 4
        if not 100 <= status <= 599:  # the router's own server has no words for it, and answered nothing
            raise ValueError(f"a status out of range: {status_line!r}")
        if not 100 <= status < 200:
            break
    headers = []
    for line in lines:
        name, _, value = line.partition(":")
        headers.append((name.strip().lower(), value.strip()))
    _check_framing(headers)
    return status, headers, start


def _check_framing(headers: list[tuple[str, str]]) -> None:
    """ValueError for an answer whose body's end the router cannot place for certain: a transfer coding other than
    chunked alone (its body was read to the end of a kept-alive connection: the client waited for the timeout), or
    Content-Length values that are not one plain number (the last of two was taken)."""
    codings = [value.lower() for name, value in headers if name == "transfer-encoding"]
    if codings and codings != ["chunked"]:
        raise ValueError(f"a transfer coding the router cannot read: {', '.join(codings)}")
    lengths = {value for name, value in headers if name == "content-length"}
    if len(lengths) > 1 or not all(value.isascii() and value.isdigit() for value in lengths):
        raise ValueError(f"a content-length that is not one number: {', '.join(sorted(lengths))}")


class UpstreamResponse:
    """One replica answer: ``status`` and its headers at once (``header_list`` as they came, names lower-case;
    ``headers`` by name, the last of a repeated one), the body by ``receive()`` as it comes.

    Read to its end, the connection goes back to the pool; ``close()`` before that closes it, which the
    replica sees as the client leaving (kvserve aborts the request). ``close()`` after the end does nothing.
    """

    def __init__(self, upstream: Upstream, origin: Origin, connection: _Connection, status: int,
                 header_list: list[tuple[str, str]], is_head: bool, buffer: bytearray) -> None:
        self.status = status
        self.header_list = header_list
        self.headers = dict(header_list)
        self._upstream = upstream
        self._origin = origin
        self._connection: _Connection | None = connection
        self._buffer = buffer  # body bytes read and not yet handed on
        self._closed = False
        self._reusable = self.headers.get("connection", "").lower() != "close"
        if is_head or status in (204, 304):
            self._remaining: int | None = 0
        elif self.headers.get("transfer-encoding", "").lower() == "chunked":
            self._remaining = None
        elif "content-length" in self.headers:
            self._remaining = int(self.headers["content-length"])
        else:  # the body runs to the end of the connection
            self._remaining, self._reusable = -1, False
        if self._remaining == 0:
            self._finish()

    async def receive(self) -> bytes:
        """The body bytes that have arrived since the last call (waiting for some), or b"" at its end;
        ``UpstreamTimeout`` once the replica has sent nothing for ``response_timeout`` seconds."""
        while self._connection is not None:
            if self._remaining is not None:
                chunk = self._take_length()
            else:
                try:
                    chunk = self._take_chunks()
                except ValueError as error:  # a chunk's size no hex number, or its data longer than that
                    self.close()
                    raise UpstreamLost(f"{self._origin.host}:{self._origin.port} sent a bad chunk") from error
            if chunk or self._connection is None:
                return chunk
            data, lost = await self._read_some(self._connection)
            if not data:
                if self._remaining == -1 and lost is None:
                    self._finish()
                    return b""
                if self._closed:  # close() while a receive() waited: the caller asked for the end
                    return b""
                self.close()
                why = f" ({lost!r})" if lost is not None else ""  # None: the replica closed the connection
                raise UpstreamLost(f"{self._origin.host}:{self._origin.port} broke off the answer{why}")
            self._buffer += data
        return b""

    async def _read_some(self, connection: _Connection) -> tuple[bytes, OSError | None]:
        """The next bytes from the replica: b"" at the end of the connection, with the error that ended it if
        one did; ``UpstreamTimeout`` (the connection closed) after ``response_timeout`` seconds of silence."""
        try:
            async with asyncio.timeout(self._upstream.response_timeout):
                try:
                    return await connection.reader.read(READ_SIZE), None
                except OSError as error:  # a socket's own TimeoutError too: a broken connection, not silence
                    return b"", error
        except TimeoutError:
            self.close()
            raise UpstreamTimeout(f"{self._origin.host}:{self._origin.port} sent nothing for "
                                  f"{self._upstream.response_timeout:g} s") from None

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.receive():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Close the connection unless the body was read to its end (then it is back in the pool)."""
        self._closed = True
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if self._reusable and not self._buffer and connection is not None:
            self._upstream._put(self._origin, connection)
        elif connection is not None:
            connection.close()

    def _take_length(self) -> bytes:
        if self._remaining == -1:  # to the end of the connection
            chunk = bytes(self._buffer)
        else:
            chunk = bytes(self._buffer[: self._remaining])
            self._remaining -= len(chunk)
        del self._buffer[: len(chunk)]
        if self._remaining == 0:
            self._finish()
        return chunk

    def _take_chunks(self) -> bytes:
        """Every complete chunk in the buffer, joined; the terminating chunk finishes the response.

            buffer:  SIZE-HEX[;ext] CRLF  DATA  CRLF   ...   0 CRLF [trailers] CRLF
        """
        buffer, pos, parts = self._buffer, 0, []
        while (eol := buffer.find(b"\r\n", pos)) >= 0:
            size_field = bytes(buffer[pos:eol].split(b";", 1)[0].rstrip(b" \t"))
            if not CHUNK_SIZE.fullmatch(size_field):  # int() took "0x10", "1_0", "-1"
                raise ValueError(f"a chunk size that is no hex number: {size_field[:20]!r}")
            size = int(size_field, 16)
            if size == 0:
                end = buffer.find(b"\r\n\r\n", eol)
                if end < 0:
                    break
                del buffer[: end + 4]
                chunk = b"".join(parts)
                self._finish()
                return chunk
            if len(buffer) < eol + 4 + size:
                break
            if buffer[eol + 2 + size : eol + 4 + size] != b"\r\n":  # read on, its surplus was a next chunk's size
                raise ValueError(f"a chunk longer than its size ({size} bytes)")
            parts.append(buffer[eol + 2 : eol + 2 + size])
            pos = eol + 4 + size
        del buffer[:pos]
        return b"".join(parts)
