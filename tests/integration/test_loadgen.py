"""The load generator against servers on loopback: a scripted SSE server for each
outcome, and a real `seawall sim` when it is available."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from seawall.loadgen import RequestResult, run_load
from tests.support.procs import free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration


async def _scripted(request: web.Request) -> web.StreamResponse:
    """Behaviour chosen by the prompt's model name: ok, http500, cut, error, slow."""
    body = await request.json()
    mode = body["model"]
    if mode == "http500":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        chunk = {"choices": [{"text": f"t{i}"}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if mode == "cut" and i == 1:
            assert request.transport is not None
            request.transport.close()  # the replica died mid-stream
            return resp
        if mode == "slow":  # until the test ends, bounded in case it never does
            await asyncio.wait_for(request.app[RELEASE].wait(), 30)
    if mode == "error":
        await resp.write(b'data: {"error": {"message": "engine failed"}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    return resp


RELEASE = web.AppKey("release", asyncio.Event)


@pytest.fixture
async def scripted_url() -> AsyncIterator[str]:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/v1/completions", _scripted)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}"
    app[RELEASE].set()
    await runner.cleanup()


async def test_clean_streams_are_ok_and_the_count_bound_stops_the_run(scripted_url: str) -> None:
    seen: list[RequestResult] = []
    report = await run_load(
        scripted_url, "ok", concurrency=3, duration_s=30, max_requests=7, on_result=seen.append
    )
    assert (report.requests, report.ok) == (7, 7) and len(seen) == 7
    assert report.tokens == 21 and report.ttft_p50_s is not None


async def test_each_failure_is_classified_as_the_client_saw_it(scripted_url: str) -> None:
    reports = {
        mode: await run_load(scripted_url, mode, concurrency=1, duration_s=30, max_requests=2)
        for mode in ("http500", "cut", "error")
    }
    assert reports["http500"].failed == 2 and reports["http500"].statuses == {500: 2}
    assert reports["cut"].dropped == 2 and reports["cut"].ttft_p50_s is not None
    assert reports["error"].dropped == 2
    assert "error event: engine failed" in reports["error"].errors


async def test_nothing_listening_is_a_failed_request_not_a_hang() -> None:
    report = await run_load(
        f"http://127.0.0.1:{free_port()}", "m", concurrency=2, duration_s=30, max_requests=4
    )
    assert report.failed == 4 and report.statuses == {0: 4}


async def test_the_time_bound_stops_the_run_and_cuts_what_is_left(scripted_url: str) -> None:
    report = await run_load(
        scripted_url, "slow", concurrency=2, duration_s=0.2, max_requests=1000, grace_s=0.2
    )
    assert report.requests == 2 and report.cut == 2


async def test_a_stop_event_ends_the_run_early(scripted_url: str) -> None:
    stop = asyncio.Event()
    stop.set()
    report = await run_load(
        scripted_url, "ok", concurrency=2, duration_s=30, max_requests=1000, stop=stop
    )
    assert report.requests == 0


SIM_AVAILABLE = importlib.util.find_spec("seawall.sim.cli") is not None


@pytest.fixture
def sim(artifacts: Path) -> Iterator[str]:
    if not SIM_AVAILABLE:
        pytest.skip("seawall sim has not landed yet")
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--host", "127.0.0.1", "--port", str(port), "--model", "sim-model"),
        artifacts / "sim.log",
        port,
    )
    try:
        wait_http(f"{proc.url}/health", proc=proc)
        yield proc.url
    finally:
        proc.stop()


@pytest.mark.parametrize("chat", [False, True])
async def test_a_real_sim_streams_cleanly(sim: str, chat: bool) -> None:
    report = await run_load(
        sim, "sim-model", concurrency=2, duration_s=20, max_requests=6, max_tokens=8, chat=chat
    )
    assert (report.ok, report.failed, report.dropped) == (6, 0, 0), report
    assert report.tokens > 0 and report.ttft_p50_s is not None
