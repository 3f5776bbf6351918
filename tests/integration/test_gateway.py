"""The gateway request path against real `seawall sim` replicas, with real clients.

Every test here starts its own replicas and gateway on loopback ports and talks to them
with the `openai` SDK or `httpx`, as a user would.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.cut_upstream import CutUpstream
from tests.support.fleet import (
    MODEL,
    metric_sum,
    normalise,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import REPO, Proc, free_port

pytestmark = pytest.mark.integration

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about seawalls."}]}
COMPLETION = {"model": MODEL, "prompt": "A seawall is"}


def client(gw: Proc, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, **kw)


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def stream_cut(gw: Proc) -> tuple[list[bytes], dict[str, Any]]:
    """Stream a 50-token completion that the gateway must end with an error event: the
    events as relayed, and that error (the event before the last)."""
    r = httpx.post(
        gw.url + "/v1/completions",
        timeout=20,
        json={**COMPLETION, "stream": True, "max_tokens": 50},
    )
    assert r.status_code == 200
    events = sse_events(r.content)
    error: dict[str, Any] = json.loads(events[-2].removeprefix(b"data: "))["error"]
    return events, error


@pytest.fixture
def two_sims(artifacts: Path) -> Iterator[tuple[Proc, Proc]]:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    with running(a, b):
        yield a, b


def test_streaming_and_unary_pass_through_byte_faithfully(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            for stream in (False, True):
                req = {**body, "stream": stream, "max_tokens": 12, "temperature": 0}
                if stream:
                    req["stream_options"] = {"include_usage": True}
                direct = httpx.post(sim.url + path, json=req, timeout=10)
                via = httpx.post(gw.url + path, json=req, timeout=10)
                assert via.status_code == direct.status_code == 200
                assert via.headers["content-type"] == direct.headers["content-type"]
                assert normalise(via.content) == normalise(direct.content), (path, stream)
                assert via.headers["x-request-id"]


def test_openai_sdk_streams_and_errors_through_the_gateway(
    two_sims: tuple[Proc, Proc], artifacts: Path
) -> None:
    gw = start_gateway(artifacts, list(two_sims))
    with running(gw):
        c = client(gw)
        chunks = list(c.chat.completions.create(**CHAT, stream=True, max_tokens=8))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text
        unary = c.chat.completions.create(**CHAT, max_tokens=8, temperature=0)
        assert unary.choices[0].message.content
        comp = c.completions.create(**COMPLETION, max_tokens=8)
        assert comp.usage is not None and comp.usage.completion_tokens == 8
        assert [m.id for m in c.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="no-such-model", messages=CHAT["messages"])
        with pytest.raises(openai.BadRequestError):  # the engine's own 400, relayed as-is
            c.completions.create(**COMPLETION, max_tokens=100_000)


def test_bad_input_gets_openai_shaped_errors_and_disturbs_nothing(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim], {"limits": {"max_body_bytes": 4096}})
    with running(gw, sim):
        # A long stream in flight while bad requests arrive: it must finish untouched.
        result: dict[str, Any] = {}

        def long_stream() -> None:
            with httpx.stream(
                "POST",
                gw.url + "/v1/completions",
                timeout=30,
                json={**COMPLETION, "stream": True, "max_tokens": 200},
            ) as r:
                result["body"] = r.read()

        t = threading.Thread(target=long_stream)
        t.start()
        cases = [
            ("POST", "/v1/chat/completions", b"{not json", 400),
            ("POST", "/v1/chat/completions", b"[1,2]", 400),
            ("POST", "/v1/chat/completions", b'{"model": "sim-model"}', 400),
            ("POST", "/v1/completions", b'{"model": 7, "prompt": "x"}', 400),
            ("POST", "/v1/completions", b'{"model":"sim-model","prompt":"x","stream":"yes"}', 400),
            ("POST", "/v1/completions", b"{" + b'"a":"' + b"x" * 8000 + b'"}', 413),
            ("GET", "/v1/nothing-here", b"", 404),
            ("GET", "/v1/completions", b"", 405),
            ("POST", "/v1/completions", b"\xff\xfe\x00garbage", 400),
        ]
        for method, path, body, status in cases:
            r = httpx.request(
                method,
                gw.url + path,
                content=body,
                timeout=5,
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == status, (path, body[:40], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["message"]
        t.join(timeout=30)
        assert sse_events(result["body"])[-1] == b"data: [DONE]"
        assert b'"error"' not in result["body"]


def test_replica_killed_before_first_token_is_retried_elsewhere(
    two_sims: tuple[Proc, Proc], artifacts: Path
) -> None:
    slow, healthy = two_sims
    set_fault(slow, {"kind": "slow", "factor": 400})  # its first token takes seconds
    gw = start_gateway(artifacts, [slow, healthy], {"timeouts": {"ttft_s": 20}})
    with running(gw):
        results: list[str] = []

        def one() -> None:
            out = client(gw).completions.create(**COMPLETION, max_tokens=5, stream=True)
            results.append("".join(c.choices[0].text for c in out if c.choices))

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        wait_until(
            lambda: metric_sum(scrape(gw.url), "seawall_inflight_requests", replica="r0") >= 1,
            10,
            what="a request waiting on r0",
        )
        slow.popen.kill()  # SIGKILL: in-flight connections reset
        for t in threads:
            t.join(timeout=30)
        assert len(results) == 6 and all(results)
        # The access record is written just after the last byte: allow it a moment.
        wait_until(
            lambda: metric_sum(scrape(gw.url), "seawall_requests_total", status="200") == 6,
            5,
            what="six successes counted",
        )
        m = scrape(gw.url)
        # Requests waiting on r0 when it died were retried (not failed) on r1.
        assert metric_sum(m, "seawall_retries_total") >= 1
        assert metric_sum(m, "seawall_upstream_attempts_total", replica="r0", outcome="ok") == 0


def test_a_stream_whose_upstream_response_ends_before_done_is_dropped_not_served(
    artifacts: Path,
) -> None:
    """An upstream body that ends cleanly without `[DONE]` (a proxy that gave up on the
    stream): the client gets the error event and the gateway counts a dropped stream.
    The relay once took the end of the upstream's response as the end of the answer."""
    with CutUpstream(MODEL, tokens=3) as upstream:
        gw = start_gateway(
            artifacts, [], {"replicas": [{"url": upstream.url, "id": "r0", "model": MODEL}]}
        )
        with running(gw):
            events, error = stream_cut(gw)
            assert sum(1 for e in events if b'"text"' in e) == 3  # the tokens came through
            assert error["code"] == "upstream_closed"
            m = scrape(gw.url)
            assert metric_sum(m, "seawall_stream_errors_total", reason="upstream_closed") == 1


