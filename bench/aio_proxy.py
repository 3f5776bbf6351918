"""`py_proxy.py` on aiohttp's server: the floor under a gateway whose front end is aiohttp's.

    python bench/aio_proxy.py LISTEN_PORT UPSTREAM_PORT

Does what `py_proxy.py` does (orjson reads the body, Seawall's upstream client sends it to
the same path on 127.0.0.1:UPSTREAM_PORT, the answer goes back from the upstream's socket
callback, the head with the first body bytes), but takes the request the way `seawall
serve` does: aiohttp's `AppRunner`, its request parser and `web.Request`, its router
(with the engine routes registered), a handler coroutine that awaits the body, and a
response that aiohttp prepares and ends after the head went out from the callback (as
`Relay.commit` and `_SentStream` do). Beside `py_proxy.py` it splits Seawall's own work
into what aiohttp's server costs and what Seawall's features cost (`bench_hop.py`).

No admission, no limits, no retries, no timeouts, no metrics, no error answers: it is not
a gateway. Loopback only.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import orjson
import uvloop
from aiohttp import web

from py_proxy import relay
from seawall.gateway.h1 import Endpoint, H1Pool
from seawall.protocol.routes import ROUTES


class _Sent(web.StreamResponse):
    """A response whose head the upstream's socket callback already wrote."""

    async def _write_headers(self) -> None:
        return


def _app(pool: H1Pool, upstream: Endpoint, models: bytes) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        orjson.loads(body)
        conn = await pool.request(
            upstream, request.path, {"Content-Type": "application/json"}, body
        )
        transport = request.transport
        assert transport is not None
        resp: web.StreamResponse = _Sent(status=200)
        resp.enable_chunked_encoding()
        if await relay(conn, transport):  # nothing came: the head goes out through aiohttp
            kind = conn.headers.get("content-type", "application/json")
            resp = web.StreamResponse(status=conn.status, headers={"Content-Type": kind})
        await resp.prepare(request)
        await resp.write_eof()
        conn.release()
        return resp

    async def get_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    for spec in ROUTES.values():
        app.router.add_post(spec.path, forward)
    app.router.add_get("/v1/models", get_models)
    app.router.add_route("*", "/{tail:.*}", ok)
    return app


def _models(upstream: int) -> bytes:
    """The upstream's `/v1/models` answer, read once: the one GET a load tool needs."""
    with urllib.request.urlopen(f"http://127.0.0.1:{upstream}/v1/models", timeout=10) as r:
        return bytes(r.read())


async def main(listen: int, upstream: int) -> None:
    pool = H1Pool()
    endpoint = Endpoint.parse(f"http://127.0.0.1:{upstream}")
    runner = web.AppRunner(_app(pool, endpoint, _models(upstream)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", listen).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
