"""A TCP proxy in front of a replica that counts the HTTP requests passing through it.

The sim counts completions (`vllm:request_success_total`) but not liveness probes or
scrapes; placed between the gateways and a sim, this counts every request line by
method and path as the sim receives it, so a test can measure exactly what the fleet
costs each replica. It forwards bytes both ways untouched (keep-alive connections and
all) and runs on its own event loop in a thread.

`hold(path)` makes requests for `path` wait in the proxy until `release()`: an engine
whose /metrics is slow to answer, as vLLM's can be under load, while everything else on
it answers at once.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

# A request line at the start of a request (HTTP/1.1, as aiohttp and the gateway send).
REQUEST_LINE = re.compile(rb"(GET|POST|PUT|DELETE|HEAD) (/[^ ?]*)[^ ]* HTTP/1\.[01]\r\n")


class CountingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._held: frozenset[str] = frozenset()  # swapped whole: read from the loop

    def hold(self, *paths: str) -> None:
        """Requests for these paths wait (their bytes are not forwarded) until `release`."""
        self._held = frozenset(paths)

    def release(self) -> None:
        self._held = frozenset()

    def counts(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self._counts)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: bool
    ) -> None:
        tail = b""
        try:
            while data := await reader.read(65536):
                if count:
                    window = tail + data
                    found = REQUEST_LINE.findall(window)
                    with self._lock:
                        for method, path in found:
                            self._counts[(method.decode(), path.decode())] += 1
                    while any(p.decode() in self._held for _, p in found):
                        await asyncio.sleep(0.01)
                    # Keep the end of an unfinished line for the next read (not a
                    # counted one: a match ends with its CRLF).
                    cut = window.rfind(b"\r\n")
                    tail = window[cut + 2 :][-256:] if cut >= 0 else window[-256:]
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pipe(reader, up_writer, count=True),
            self._pipe(up_reader, writer, count=False),
        )


@contextmanager
def counting_proxy(upstream_port: int) -> Iterator[CountingProxy]:
    proxy = CountingProxy(upstream_port)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, asyncio.AbstractServer] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
            holder["server"] = server
            proxy.port = server.sockets[0].getsockname()[1]

        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()
        holder["server"].close()
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    thread = threading.Thread(target=run, name="counting-proxy", daemon=True)
    thread.start()
    assert ready.wait(10), "the counting proxy did not start"
    try:
        yield proxy
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