def test_replica_killed_mid_stream_ends_the_stream_cleanly_without_retry(
    two_sims: tuple[Proc, Proc], artifacts: Path
) -> None:
    for sim in two_sims:
        set_fault(sim, {"kind": "crash", "after_tokens": 5})
    gw = start_gateway(artifacts, list(two_sims))
    with running(gw):
        events, error = stream_cut(gw)
        assert events[-1] == b"data: [DONE]"
        assert error["code"] in ("upstream_reset", "upstream_closed")
        assert sum(1 for e in events if b'"text"' in e) >= 1  # tokens reached the client first
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_upstream_attempts_total") == 1  # no retry after a token
        assert metric_sum(m, "seawall_retries_total") == 0


def test_hang_mid_stream_is_ended_by_the_inter_token_timeout(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim], {"timeouts": {"itl_s": 1.0, "ttft_s": 10}})
    with (
        running(gw, sim),
        httpx.stream(
            "POST",
            gw.url + "/v1/completions",
            timeout=30,
            json={**COMPLETION, "stream": True, "max_tokens": 2000},
        ) as r,
    ):
        it = r.iter_raw()
        first = next(it)
        assert b"data: " in first
        set_fault(sim, {"kind": "hang"})
        hung_at = time.monotonic()
        rest = b"".join(it)
        ended_after = time.monotonic() - hung_at
        events = sse_events(first + rest)
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "itl_timeout"
        # The stream ends because of the 1 s idle timeout, not the 600 s total deadline.
        assert ended_after < 10
        assert metric_sum(scrape(gw.url), "seawall_timeouts_total", kind="itl") == 1


def raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST on a raw socket and return it unread, so the test decides when to leave."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_client_disconnect_frees_the_engines_blocks(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):
        for stage in ("streaming", "non_streaming"):
            body = {**COMPLETION, "stream": stage == "streaming", "max_tokens": 3500}
            sock = raw_post(gw.url, "/v1/completions", body)
            wait_until(
                lambda: metric_sum(scrape(sim.url), "vllm:num_requests_running") == 1,
                10,
                what="engine running the request",
            )
            assert metric_sum(scrape(sim.url), "vllm:kv_cache_usage_perc") > 0
            sock.close()  # the client goes away
            wait_until(
                lambda: metric_sum(scrape(sim.url), "vllm:num_requests_running") == 0,
                5,
                what=f"engine abort after a {stage} disconnect",
            )
            assert metric_sum(scrape(sim.url), "vllm:kv_cache_usage_perc") == 0
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_client_cancellations_total", stage="streaming") == 1
        assert metric_sum(m, "seawall_client_cancellations_total", stage="non_streaming") == 1


def test_retry_budget_bounds_upstream_attempts(artifacts: Path) -> None:
    sims = [start_sim(artifacts, name=f"s{i}") for i in range(3)]
    set_fault(sims[0], {"kind": "errors", "rate": 1.0, "when": "before_first_token"})
    ratio, min_per_s, window = 0.1, 1.0, 2.0
    gw = start_gateway(
        artifacts,
        sims,
        {
            "retry": {
                "budget_ratio": ratio,
                "budget_min_per_s": min_per_s,
                "budget_reserve_window_s": window,
            }
        },
    )
    with running(gw, *sims):
        c = client(gw)
        start = time.monotonic()
        n = 120
        ok = 0
        for _ in range(n):
            try:
                c.completions.create(**COMPLETION, max_tokens=1)
                ok += 1
            except openai.APIStatusError:
                pass
        elapsed = time.monotonic() - start
        m = scrape(gw.url)
        attempts = metric_sum(m, "seawall_upstream_attempts_total")
        floor = min_per_s * window + min_per_s * (elapsed + 5)  # reserve + refill (startup slack)
        assert attempts <= (1 + ratio) * n + floor
        assert attempts > n  # the failing replica was really tried, and retried away from
        assert ok >= n * 0.6


def test_hedging_wins_on_a_slow_replica_and_cancels_the_loser(
    two_sims: tuple[Proc, Proc], artifacts: Path
) -> None:
    slow, fast = two_sims
    set_fault(slow, {"kind": "slow", "factor": 300})
    gw = start_gateway(artifacts, [slow, fast], {"hedging": {"enabled": True, "delay_s": 0.2}})
    with running(gw):
        c = client(gw)
        for _ in range(8):
            out = c.completions.create(**COMPLETION, max_tokens=3)
            assert out.choices[0].text
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_hedges_total", outcome="won") >= 1
        # The losing copies were cancelled upstream: the slow engine holds no request.
        wait_until(
            lambda: (
                metric_sum(scrape(slow.url), "vllm:num_requests_running") == 0
                and metric_sum(scrape(slow.url), "vllm:num_requests_waiting") == 0
            ),
            5,
            what="slow replica freed after losing hedges",
        )


def test_unknown_model_and_no_usable_replica(artifacts: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(artifacts, [dead], {"replicas": []}, wait_ready=False)
    with running(gw):
        assert httpx.get(gw.url + "/readyz?fleet=1").status_code == 503
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 404  # no replica has ever said it serves this model
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):
        sim.stop()
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "no_replica"


def test_sigterm_drains_in_flight_streams_then_exits_zero(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim], {"drain": {"timeout_s": 20}})
    with (
        running(gw, sim),
        httpx.stream(
            "POST",
            gw.url + "/v1/completions",
            timeout=30,
            json={**COMPLETION, "stream": True, "max_tokens": 150},
        ) as r,
    ):
        it = r.iter_raw()
        head = next(it)
        gw.signal(signal.SIGTERM)
        wait_until(
            lambda: httpx.get(gw.url + "/readyz").status_code == 503,
            2,
            what="readyz failing at once",
        )
        refused = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=5)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert refused.json()["error"]["code"] == "draining"
        body = head + b"".join(it)
        assert sse_events(body)[-1] == b"data: [DONE]" and b'"error"' not in body
        assert gw.wait(timeout=10) == 0


