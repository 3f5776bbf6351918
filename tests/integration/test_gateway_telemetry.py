"""W3C trace context and OpenTelemetry spans through a real gateway (issue 14).

`traceparent` used to be dropped. Now a replica receives the client's trace (as the
gateway's attempt span's child when tracing is on, unchanged when it is off), and with
`telemetry.enabled` the gateway exports its spans over OTLP/HTTP. The collector here is
`tests/support/otlp.py` (a loopback receiver decoding the exports with the
OpenTelemetry project's own protobuf classes); each `seawall sim` sits behind a TCP
relay that keeps the bytes the gateway sent, so the test reads the headers the engine
received without the engine logging them."""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.support.chop import ChoppingRelay
from tests.support.fleet import MODEL, running, set_fault, start_gateway, start_sim, wait_until
from tests.support.otlp import OtlpReceiver

pytestmark = pytest.mark.integration

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
SERVER, CLIENT, INTERNAL = 2, 3, 1  # opentelemetry.proto.trace.v1.Span.SpanKind
ERROR = 2

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about sea walls."}],
    "max_tokens": 8,
    "stream": True,
}


def traceparents(relay: ChoppingRelay) -> list[str]:
    """The traceparent of every request the engine behind `relay` received."""
    return re.findall(r"(?im)^traceparent: (\S+)\r$", relay.sent.decode(errors="replace"))


def test_spans_reach_the_collector_and_the_engine_joins_the_clients_trace(
    artifacts: Path,
) -> None:
    sims = [start_sim(artifacts, name=f"s{i}") for i in range(2)]
    # One engine fails every request before its first token: each request that tries
    # it first is retried on the other, so a trace shows a failed and a good attempt.
    set_fault(sims[0], {"kind": "errors", "rate": 1.0, "when": "before_first_token"})
    with ExitStack() as stack, running(*sims):
        collector = stack.enter_context(OtlpReceiver())
        relays = [stack.enter_context(ChoppingRelay(s.port or 0, piece=65536)) for s in sims]
        config = {
            "replicas": [
                {"url": r.url, "model": MODEL, "id": f"r{i}"} for i, r in enumerate(relays)
            ],
            "telemetry": {
                "enabled": True,
                "endpoint": collector.endpoint,
                "export_interval_s": 0.2,
                "service_name": "gw-under-test",
            },
        }
        gw = start_gateway(artifacts, [], config)
        with running(gw), httpx.Client(base_url=gw.url, timeout=30) as http:
            retried = None
            for _ in range(20):  # each request picks r0 first with odds 1/2
                r = http.post(
                    "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
                )
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                wait_until(lambda: len(collector.named("seawall.request")) >= 1, 10)
                if len(collector.named("seawall.attempt")) >= 2:
                    retried = True
                    break
                collector.spans.clear()  # the next request's trace alone
            assert retried, "no request tried the failing replica first in 20 tries"
            wait_until(lambda: collector.named("seawall.stream"), 10, what="the stream span")

            (request,) = collector.named("seawall.request")
            assert (request.trace_id, request.parent_span_id) == (CLIENT_TRACE, CLIENT_PARENT)
            assert request.kind == SERVER and request.service == "gw-under-test"
            a = request.attributes
            assert a["http.route"] == "/v1/chat/completions"
            assert a["http.response.status_code"] == 200 and a["seawall.outcome"] == "ok"
            assert a["seawall.replica"] == "r1" and a["seawall.attempts"] == 2
            assert a["gen_ai.request.model"] == MODEL and a["seawall.ttft_s"] > 0
            assert request.events["first_token"]["seawall.replica"] == "r1"
            assert request.events["stream_end"]["seawall.stream_end"] == "ok"

            attempts = sorted(collector.named("seawall.attempt"), key=lambda s: s.start_ns)
            failed, good = attempts
            for s in attempts:
                assert s.kind == CLIENT and s.trace_id == CLIENT_TRACE
                assert s.parent_span_id == request.span_id
            assert failed.attributes["seawall.replica"] == "r0"
            assert failed.attributes["seawall.attempt.outcome"] in ("http_5xx", "error_event")
            assert failed.status_code == ERROR
            assert good.attributes["seawall.replica"] == "r1"
            assert good.attributes["seawall.attempt.outcome"] == "ok"
            assert 0 < good.attributes["seawall.ttft_s"] <= a["seawall.ttft_s"]
            assert good.end_ns <= request.end_ns

            (stream,) = collector.named("seawall.stream")
            assert stream.kind == INTERNAL and stream.parent_span_id == request.span_id
            assert stream.attributes["seawall.stream_end"] == "ok"

            # Each engine received the trace with the gateway's own attempt as parent.
            assert traceparents(relays[0])[-1] == f"00-{CLIENT_TRACE}-{failed.span_id}-01"
            assert traceparents(relays[1])[-1] == f"00-{CLIENT_TRACE}-{good.span_id}-01"

            # No traceparent from the client: the trace starts at the gateway.
            collector.spans.clear()
            set_fault(sims[0], {"kind": "clear"})
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200
            wait_until(lambda: collector.named("seawall.request"), 10, what="the second trace")
            (root,) = collector.named("seawall.request")
            assert root.parent_span_id == "" and root.trace_id != CLIENT_TRACE
            assert "stream_end" not in root.events  # not a stream
            sent = traceparents(relays[0]) + traceparents(relays[1])
            assert any(t.startswith(f"00-{root.trace_id}-") for t in sent)


def test_without_telemetry_the_trace_context_goes_on_unchanged(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    with ChoppingRelay(sim.port or 0, piece=65536) as relay, running(sim):
        gw = start_gateway(artifacts, [], {"replicas": [{"url": relay.url, "model": MODEL}]})
        with running(gw), httpx.Client(base_url=gw.url, timeout=30) as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
            r = http.post(
                "/v1/completions",
                json=body,
                headers={"traceparent": TRACEPARENT, "tracestate": state},
            )
            assert r.status_code == 200
            sent = relay.sent.decode()
            assert f"traceparent: {TRACEPARENT}\r\n" in sent
            assert f"tracestate: {state}\r\n" in sent
            # A malformed one is not relayed (an all-zero trace id is invalid).
            relay.sent.clear()
            bad = f"00-{'0' * 32}-{CLIENT_PARENT}-01"
            r = http.post("/v1/completions", json=body, headers={"traceparent": bad})
            assert r.status_code == 200 and relay.sent
            assert "traceparent" not in relay.sent.decode().lower()


def test_tracing_off_never_imports_opentelemetry() -> None:
    """With telemetry off (the default), a gateway that has started and answered a
    request carrying a traceparent has no OpenTelemetry module loaded: no span work
    can have happened. (A subprocess: this one has the test collector's imports.)"""
    code = f"""
import asyncio, sys, aiohttp
from seawall.config import parse_config
from seawall.gateway.app import Gateway

async def main():
    replicas = [{{"url": "http://127.0.0.1:9", "model": "m"}}]
    config = {{"replicas": replicas, "listen": {{"port": 0}}}}
    gw = Gateway(parse_config(config), access_log=False)
    port = await gw.start()
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{{port}}/v1/completions"
        body = {{"model": "m", "prompt": "x", "max_tokens": 1}}
        async with s.post(url, json=body, headers={{"traceparent": "{TRACEPARENT}"}}) as r:
            await r.read()
            status = r.status
    await gw.close()
    return status, gw.tracing, gw.proxy.tracing

print(*asyncio.run(main()), sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "503 None None []", out.stdout + out.stderr
