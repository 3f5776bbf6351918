"""A TCP relay on loopback that cuts what a server sends into small pieces.

Real networks deliver a server's writes in whatever segments they like: an SSE event can
arrive split across two socket reads at any byte. An engine on loopback almost never
shows that, so tests that need it put this relay between the gateway and a real `seawall
sim`: every chunk the server sends reaches the client as `piece` bytes per write, with a
short pause between writes so that each piece is its own read on the other side. It is
a network condition, not a stand-in for the engine: the bytes are the engine's own.

It also keeps what the client sent (`sent`), so a test can read the request headers a
real engine received (a `traceparent`, say) without the engine having to log them.

With `delay_s` it also stands in for a WAN: every chunk, in both directions, arrives
`delay_s` after it was sent (order kept), so a pool of sims behind it is a remote region
on loopback. `piece=None` forwards chunks whole.

The answer to a `GET /metrics` goes through whole: the fleet monitor's scrape of a vLLM
page (tens of kilobytes) in pieces this small would take seconds, longer than its scrape
timeout, and admission waits for a replica's first scrape. What the tests cut is what
the request path reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from tests.support.counting_proxy import REQUEST_LINE


class _Conn:
    """One relayed connection: whether the answer now coming back is a /metrics page.
    HTTP/1.1 answers in request order, and the gateway's clients send one request at a
    time on a connection, so the last request line seen is the one being answered."""

    whole = False

    def saw(self, data: bytes) -> None:
        for _, path in REQUEST_LINE.findall(data):
            self.whole = path == b"/metrics"


class ChoppingRelay:
    def __init__(
        self,
        target_port: int,
        piece: int | None = 8,
        pause_s: float = 0.0005,
        delay_s: float = 0.0,
    ) -> None:
        self.target_port = target_port
        self.piece = piece
        self.pause_s = pause_s
        self.delay_s = delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.sent = bytearray()  # every byte clients sent through the relay

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ChoppingRelay:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = fut.result(timeout=5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, s_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn()
        up = asyncio.ensure_future(self._pipe(c_reader, s_writer, chop=False, conn=conn))
        down = asyncio.ensure_future(self._pipe(s_reader, c_writer, chop=True, conn=conn))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (c_writer, s_writer):
            w.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chop: bool, conn: _Conn
    ) -> None:
        if self.delay_s > 0:
            await self._delayed(reader, writer, chop, conn)
            return
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not chop:
                    conn.saw(data)
                    self.sent += data
                    writer.write(data)
                    await writer.drain()
                    continue
                await self._write(writer, data, conn)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, conn: _Conn) -> None:
        if self.piece is None or conn.whole:
            writer.write(data)
            await writer.drain()
            return
        for i in range(0, len(data), self.piece):
            writer.write(data[i : i + self.piece])
            await writer.drain()
            await asyncio.sleep(self.pause_s)

    async def _delayed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chop: bool, conn: _Conn
    ) -> None:
        """Forward each chunk `delay_s` after it arrived, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, due - loop.time()))
                if chop:
                    await self._write(writer, data, conn)
                else:
                    writer.write(data)
                    await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    if not chop:
                        conn.saw(data)
                        self.sent += data
                    queue.put_nowait((loop.time() + self.delay_s, data))
            queue.put_nowait((loop.time() + self.delay_s, b""))
            with contextlib.suppress(ConnectionError):
                await sender
        finally:
            sender.cancel()
