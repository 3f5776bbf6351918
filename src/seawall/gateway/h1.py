"""The gateway's HTTP/1.1 client for its replicas: the hot path, written by hand.

With aiohttp's client, about half of the gateway's CPU per streamed request went into
moving chunks: each one passed its parser, a StreamReader, a future and a task wake-up
before the relay loop could write it out again. Here httptools parses the framing in
the socket callback, and once the first token has been relayed the body goes to a
*sink* (the proxy's relay) in that same call: no task switch per chunk. Before the first
token the connection is read through an awaitable `read()`, since that part must wait,
time out and be retried by a coroutine.

One keep-alive pool per replica address. A connection goes back to it only when its
response was read to the end and the server allowed keep-alive; anything else (a
cancellation, an error, a relay cut short) closes it, which is what tells the engine to
abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httptools
from yarl import URL

from seawall import clock

# Idle connections are dropped before uvicorn's default keep-alive (5 s, which vLLM uses)
# would close them under us; a reused connection that dies before answering is retried
# once on a fresh one anyway, since the server may close it just as the request is sent.
IDLE_TTL_S = 4.0
MAX_IDLE_PER_ENDPOINT = 256

# Bodies up to this size are sent in one write with the request head; larger ones (an
# audio upload) in a write of their own, so the upload is not copied to be forwarded.
_JOIN_MAX_BYTES = 64 * 1024

# The sink returns False to stop the relay (its stream has ended, or its client left).
Sink = Callable[[bytes], bool]


class ConnectFailed(ConnectionError):
    """No TCP (or TLS) connection to the replica."""


class BrokenResponse(ConnectionError):
    """The connection failed, or the server sent what is not HTTP, before the response ended."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool
    prefix: str  # the URL's path, without a trailing slash
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = URL(url)
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError(f"replica URL must be http:// or https:// with a host: {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        # The Host header: the default port omitted, an IPv6 address in brackets.
        host_header = u.host_port_subcomponent or u.host
        return cls(u.host, port, u.scheme == "https", u.path.rstrip("/"), host_header)


class H1Connection(asyncio.Protocol):
    """One connection, carrying one request at a time."""

    def __init__(self, pool: H1Pool, endpoint: Endpoint) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = pool
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        # One parser for the connection's life: llhttp takes responses one after another,
        # and a connection is reused only after its response ended.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._parts: list[bytes] = []  # body parsed from the current read
        self._buffer: list[bytes] = []  # body not yet taken (no sink)
        self._sink: Sink | None = None
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.head_done = False
        self.complete = False
        self.stopped = False  # the sink ended the relay
        self.paused = False  # reading paused until the client's socket drains
        self.error: BaseException | None = None
        self.received = 0  # bytes of this response so far
        self._until_close = False  # no length framing: the body ends with the connection

    # -- the caller's side -------------------------------------------------------------

    def send(self, data: bytes, body: bytes = b"") -> None:
        assert self.transport is not None
        self._reset()
        self.transport.write(data)
        if body:
            self.transport.write(body)

    async def wait_head(self) -> None:
        while not self.head_done:
            await self._wait()

    async def read(self) -> bytes:
        """Body bytes received so far (waiting for some), or b"" once the body has ended."""
        while not self._buffer:
            if self.complete:
                return b""
            await self._wait()
        buffered = self._buffer
        self._buffer = []
        return buffered[0] if len(buffered) == 1 else b"".join(buffered)

    async def read_all(self, limit: int | None = None) -> bytes:
        """The rest of the body; with `limit`, at most that many bytes are kept."""
        parts: list[bytes] = []
        kept = 0
        while chunk := await self.read():
            if limit is None or kept < limit:
                parts.append(chunk)
                kept += len(chunk)
        body = b"".join(parts)
        return body if limit is None else body[:limit]

    def relay(self, sink: Sink) -> None:
        """From now on hand each read's body to `sink`, in the socket callback. Whatever
        was received but not yet read goes through the sink first."""
        buffered, self._buffer = self._buffer, []
        self._sink = sink
        for chunk in buffered:
            self._deliver(chunk)

    def hand_back(self) -> None:
        """From the sink, in the socket callback: stop handing reads to it; what arrives
        from now on is kept for `read()` or the next `relay()`. Wakes `wait_sink`."""
        self._sink = None
        self._wake()

    async def wait_sink(self) -> None:
        """Until the sink hands back or stops, or the body ends."""
        while self._sink is not None and not (self.complete or self.stopped):
            await self._wait()

    def detach(self) -> None:
        """End the relay: whatever arrives from now on is dropped."""
        self._sink = None
        self.stopped = True

    async def wait_relay(self) -> None:
        """Until the relay needs its coroutine: the body ended, the sink stopped, or the
        client's socket is full (`paused`; call `resume()` once it has drained)."""
        while not (self.complete or self.stopped or self.paused):
            await self._wait()

    def pause(self) -> None:
        """Stop reading from the replica: the client cannot take more for now."""
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
            self._wake()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def release(self) -> None:
        """Done with this request: back to the pool if the connection can carry another."""
        self._sink = None
        self._buffer = []
        if (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.paused
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self._sink = None
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            return  # the connection is lost
        self.received += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(BrokenResponse(f"invalid HTTP from {self.endpoint.host_header}: {e}"))
            return
        parts = self._parts
        if parts:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            self._deliver(body)
        if self.complete:
            self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        # The parser holds this protocol's callbacks: a cycle that, left to the cycle
        # collector, kept each lost connection (and the request its sink belongs to).
        self._parser = None
        self._pool.forget(self)
        if self._until_close and self.head_done:
            self.complete = True
        if not self.complete and self.error is None:
            why = f": {exc}" if exc else ""
            self.error = BrokenResponse(
                f"{self.endpoint.host_header} closed the connection mid-response{why}"
            )
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called from its feed_data
        self.status = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        self._until_close = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "")
            and self.status not in (204, 304)
        )
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- internals ----------------------------------------------------------------------

    def _deliver(self, body: bytes) -> None:
        sink = self._sink
        if sink is None:
            if not self.stopped:
                self._buffer.append(body)
                self._wake()
            return
        try:
            more = sink(body)
        except Exception as e:  # surfaced to the relay's coroutine, never to the loop
            self._fail(e)
            return
        if not more:
            self._sink = None
            self.stopped = True
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        if self.transport is None:
            raise BrokenResponse(f"{self.endpoint.host_header}: connection closed")
        waiter = self._waiter = self._loop.create_future()
        await waiter
        if self.error is not None:
            raise self.error


