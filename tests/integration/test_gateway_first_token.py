"""A stream's head and first token, written from the upstream's socket callback.

The gateway writes the response's head and the first token to the client the moment the
token arrives (`relay.Relay.commit`), without aiohttp, for a stream relayed as the engine
wrote it and for one read event by event (a tier with migration or a token rate), whose
head is filtered first; an HTTP/1.0 client's stream, or a head that holds the usage or
the end, is written through aiohttp. A client must not be able to tell the two apart:
same status, same headers, valid chunked framing, keep-alive kept or closed as asked.
And a drain cut that lands between that write and the relay taking the stream over
must end the stream the way every cut stream ends, not answer a second time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from seawall.config import parse_config
from seawall.gateway.app import Gateway
from seawall.gateway.context import RequestCtx
from seawall.gateway.upstream import Commit, CommitFor
from tests.support.fleet import MODEL, running, start_gateway, start_sim

pytestmark = pytest.mark.integration

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about sea walls."}],
    "max_tokens": 6,
    "ignore_eos": True,
    "stream": True,
}


class Exchange:
    """One kept-alive HTTP/1.1 connection, read byte by byte as a client parses it
    (a chunked body strictly)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, body: dict[str, Any], close: bool = False) -> tuple[str, dict, bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        data = json.dumps(body).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
        )
        status = (await reader.readuntil(b"\r\n")).decode().strip()
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode().partition(":")
            assert name.lower() not in headers, f"{name} sent twice"
            headers[name.lower()] = value.strip()
        if "content-length" in headers:  # a whole answer
            return status, headers, await reader.readexactly(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked", headers
        body_out = b""
        while True:  # chunked framing, strictly
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            assert chunk.endswith(b"\r\n"), chunk
            if size == 0:
                break
            body_out += chunk[:-2]
        return status, headers, body_out

    async def closed_by_server(self) -> bool:
        assert self.streams is not None
        return await asyncio.wait_for(self.streams[0].read(1), 5) == b""

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()


async def until_ready(port: int) -> None:
    """Until an in-process gateway's fleet monitor has found its replica."""
    async with aiohttp.ClientSession() as s:
        for _ in range(500):
            async with s.get(f"http://127.0.0.1:{port}/readyz?fleet=1") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.02)
    raise TimeoutError(f"the gateway on port {port} found no usable replica")