def test_a_short_answer_arriving_in_one_read_is_relayed_whole(artifacts: Path) -> None:
    # With no step cost the engine writes a 2-token answer (tokens, finish, usage, [DONE])
    # faster than the gateway reads, so the first read often holds the whole stream.
    sim = start_sim(artifacts, "--step-base-ms", "0", "--step-per-seq-ms", "0")
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim), httpx.Client(timeout=10) as c:
        body = {
            **COMPLETION,
            "stream": True,
            "max_tokens": 2,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        direct = normalise(c.post(sim.url + "/v1/completions", json=body).content)
        for _ in range(150):
            via = c.post(gw.url + "/v1/completions", json=body).content
            assert normalise(via) == direct


@pytest.mark.slow
def test_a_slow_client_gets_the_whole_stream_without_the_gateway_buffering_it_all(
    artifacts: Path,
) -> None:
    # A tiny receive window and a client that stops reading: the gateway must stop
    # reading upstream (not buffer megabytes) and resume when the client catches up.
    # The answer (about 5 MB of events) is larger than the kernel's socket buffers on
    # loopback (up to 4 MiB), so the gateway's own flow control has to act.
    sim = start_sim(
        artifacts,
        *("--step-base-ms", "0", "--step-per-seq-ms", "0"),
        *("--max-model-len", "24000", "--kv-blocks", "1600"),
    )
    gw = start_gateway(artifacts, [sim])
    tokens = 20_000
    with running(gw, sim):
        body = json.dumps(
            {**COMPLETION, "stream": True, "max_tokens": tokens, "ignore_eos": True}
            | {"temperature": 0}
        ).encode()
        host, port = gw.url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Not reading: the engine finishes long before the client reads.
        wait_until(
            lambda: metric_sum(scrape(sim.url), "vllm:request_success_total") >= 1,
            30,
            what="the engine to finish the whole answer",
        )
        sock.settimeout(20)
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        sock.close()
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        payload = b""
        while chunked:  # de-chunk
            size_line, _, rest = chunked.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            payload, chunked = payload + rest[:size], rest[size + 2 :]
        events = sse_events(payload)
        assert events[-1] == b"data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        # (A lagging reader may get several tokens per chunk, as from vLLM: compare text.)
        unary = httpx.post(
            sim.url + "/v1/completions",
            timeout=30,
            json={**COMPLETION, "max_tokens": tokens, "ignore_eos": True, "temperature": 0},
        ).json()
        assert text == unary["choices"][0]["text"]


def test_a_client_that_closes_on_reading_done_is_counted_as_served(artifacts: Path) -> None:
    # SDKs close the connection as soon as they read `data: [DONE]`. The gateway wrote
    # `[DONE]` as it arrived and waited for the engine's response to end (its terminating
    # chunk, often in the next read) before finishing its books; a close in that moment
    # cancelled the handler, and a complete stream was counted as a client that left
    # (499) in the metrics and the access log: 2-8 of 1,000 here, and one run in four of
    # the retry test above.
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    body = json.dumps({**CHAT, "max_tokens": 2, "stream": True})
    host, port = gw.url.removeprefix("http://").split(":")
    concurrency, per_loop = 50, 40
    n = concurrency * per_loop
    with running(gw, sim):
        out = subprocess.run(
            [sys.executable, "-m", "tests.support.close_on_done", host, port,
             str(concurrency), str(per_loop), body],
            capture_output=True, timeout=120, check=True, cwd=REPO,
        )  # fmt: skip
        assert json.loads(out.stdout) == {"done": n, "cut": 0}
        wait_until(
            lambda: metric_sum(scrape(gw.url), "seawall_requests_total", route="chat") >= n,
            10,
            what="every stream counted",
        )
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_requests_total", route="chat", status="200") == n
        assert metric_sum(m, "seawall_client_cancellations_total") == 0