class H1Pool:
    """Keep-alive connections to the replicas, by address."""

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        now: Callable[[], float] = clock.monotonic,
        on_connect: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self._idle: dict[Endpoint, list[H1Connection]] = {}
        self._connect_timeout_s = connect_timeout_s
        self._now = now  # for the idle TTL; tests pass their own time
        self._on_connect = on_connect  # each new connection (metrics)
        self._tls: ssl.SSLContext | None = None

    async def request(
        self, endpoint: Endpoint, path: str, headers: dict[str, str], body: bytes
    ) -> H1Connection:
        """POST `body` and return the connection once the response's head has arrived.
        The caller owns the connection: `release()` or `close()` it."""
        head = [f"POST {endpoint.prefix}{path} HTTP/1.1\r\nHost: {endpoint.host_header}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        data = "".join(head).encode("latin-1")
        if len(body) <= _JOIN_MAX_BYTES:
            data, body = data + body, b""  # one write for the usual small JSON body
        conn = self._take(endpoint)
        if conn is not None:
            try:
                return await self._exchange(conn, data, body)
            except BrokenResponse:
                if conn.received:
                    raise
                # Closed by the server while idle, as we sent: the request never arrived.
        return await self._exchange(await self._connect(endpoint), data, body)

    @staticmethod
    async def _exchange(conn: H1Connection, data: bytes, body: bytes) -> H1Connection:
        try:
            conn.send(data, body)
            await conn.wait_head()
        except BaseException:
            conn.close()
            raise
        return conn

    async def _connect(self, endpoint: Endpoint) -> H1Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if endpoint.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: H1Connection(self, endpoint), endpoint.host, endpoint.port, ssl=tls
                )
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"{endpoint.host_header}: {e or type(e).__name__}") from None
        if self._on_connect is not None:
            self._on_connect(endpoint)
        return conn

    def _take(self, endpoint: Endpoint) -> H1Connection | None:
        idle = self._idle.get(endpoint)
        now = self._now()
        while idle:
            conn = idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > IDLE_TTL_S:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def put(self, conn: H1Connection) -> None:
        idle = self._idle.setdefault(conn.endpoint, [])
        if len(idle) >= MAX_IDLE_PER_ENDPOINT:
            conn.close()
            return
        conn.idle_since = self._now()
        idle.append(conn)

    def forget(self, conn: H1Connection) -> None:
        idle = self._idle.get(conn.endpoint)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self, endpoint: Endpoint) -> int:
        return len(self._idle.get(endpoint, ()))

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
        self._idle.clear()