def events(body: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


def test_a_stream_reads_the_same_whichever_path_wrote_its_head(artifacts: Path) -> None:
    """The head written from the socket callback (a `seawall serve` process) against the
    head aiohttp writes (an in-process gateway whose relay is given no `commit`, as for an
    HTTP/1.0 client or a head that holds the usage)."""
    sim = start_sim(artifacts)
    with running(sim):
        raw = start_gateway(artifacts, [sim], name="raw")  # the head from the callback
        with running(raw):

            async def drive(port: int) -> tuple[list[tuple[str, dict, bytes]], bool]:
                conn = Exchange(port)
                try:
                    got = [await conn.post(CHAT), await conn.post(CHAT)]  # kept alive
                    got.append(await conn.post(CHAT, close=True))
                    return got, await conn.closed_by_server()
                finally:
                    conn.close()

            async def both() -> list[tuple[list[tuple[str, dict, bytes]], bool]]:
                config = {"replicas": [{"url": sim.url, "model": MODEL}], "listen": {"port": 0}}
                gw = Gateway(parse_config(config), access_log=False)
                port = await gw.start()
                gw.proxy.relay.commit = lambda request, ctx: None  # type: ignore[method-assign]
                try:
                    await until_ready(port)
                    return [await drive(raw.port or 0), await drive(port)]
                finally:
                    await gw.close()

            (raw_got, raw_closed), (aio_got, aio_closed) = asyncio.run(both())

    assert raw_closed and aio_closed  # `Connection: close` honoured on both paths
    for (r_status, r_headers, r_body), (p_status, p_headers, p_body) in zip(
        raw_got, aio_got, strict=True
    ):
        assert r_status == p_status == "HTTP/1.1 200 OK"
        # Same headers, same values, but for the per-response ones.
        assert r_headers.keys() == p_headers.keys(), (r_headers, p_headers)
        for name in r_headers.keys() - {"date", "x-request-id"}:
            assert r_headers[name] == p_headers[name], name
        assert r_headers["content-type"].startswith("text/event-stream")
        assert r_headers["cache-control"] == "no-cache"
        assert r_headers["transfer-encoding"] == "chunked"
        for body in (r_body, p_body):
            evs = events(body)
            assert evs[-1] == "[DONE]"
            text = "".join(
                c["delta"].get("content") or "" for e in evs[:-1] for c in json.loads(e)["choices"]
            )
            assert text, body  # a whole answer, its first token included
    assert raw_got[2][1]["connection"] == aio_got[2][1]["connection"] == "close"
    assert "connection" not in raw_got[0][1]  # HTTP/1.1 keep-alive: no header, as aiohttp


def test_a_drain_cut_between_the_first_token_and_the_relay_ends_the_stream(
    artifacts: Path,
) -> None:
    """The cut is made from inside the commit, right after the head went out: the same
    turn of the loop as the socket callback, before the attempt's coroutine runs again.
    (An in-process gateway, so the test can place the cut there; the engine is a real
    `seawall sim`.) The client must read a 200 stream that ends with the draining error
    and `[DONE]` in valid chunked framing, not a 503 written after the stream's head."""
    sim = start_sim(artifacts)
    with running(sim):

        async def main() -> tuple[int, bytes, float]:
            config = {"replicas": [{"url": sim.url, "model": MODEL}], "listen": {"port": 0}}
            gw = Gateway(parse_config(config), access_log=False)
            port = await gw.start()
            relay = gw.proxy.relay
            real = relay.commit

            def commit_then_cut(request: aiohttp.web.Request, ctx: RequestCtx) -> CommitFor | None:
                inner = real(request, ctx)
                assert inner is not None  # a plain stream: the callback path

                def commit_for(strip: frozenset[str]) -> Commit:
                    commit = inner(strip)

                    def then_cut(headers: Any, events: Any, pending: bytes) -> bool:
                        written = commit(headers, events, pending)
                        assert ctx.ticket is not None
                        ctx.ticket.cut("drain deadline")
                        return written

                    return then_cut

                return commit_for

            relay.commit = commit_then_cut  # type: ignore[method-assign]
            try:
                await until_ready(port)
                async with aiohttp.ClientSession() as s:
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    async with s.post(url, json=CHAT) as r:
                        body = await r.read()  # raises on broken chunked framing
                        status = r.status
                cut = gw.metrics.stream_errors.labels("gateway_draining")._value.get()
                return status, body, cut
            finally:
                await gw.close()

        status, body, cut = asyncio.run(main())
    evs = events(body)
    assert status == 200
    assert evs[-1] == "[DONE]"
    error = json.loads(evs[-2])["error"]
    assert error["code"] == "gateway_draining", error
    assert cut == 1


def test_an_unhandled_error_after_the_first_token_went_out_cuts_the_connection(
    artifacts: Path,
) -> None:
    """A bug that raises in the handler after the head and first token went out from the
    socket callback: the front door's last resort must see the response as started (it
    answers a JSON 500 only to a client that has received nothing) and close the
    connection, so the client reads a stream cut short, never a second status line in
    the middle of its body. (An in-process gateway, whose relay is made to raise there;
    the engine is a real `seawall sim`.)"""
    sim = start_sim(artifacts)
    with running(sim):

        async def main() -> bytes:
            config = {"replicas": [{"url": sim.url, "model": MODEL}], "listen": {"port": 0}}
            gw = Gateway(parse_config(config), access_log=False)
            port = await gw.start()

            async def broken(request: Any, ctx: RequestCtx, opened: Any) -> Any:
                assert ctx.stream.head_sent  # the callback path wrote the head
                opened.close()
                raise RuntimeError("a bug in the relay")

            gw.proxy.relay.stream = broken  # type: ignore[method-assign]
            try:
                await until_ready(port)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                data = json.dumps(CHAT).encode()
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                    % (len(data), data)
                )
                got = await asyncio.wait_for(reader.read(), 10)  # to the connection's end
                writer.close()
                return got
            finally:
                await gw.close()

        got = asyncio.run(main())
    assert got.startswith(b"HTTP/1.1 200 OK\r\n"), got[:200]
    assert got.count(b"HTTP/1.1 ") == 1, got  # no error response inside the stream
    assert b'"content":"' in got  # the first token reached the client
    assert not got.endswith(b"0\r\n\r\n")  # cut short, not a complete stream


@pytest.mark.parametrize(
    "tier",
    [
        {"migrate": True},  # the text is tracked, per-chunk counts are asked for and stripped
        {"prompt_tokens_per_min": 10_000_000},  # usage is asked for, read and stripped
    ],
    ids=["migrating tier", "token-rate tier"],
)
def test_a_stream_read_event_by_event_gets_its_first_token_from_the_callback_too(
    artifacts: Path, tier: dict[str, Any]
) -> None:
    """A tier with migration or a token rate makes the relay read every event (to track
    the text, to read and strip the usage it asked for): its head and first token still
    go out from the upstream's socket callback, filtered as the relay filters them (an
    event-level stream took 0.13 ms longer through aiohttp's path, `bench_hop.py
    --tenant`). The client reads the same stream: no usage or counts it did not ask
    for, the whole answer, `[DONE]`. (In-process, to see which path wrote the head.)"""
    sim = start_sim(artifacts)
    with running(sim):

        async def main() -> tuple[list[bool], list[bytes]]:
            config = {
                "replicas": [{"url": sim.url, "model": MODEL}],
                "listen": {"port": 0},
                "tiers": {"default": tier},
            }
            gw = Gateway(parse_config(config), access_log=False)
            port = await gw.start()
            relay = gw.proxy.relay
            real = relay.stream
            head_sent: list[bool] = []

            async def stream(request: Any, ctx: RequestCtx, opened: Any) -> Any:
                head_sent.append(ctx.stream.head_sent)
                return await real(request, ctx, opened)

            relay.stream = stream  # type: ignore[method-assign]
            conn = Exchange(port)
            try:
                await until_ready(port)
                bodies = [(await conn.post(CHAT))[2] for _ in range(3)]
                return head_sent, bodies
            finally:
                conn.close()
                await gw.close()

        head_sent, bodies = asyncio.run(main())
    assert head_sent == [True, True, True]
    for body in bodies:
        evs = events(body)
        assert evs[-1] == "[DONE]"
        chunks = [json.loads(e) for e in evs[:-1]]
        assert all("usage" not in c or c["usage"] is None for c in chunks), body
        assert all(c["choices"] for c in chunks), body  # no usage chunk: not asked for
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert len(text.split()) >= 1, body
