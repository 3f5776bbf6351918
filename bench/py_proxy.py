"""The least a Python HTTP proxy can do per streamed request: the floor under a Python gateway.

    python bench/py_proxy.py LISTEN_PORT UPSTREAM_PORT

Accepts on 127.0.0.1:LISTEN_PORT. Per POST: httptools parses it, orjson reads the body
(as any gateway must, to route and limit), Seawall's own upstream client (`gateway/h1.py`,
one keep-alive pool) sends it to the same path on 127.0.0.1:UPSTREAM_PORT, and the answer
goes back from the upstream's socket callback, the head with the first body bytes, each
read one HTTP chunk. GETs are answered here: `/v1/models` with the upstream's answer read
at start (load tools ask it for the model), anything else with an empty 200 (readiness
checks such as `/health`).

No admission, no limits, no retries, no timeouts, no metrics, no error answers: it is not
a gateway. Beside `tcp_relay.py` (no parsing at all) it splits a gateway's hop into what
one more process costs, what Python's HTTP handling costs on top, and what the gateway's
own features cost on top of that (`bench_hop.py`). Loopback only.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import httptools
import orjson
import uvloop

from seawall.gateway.h1 import Endpoint, H1Connection, H1Pool

_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class _Client(asyncio.Protocol):
    def __init__(self, pool: H1Pool, upstream: Endpoint, models: bytes) -> None:
        self.pool = pool
        self.upstream = upstream
        self.models = models
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's: not asyncio's class

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url.decode("ascii"), b""
        body, self.body = b"".join(self.body), []
        if self.parser.get_method() == b"GET":
            assert self.transport is not None
            answer = self.models if url.startswith("/v1/models") else _HEALTH
            self.transport.write(answer)
            return
        asyncio.get_running_loop().create_task(self.forward(url, body))

    async def forward(self, path: str, body: bytes) -> None:
        orjson.loads(body)
        conn = await self.pool.request(
            self.upstream, path, {"Content-Type": "application/json"}, body
        )
        client = self.transport
        assert client is not None
        unsent = await relay(conn, client)
        client.write(unsent + b"0\r\n\r\n")
        conn.release()


async def relay(conn: H1Connection, client: asyncio.Transport) -> bytes:
    """Write `conn`'s answer to `client` from the upstream's socket callback, each read
    one HTTP chunk, the head with the first body bytes; returns the head if no body came
    (the caller ends the response)."""
    kind = conn.headers.get("content-type", "application/json")
    head = [
        f"HTTP/1.1 {conn.status} OK\r\nContent-Type: {kind}\r\n"
        "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n".encode("latin-1")
    ]

    def sink(data: bytes) -> bool:
        out = b"%x\r\n%b\r\n" % (len(data), data)
        if head:
            out = head.pop() + out  # the head goes with the first body bytes
        client.write(out)
        return True

    conn.relay(sink)
    while not conn.complete:
        await conn.wait_relay()
    return head.pop() if head else b""


def _models(upstream: int) -> bytes:
    """The upstream's `/v1/models` answer, read once: the one GET a load tool needs."""
    with urllib.request.urlopen(f"http://127.0.0.1:{upstream}/v1/models", timeout=10) as r:
        body = r.read()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )


async def main(listen: int, upstream: int) -> None:
    pool = H1Pool()
    endpoint = Endpoint.parse(f"http://127.0.0.1:{upstream}")
    models = _models(upstream)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(pool, endpoint, models), "127.0.0.1", listen)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
