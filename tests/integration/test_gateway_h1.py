"""The gateway's own HTTP/1.1 client for its replicas (gateway/h1.py), against a real
`seawall sim` on loopback, and against small loopback servers that misbehave the way real
servers do (closing an idle keep-alive connection as a request arrives; answering with
bytes that are not HTTP): no `seawall sim` fault produces those at the socket level.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from seawall.gateway.h1 import IDLE_TTL_S, BrokenResponse, ConnectFailed, Endpoint, H1Pool
from seawall.gateway.outcomes import ATTEMPT_RULES, Attempt
from seawall.gateway.replicas import Replica
from seawall.gateway.upstream import AttemptFailed, open_attempt
from seawall.protocol.openai import parse
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

HEADERS = {"Content-Type": "application/json"}


def body(**fields: object) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "A seawall is", "max_tokens": 8, **fields})


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_sim(tmp_path_factory.mktemp("h1"), "--step-base-ms", "2")
    yield proc
    proc.stop()


@pytest.fixture
async def pool() -> AsyncIterator[H1Pool]:
    p = H1Pool(connect_timeout_s=2.0)
    yield p
    p.close()


async def test_a_response_read_to_its_end_leaves_the_connection_for_the_next(
    sim: Proc, pool: H1Pool
) -> None:
    ep = Endpoint.parse(sim.url)
    first = await pool.request(ep, "/v1/completions", HEADERS, body())
    assert first.status == 200
    text = orjson.loads(await first.read_all())["choices"][0]["text"]
    assert text
    first.release()
    assert pool.idle_count(ep) == 1

    # A streamed answer on the same connection, read to [DONE] and the end of the body.
    second = await pool.request(ep, "/v1/completions", HEADERS, body(stream=True))
    assert second is first and second.reused
    assert second.headers["content-type"].startswith("text/event-stream")
    streamed = await second.read_all()
    assert streamed.endswith(b"data: [DONE]\n\n")
    second.release()
    assert pool.idle_count(ep) == 1


async def test_a_stream_cut_short_closes_its_connection(sim: Proc, pool: H1Pool) -> None:
    ep = Endpoint.parse(sim.url)
    conn = await pool.request(ep, "/v1/completions", HEADERS, body(stream=True, max_tokens=500))
    assert await conn.read()  # the stream has started
    conn.release()  # not read to the end: the engine must see the disconnect
    assert pool.idle_count(ep) == 0
    again = await pool.request(ep, "/v1/completions", HEADERS, body())
    assert again is not conn and not again.reused
    assert orjson.loads(await again.read_all())["choices"]
    again.release()


async def test_an_idle_connection_is_not_reused_past_its_time_to_live(sim: Proc) -> None:
    """Engines close idle keep-alive connections (uvicorn after 5 s); the pool drops its
    own first, so a request does not go out on a connection about to be closed."""
    now = [1000.0]
    pool = H1Pool(now=lambda: now[0])
    ep = Endpoint.parse(sim.url)
    try:
        first = await pool.request(ep, "/v1/completions", HEADERS, body())
        await first.read_all()
        first.release()
        now[0] += IDLE_TTL_S - 0.1
        second = await pool.request(ep, "/v1/completions", HEADERS, body())
        assert second is first  # still fresh enough
        await second.read_all()
        second.release()
        now[0] += IDLE_TTL_S + 0.1
        third = await pool.request(ep, "/v1/completions", HEADERS, body())
        assert third is not first and not third.reused
        assert orjson.loads(await third.read_all())["choices"]
        third.release()
        assert first.transport is None or first.transport.is_closing()
    finally:
        pool.close()


async def test_upstream_errors_arrive_whole_with_their_headers(sim: Proc, pool: H1Pool) -> None:
    ep = Endpoint.parse(sim.url)
    conn = await pool.request(ep, "/v1/completions", HEADERS, b'{"model": "nope", "prompt": 1}')
    assert conn.status in (400, 404)
    error = orjson.loads(await conn.read_all())
    assert error["error"]["message"]
    assert conn.headers["content-type"].startswith("application/json")
    conn.release()


async def test_refused_connection_is_a_connect_failure(pool: H1Pool) -> None:
    with pytest.raises(ConnectFailed):
        await pool.request(Endpoint.parse(f"http://127.0.0.1:{free_port()}"), "/x", HEADERS, b"")


async def _serve(handler: object) -> tuple[asyncio.Server, Endpoint]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, Endpoint.parse(f"http://127.0.0.1:{port}")


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            await reader.readexactly(int(value))


async def test_idle_connection_closed_by_the_server_is_retried_on_a_fresh_one(
    pool: H1Pool,
) -> None:
    """A server may close an idle keep-alive connection just as a request goes out on it
    (uvicorn's keep-alive timeout). The request never reached it, so the pool sends it
    again on a new connection instead of failing it."""
    answered = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        await _read_request(reader)
        answered += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        try:
            await _read_request(reader)  # the next request on this connection: drop it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.transport.abort()

    server, ep = await _serve(handler)
    async with server:
        for _ in range(3):
            conn = await pool.request(ep, "/v1/completions", HEADERS, b"{}")
            assert await conn.read_all() == b"ok"
            conn.release()
        assert answered == 3


async def test_bytes_that_are_not_http_are_a_broken_response(pool: H1Pool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await reader.read()

    server, ep = await _serve(handler)
    async with server:
        with pytest.raises(BrokenResponse, match="invalid HTTP"):
            await pool.request(ep, "/v1/completions", HEADERS, b"{}")
        assert pool.idle_count(ep) == 0


async def test_a_connection_lost_mid_body_is_a_broken_response(pool: H1Pool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.transport.abort()

    server, ep = await _serve(handler)
    async with server:
        conn = await pool.request(ep, "/v1/completions", HEADERS, b"{}")
        with pytest.raises(BrokenResponse):
            await conn.read_all()
        conn.release()
        assert pool.idle_count(ep) == 0


def test_replica_urls_keep_their_path_prefix() -> None:
    ep = Endpoint.parse("https://engines.example:8443/team-a/")
    assert (ep.host, ep.port, ep.tls, ep.prefix) == ("engines.example", 8443, True, "/team-a")
    assert ep.host_header == "engines.example:8443"
    assert Endpoint.parse("http://127.0.0.1").port == 80
    v6 = Endpoint.parse("http://[::1]:8000")
    assert (v6.host, v6.port, v6.host_header) == ("::1", 8000, "[::1]:8000")
    with pytest.raises(ValueError, match="http"):
        Endpoint.parse("ftp://127.0.0.1")


async def test_a_replica_that_redirects_is_a_retryable_misconfiguration(pool: H1Pool) -> None:
    """A replica URL that answers with a redirect (http -> https, a moved path) is not
    followed: the attempt fails, may go to another replica, and says what to fix."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: https://engines.internal/v1/"
            b"completions\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()
        await reader.read()

    server, ep = await _serve(handler)
    async with server:
        replica = Replica("r0", f"http://{ep.host_header}", MODEL, "node-0")
        req = parse("completions", body(stream=True))
        with pytest.raises(AttemptFailed) as failed:
            await open_attempt(
                pool,
                replica,
                "/v1/completions",
                req,
                req.body_bytes(),
                "req-1",
                5.0,
                Attempt.ttft_timeout,
            )
        assert failed.value.outcome is Attempt.redirect
        assert ATTEMPT_RULES[Attempt.redirect].retryable
        assert "https://engines.internal/v1/completions" in failed.value.message


def test_the_gateway_keeps_upstream_connections_and_closes_cut_ones(artifacts: Path) -> None:
    """Through a running gateway: answers read to the end leave their connection to the
    replica for the next request (one connection for a run of sequential requests); a
    stream whose client leaves closes its connection (so the engine aborts), and the
    next request opens a fresh one."""
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])

    def opened() -> float:
        return metric_sum(scrape(gw.url), "seawall_upstream_connections_opened_total")

    with running(gw, sim), httpx.Client(timeout=30) as client:
        url = gw.url + "/v1/completions"
        for i in range(20):
            r = client.post(url, json=orjson.loads(body(stream=i % 2 == 0)))
            assert r.status_code == 200
        assert opened() == 1
        with client.stream("POST", url, json=orjson.loads(body(stream=True, max_tokens=2000))) as r:
            assert b"data: " in next(r.iter_raw())  # then leave mid-stream
        wait_until(
            lambda: metric_sum(scrape(sim.url), "vllm:num_requests_running") == 0,
            timeout=10,
            what="the engine to abort the abandoned stream",
        )
        assert client.post(url, json=orjson.loads(body())).status_code == 200
        assert opened() == 2


async def test_a_replica_on_an_ipv6_address(artifacts: Path, pool: H1Pool) -> None:
    port = free_port()
    argv = seawall_argv("sim", "--host", "::1", "--port", str(port), "--model", MODEL)
    sim = spawn(argv, artifacts / "sim-v6.log", port=port)
    with running(sim):
        url = f"http://[::1]:{port}"
        await asyncio.to_thread(wait_http, f"{url}/health", 20, sim)
        conn = await pool.request(Endpoint.parse(url), "/v1/completions", HEADERS, body())
        assert conn.status == 200
        assert orjson.loads(await conn.read_all())["choices"][0]["text"]
        conn.release()
