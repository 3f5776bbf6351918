"""The relay's fast path: after the first token, upstream bytes go straight to the client.

The plain relay loop costs, per streamed chunk, a future and a task switch on the
upstream side (`readany`) and four layers of writer on the client side; under 100
streams that machinery was about a third of the gateway's CPU (py-spy, bench/README).
Here the upstream response's body sink is swapped for a function that frames each
chunk for HTTP/1.1 chunked transfer and writes it to the client's transport at once,
from aiohttp's own parser callback: no await per chunk. The relaying task only waits
for the end (or a timeout, or the client leaving).

Used for byte-for-byte relays only (no event parsing: no usage to strip, no text to
track) and only when the client's response is chunked (HTTP/1.1). A slow client is
honoured: past `_HIGH_WATER` buffered bytes, upstream reading pauses until the client
has taken most of it.

It relies on two aiohttp behaviours, both covered by the gateway's tests: the client
response's body arrives through `StreamReader.feed_data`, and a broken upstream
connection is reported through `StreamReader.set_exception`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import StreamReader

from seawall import clock
from seawall.protocol.sse import ABORT_MARK, DONE_EVENT

_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
_TAIL = len(DONE_EVENT)


class DirectRelay:
    __slots__ = (
        "_content",
        "_done",
        "_on_chunk",
        "_paused",
        "_transport",
        "aborted",
        "error",
        "tail",
    )

    def __init__(
        self,
        content: StreamReader,
        transport: asyncio.Transport,
        on_chunk: Callable[[float], None],
        tail: bytes,
    ) -> None:
        self._content = content
        self._transport = transport
        self._on_chunk = on_chunk  # metrics and the idle timer, with the arrival time
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._paused = False
        self.tail = tail
        self.aborted = False
        self.error: BaseException | None = None

    def _feed(self, data: bytes, size: int = 0) -> bool:
        if not data:
            return False
        self._on_chunk(clock.monotonic())
        self.tail = (self.tail + data)[-_TAIL:]
        if ABORT_MARK in data:
            self.aborted = True
        transport = self._transport
        if not transport.is_closing():
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            if not self._paused and transport.get_write_buffer_size() > _HIGH_WATER:
                self._paused = True
                self._content._protocol.pause_reading()  # resumed in run()
                if not self._done.done():
                    self._done.set_result(None)  # wake run() to wait for the client
        return False

    def _eof(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def _exception(self, exc: BaseException, cause: Any = None) -> None:
        self.error = exc
        self._eof()

    async def run(self) -> str:
        """Relay until the upstream ends: "done", "upstream_closed" or "upstream_reset"."""
        content = self._content
        # Bytes aiohttp buffered before the switch go first, in order.
        buffered = content.read_nowait(-1)
        content.feed_data = self._feed  # type: ignore[method-assign]
        content.set_exception = self._exception  # type: ignore[method-assign,assignment]
        content.on_eof(self._eof)
        if buffered:
            self._feed(buffered)
        while True:
            await self._done
            if self._paused and self.error is None and not content.is_eof():
                # The client is slow: let it drain, then read on.
                while (
                    self._transport.get_write_buffer_size() > _LOW_WATER
                    and not self._transport.is_closing()
                ):
                    await asyncio.sleep(0.005)
                self._paused = False
                self._done = asyncio.get_running_loop().create_future()
                content._protocol.resume_reading()
                continue
            break
        if self.error is not None:
            return "upstream_reset"
        return "done" if self.tail.endswith(DONE_EVENT) else "upstream_closed"
