"""Probes against real `seawall sim` processes: what a dead, hung or plain server looks like."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from seawall.fleet import probes
from seawall.fleet.adapters import EngineKind, adapter_for
from seawall.fleet.view import EngineLoad
from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration


@pytest.fixture
def sim(artifacts: Path) -> Iterator[Proc]:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--model", "m", "--enable-faults"),
        artifacts / "sim.log",
        port,
    )
    wait_http(proc.url + "/health", proc=proc)
    yield proc
    proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def fault(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url + "/sim/fault", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_healthy_sim_passes_every_probe(sim: Proc, session: aiohttp.ClientSession) -> None:
    live = await probes.liveness(session, sim.url, timeout_s=2)
    assert live.ok and live.status == 200
    deep = await probes.deep_probe(session, sim.url, "m", timeout_s=5)
    assert deep.ok and deep.latency_s > 0
    load = await probes.scrape(session, sim.url, None, timeout_s=2)
    assert isinstance(load, EngineLoad)
    assert load.running == 0 and load.kv_usage is not None
    assert load.generation_tokens_total is not None and load.generation_tokens_total >= 1
    pinned = await probes.scrape(session, sim.url, adapter_for(EngineKind.VLLM), timeout_s=2)
    assert isinstance(pinned, EngineLoad) and pinned.generation_tokens_total is not None


async def test_dead_engine_fails_liveness_and_deep_probe(
    sim: Proc, session: aiohttp.ClientSession
) -> None:
    await fault(session, sim.url, {"kind": "engine_dead", "grace_s": 30})
    live = await probes.liveness(session, sim.url, timeout_s=2)
    assert (live.ok, live.error) == (False, "http_503")
    deep = await probes.deep_probe(session, sim.url, "m", timeout_s=5)
    assert (deep.ok, deep.error) == (False, "http_500"), deep.detail
    sim.stop()
    gone = await probes.liveness(session, sim.url, timeout_s=2)
    assert gone.refused
    scraped = await probes.scrape(session, sim.url, None, timeout_s=2)
    assert isinstance(scraped, probes.ScrapeError) and scraped.reason == "connect"


async def test_hung_engine_passes_liveness_but_fails_the_deep_probe(
    sim: Proc, session: aiohttp.ClientSession
) -> None:
    await fault(session, sim.url, {"kind": "hang", "running": "keep"})
    live = await probes.liveness(session, sim.url, timeout_s=2)
    assert live.ok  # /health cannot see a hang: this is why the deep probe exists
    deep = await probes.deep_probe(session, sim.url, "m", timeout_s=0.5)
    assert (deep.ok, deep.error) == (False, "timeout")
    assert deep.latency_s >= 0.5


@pytest.fixture
async def plain_server() -> AsyncIterator[str]:
    """An OpenAI-compatible server with no /metrics whose completions are empty."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        text = "" if body["model"] == "empty" else "x"
        tokens = 0 if body["model"] == "empty" else 1
        return web.json_response(
            {"choices": [{"index": 0, "text": text}], "usage": {"completion_tokens": tokens}}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_a_server_without_metrics_is_absent_not_failed(
    plain_server: str, session: aiohttp.ClientSession
) -> None:
    scraped = await probes.scrape(session, plain_server, None, timeout_s=2)
    assert isinstance(scraped, probes.ScrapeError)
    assert (scraped.reason, scraped.status) == ("absent", 404)
    assert (await probes.deep_probe(session, plain_server, "m", timeout_s=2)).ok


async def test_an_empty_completion_fails_the_deep_probe(
    plain_server: str, session: aiohttp.ClientSession
) -> None:
    deep = await probes.deep_probe(session, plain_server, "empty", timeout_s=2)
    assert (deep.ok, deep.error) == (False, "empty_output")
