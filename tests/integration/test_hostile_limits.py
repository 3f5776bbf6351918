"""Getting past a limit, or being locked out of one, through a real gateway in front of
a real `seawall sim` (and a real redis-server): issue 11, items 6 and 7, and items the
request path owns (2, 3 and 5).
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from seawall.auth import hash_key, new_key
from seawall.protocol.tokens import EstimateCounter, count_chat_prompt
from tests.support.fleet import MODEL, metric_sum, running, scrape, start_gateway, start_sim
from tests.support.hostile import assert_openai_error, rss_kib, wait_for
from tests.support.procs import Proc
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def _tenant_gateway(artifacts: Path, tier: dict[str, Any]) -> tuple[str, Proc, Proc]:
    """(key, sim, gateway): one sim behind a gateway with one tenant, on `tier`."""
    key = new_key()
    sim = start_sim(artifacts)
    gw = start_gateway(
        artifacts,
        [sim],
        {
            "tiers": {"t": tier},
            "tenants": {"acme": {"tier": "t", "api_key_hashes": [hash_key(key)]}},
        },
    )
    return key, sim, gw


def _post(gw: Proc, key: str | None, body: dict[str, Any], path: str = CHAT) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=30)


def test_no_prompt_field_slips_past_a_tier_prompt_limit(artifacts: Path) -> None:
    """Before: a text part whose `text` was a list was not counted, and the emulator
    rendered it into 3,816 prompt tokens against a 200-token tier limit (served, 200)."""
    key, sim, gw = _tenant_gateway(artifacts, {"max_prompt_tokens": 200})
    words = ["the seawall holds against the storm"] * 120
    with running(gw, sim):
        as_list = _post(
            gw,
            key,
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": words}]}],
            },
        )
        err = assert_openai_error(as_list, 400)
        assert err["param"] == "messages"
        padding = " ".join(words)
        assert count_chat_prompt([{"role": "user", "content": padding}], EstimateCounter()) > 200
        for body in (
            {"messages": [{"role": "user", "content": "hi", "name": padding}]},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": padding}]},
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": padding},
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": padding}]}]},
        ):
            r = _post(gw, key, {"model": MODEL, "max_tokens": 4, **body})
            err = assert_openai_error(r, 400)
            assert "200" in err["message"], err
        r = _post(
            gw,
            key,
            {"model": MODEL, "max_tokens": 4, "prompt": [list(range(100, 130))] * 10},
            path="/v1/completions",
        )
        assert_openai_error(r, 400)  # a batch of 10 x 30 token ids is 300 prompt tokens
        ok = _post(
            gw,
            key,
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status_code == 200


def test_a_redis_pause_does_not_lock_a_tenant_out(
    artifacts: Path, redis_server: RedisServer
) -> None:
    """Before: an acquire that timed out during a Redis pause ran when Redis resumed,
    and its lease held the tenant's only slot for `total_s + 60` s: every request was
    `429 concurrency_limit_exceeded` with `Retry-After: 1`, for ~11 minutes."""
    key = new_key()
    sim = start_sim(artifacts)
    gw = start_gateway(
        artifacts,
        [sim],
        {
            "ratelimit": {"backend": "redis", "redis_url": redis_server.url},
            "tiers": {"one": {"max_concurrent": 1}},
            "tenants": {"acme": {"tier": "one", "api_key_hashes": [hash_key(key)]}},
            "admission": {"enabled": False},
            "metrics": {"access": "public"},  # the test reads the degraded gauge
        },
    )
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert redis_server.proc is not None
    with running(gw, sim):
        assert _post(gw, key, body, "/v1/completions").status_code == 200  # warm pool
        redis_server.proc.signal(signal.SIGSTOP)
        try:
            during = _post(gw, key, body, "/v1/completions")
            assert during.status_code == 200  # fail-open: decided in the gateway
        finally:
            redis_server.proc.signal(signal.SIGCONT)
        # Once the gateway decides through Redis again (its degraded gauge back to 0,
        # which takes one probe after the reconnect interval), the tenant is served.
        statuses: list[int] = []

        def through_redis() -> bool:
            statuses.append(_post(gw, key, body, "/v1/completions").status_code)
            return metric_sum(scrape(gw.url), "seawall_ratelimit_backend_degraded") == 0

        wait_for(through_redis, 10.0, f"the gateway back on Redis (statuses {statuses})")
        after = [_post(gw, key, body, "/v1/completions") for _ in range(5)]
        assert [r.status_code for r in after] == [200] * 5, [r.text[:200] for r in after]


# ------------------------------------------------------------ the request path's items:
# auth before the body (item 2), labels only from known values (item 3), and oversized
# requests refused unread and charged to the request rate (item 5).


def test_no_key_is_refused_before_the_body_is_read(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(
        artifacts, [sim], {"tenants": {"acme": {"api_key_hashes": [hash_key(new_key())]}}}
    )
    with running(gw, sim):
        assert gw.port is not None
        with socket.create_connection(("127.0.0.1", gw.port), timeout=3) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
            s.settimeout(3)
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401")
        # And no model list for a client without a key.
        r = _post(gw, None, {"model": "nope", "prompt": "x"}, "/v1/completions")
        assert_openai_error(r, 401)


def test_client_model_names_do_not_grow_the_metrics(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):
        # The first requests of each kind add their own fixed series (and the fleet
        # monitor adds its own as it probes): count from after 20 made-up names.
        for i in range(20):
            _post(gw, None, {"model": f"made-up-{i}", "prompt": "x"}, "/v1/completions")
        before = scrape(gw.url)
        for i in range(20, 200):
            _post(gw, None, {"model": f"made-up-{i}", "prompt": "x"}, "/v1/completions")
        after = scrape(gw.url)
        assert not [k for k in after if "made-up" in k]  # no client string in a label
        assert len(after) <= len(before) + 3, set(after) - set(before)


def test_requests_refused_for_size_are_charged_to_the_request_rate(artifacts: Path) -> None:
    key, sim, gw = _tenant_gateway(artifacts, {"max_prompt_tokens": 50, "requests_per_min": 5})
    with running(gw, sim):
        big = {"model": MODEL, "prompt": "word " * 500, "max_tokens": 2}
        for _ in range(5):
            assert _post(gw, key, big, "/v1/completions").status_code in (400, 413)
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert _post(gw, key, small, "/v1/completions").status_code == 429


def _head(port: int, request: bytes, timeout_s: float = 5) -> bytes:
    """Send `request` (headers and the start of a body, never all of it) and return what
    the gateway answers before the client sends more."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(request)
        try:
            return s.recv(65536)
        except TimeoutError:
            return b"(no answer: the gateway is waiting for the rest of the body)"


