"""A finished request leaves nothing for Python's cycle collector.

Objects freed by reference counting go the moment their request ends; objects caught in
a reference cycle wait for the cycle collector, whose pauses stop the whole event loop
(before this test, under 50 streams: 0.7 ms per young-generation pass, 2-4 ms per older
one; 13,000-15,000 objects found per 1,000 requests at 50-100 streams), so every stream
in flight stalls while it runs, and the more cycles each request leaves, the more often
it runs. So a request's own objects (its timeouts, its task, its response) must not form
cycles. An in-process gateway (so the test can see its heap) in front of a real `seawall
sim`; the client is a raw socket, so it adds no garbage of its own."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import types
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from seawall.config import parse_config
from seawall.gateway.app import Gateway
from tests.integration.test_gateway_first_token import CHAT, Exchange, until_ready
from tests.support.fleet import MODEL, running, set_fault, start_sim

pytestmark = pytest.mark.integration


def described(obj: object) -> str | None:
    """What `obj` is, when it belongs to the gateway's request path (None otherwise):
    Seawall's objects, and coroutines and tasks of Seawall's code or of aiohttp's server
    handler. Not aiohttp's client coroutines: the fleet monitor's probes are off the
    request path (what a dead replica's leave is tested below)."""
    kind = type(obj)
    if kind.__module__.startswith("seawall"):
        return f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(obj, asyncio.Task):
        code = getattr(obj.get_coro(), "cr_code", None)
        return f"task of {code.co_qualname}" if code is not None and ours(code) else None
    if isinstance(obj, types.CoroutineType):
        return f"coroutine {obj.cr_code.co_qualname}" if ours(obj.cr_code) else None
    if isinstance(obj, types.MethodType) and type(obj.__self__).__module__.startswith("seawall"):
        return f"bound method {obj.__func__.__qualname__}"
    return None


def ours(code: types.CodeType) -> bool:
    name = code.co_filename
    return "/seawall/" in name or name.endswith("aiohttp/web_protocol.py")


async def cyclic_garbage(send: Callable[[], Awaitable[None]], n: int = 20) -> Counter[str]:
    """What `n` requests made by `send` leave to the cycle collector, of the gateway's
    request path, after three to warm up (first-use caches, upstream connections)."""
    for _ in range(3):
        await send()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # the collector keeps what it finds
    try:
        for _ in range(n):
            await send()
        await asyncio.sleep(0.05)  # the server's side of closed connections
        gc.collect()
        return Counter(d for d in map(described, gc.garbage) if d is not None)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize(
    ("shape", "close"),
    [
        pytest.param({**CHAT}, False, id="stream"),
        pytest.param({**CHAT, "stream": False}, False, id="whole-answer"),
        pytest.param(
            {**CHAT, "stream_options": {"include_usage": True}}, False, id="stream-with-usage"
        ),
        pytest.param({**CHAT}, True, id="a-connection-per-stream"),
    ],
)
def test_requests_leave_no_cycles_for_the_collector(
    artifacts: Path, shape: dict, close: bool
) -> None:
    sim = start_sim(artifacts)
    with running(sim):

        async def main() -> Counter[str]:
            config = {"replicas": [{"url": sim.url, "model": MODEL}], "listen": {"port": 0}}
            gw = Gateway(parse_config(config), access_log=False)
            port = await gw.start()
            conn = Exchange(port)

            async def send() -> None:
                if close:
                    one = Exchange(port)
                    status, _headers, body = await one.post(shape, close=True)
                    assert await one.closed_by_server()
                    one.close()
                else:
                    status, _headers, body = await conn.post(shape)
                assert status == "HTTP/1.1 200 OK", body
                assert b"[DONE]" in body or json.loads(body)["choices"]

            try:
                await until_ready(port)
                return await cyclic_garbage(send)
            finally:
                conn.close()
                await gw.close()

        ours = asyncio.run(main())
    assert not ours, f"20 requests left to the cycle collector: {ours.most_common()}"


@pytest.mark.parametrize("engines", ["answer", "hang"])
def test_hedged_requests_leave_no_cycles_for_the_collector(artifacts: Path, engines: str) -> None:
    """Every request hedged at once (two replicas): the copy that loses the race is
    cancelled; when both engines hang, both copies time out before a first token."""
    sims = [start_sim(artifacts, name=f"sim{i}") for i in range(2)]
    with running(*sims):

        async def main() -> tuple[Counter[str], float]:
            config = {
                "replicas": [{"url": sim.url, "model": MODEL} for sim in sims],
                "listen": {"port": 0},
                "hedging": {"enabled": True, "delay_s": 0.001, "max_fleet_load": 1.0},
                "retry": {"budget_min_per_s": 1000.0},  # a hedge for every request
                "tiers": {"default": {"timeouts": {"ttft_s": 0.1}}},
            }
            gw = Gateway(parse_config(config), access_log=False)
            port = await gw.start()
            conn = Exchange(port)

            async def send() -> None:
                status, _headers, body = await conn.post(CHAT)
                if engines == "answer":
                    assert status == "HTTP/1.1 200 OK", body
                else:
                    assert json.loads(body)["error"]["message"], body

            try:
                await until_ready(port)
                if engines == "hang":  # once the fleet monitor has found them ready
                    for sim in sims:
                        set_fault(sim, {"kind": "hang"})
                ours = await cyclic_garbage(send)
                return ours, gw.metrics.hedges.labels("launched")._value.get()
            finally:
                conn.close()
                await gw.close()

        ours, hedged = asyncio.run(main())
    assert hedged >= 20  # the test raced copies
    assert not ours, f"20 hedged requests left to the cycle collector: {ours.most_common()}"


def test_a_dead_replica_leaves_no_cycles_for_the_collector() -> None:
    """A replica that is down is asked every second, for as long as it stays down, for
    its liveness, its scrape and its model list (and, if it was up, its deep probe), so
    what a failed call leaves to the cycle collector is left again every second, per
    dead replica, on the event loop every stream runs on. Before: about 80 objects a
    call, 3,264 in the second measured here (aiohttp's connection error keeps its
    traceback, whose frames hold the error, the request, its timer and its socket). An
    in-process gateway whose one replica is a loopback port that refuses connections,
    probed every 50 ms."""

    async def main() -> tuple[Counter[str], int]:
        with socket.socket() as s:  # a port nobody listens on: every connect is refused
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
        every = 0.05
        config = {
            "replicas": [{"id": "dead", "url": url, "model": MODEL}],
            "listen": {"port": 0},
            "fleet": {
                "liveness_interval_s": every,
                "scrape_interval_s": every,
                "deep_probe_interval_s": every,
                "deep_probe_idle_interval_s": every,
            },
        }
        gw = Gateway(parse_config(config), access_log=False)
        await gw.start()
        dead = gw.monitor._replicas["dead"]
        try:
            await asyncio.sleep(0.3)  # warm: first-use caches
            before = dead.signals.liveness_probes
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                await asyncio.sleep(1.0)
                gc.collect()
                probed = dead.signals.liveness_probes - before
                return Counter(type(o).__name__ for o in gc.garbage), probed
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
        finally:
            await gw.close()

    left, probed = asyncio.run(main())
    assert probed >= 5  # the replica was really probed (and refused every time)
    assert not left, f"{probed} failed probes and the rest left: {left.most_common(8)}"