def test_a_body_over_the_tiers_byte_bound_is_refused_before_it_is_read(artifacts: Path) -> None:
    """Before: a 3.8 MB prompt under `limits.max_body_bytes` was read, joined and parsed
    whole on the event loop before the tier's byte bound refused it, so a flood of them
    stalled other tenants' streams and left the gateway's RSS 3-4x its start. The bound is
    known from the key: the 413 comes from the headers (or, chunked, as soon as the body
    passes the bound), and nothing past the bound is kept."""
    key, sim, gw = _tenant_gateway(artifacts, {"max_prompt_tokens": 200})
    with running(gw, sim):
        assert gw.port is not None
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n"
        )
        answer = _head(gw.port, head + b"Content-Length: 3800000\r\n\r\n{")
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        error = orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "prompt_too_large" and "3800000" in error["message"]

        chunk = b'"' + b"w" * 8190 + b'"'
        chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
        chunked += b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(12))
        answer = _head(gw.port, chunked)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == (
            "prompt_too_large"
        )

        # An honest client that sends it all anyway still reads its 413, on a connection
        # it can go on using; and the oversized bodies are not kept.
        rss_before = rss_kib(gw.pid) / 1024
        big = {"model": MODEL, "prompt": "word " * 760_000, "max_tokens": 2}
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            for _ in range(30):
                assert_openai_error(c.post(gw.url + "/v1/completions", json=big), 413)
            ok = c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert ok.status_code == 200, ok.text
        grown = rss_kib(gw.pid) / 1024 - rss_before
        assert grown < 15, f"30 refused 3.8 MB bodies left the gateway {grown:.0f} MiB larger"


def test_leaving_before_the_usage_chunk_does_not_dodge_the_prompt_token_rate(
    artifacts: Path,
) -> None:
    """Item 6: clients that closed each stream after its first token, before the usage
    chunk, sent 76,321 prompt tokens in 1.4 s against a 3,000/min tier. A request that
    reached the engine is charged at least its counted prompt, whatever the client does."""
    messages = [{"role": "user", "content": "the seawall holds against the storm " * 20}]
    counted = count_chat_prompt(messages, EstimateCounter())
    key, sim, gw = _tenant_gateway(artifacts, {"prompt_tokens_per_min": 3 * counted + 1})
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with running(gw, sim), httpx.Client(timeout=30, headers=headers) as c:
        for _ in range(3):
            with c.stream("POST", gw.url + CHAT, json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first event; then leave, long before the usage
        refused = c.post(gw.url + CHAT, json={**body, "stream": False})
        err = assert_openai_error(refused, 429)
        assert err["code"] == "rate_limit_exceeded"
