"""Hostile HTTP against a real gateway with tenants, in front of a real `seawall sim`.

What a client can send at the HTTP level, below the OpenAI API: header lines aiohttp
cannot parse, unsupported encodings, malformed framing, request-id headers with bytes a
replica chokes on, smuggling and pipelining, huge headers, compression bombs. For each,
the client must get an OpenAI-shaped JSON error with the right status, no log line may
quote a key, and the gateway must keep serving everyone else (issue 11, items 1 and 9,
and the classics it already survived).

One gateway and one replica serve the whole module (a fresh pair per test would spend
most of the suite's time starting processes); each test sends its own connections.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from seawall.auth import hash_key, new_key
from tests.support.fleet import MODEL, metric_sum, running, scrape, start_gateway, start_sim
from tests.support.hostile import (
    assert_intact,
    assert_openai_error,
    raw_exchange,
    request_bytes,
    resources_return,
    stream_completion,
)
from tests.support.procs import Proc, module_artifacts

pytestmark = pytest.mark.integration

BODY = b'{"model": "sim-model", "prompt": "hello", "max_tokens": 2}'


@dataclass
class Fleet:
    sim: Proc
    gw: Proc
    key: str  # the tenant whose key hostile inputs try to leak
    other_key: str  # a bystander tenant

    @property
    def port(self) -> int:
        assert self.gw.port is not None
        return self.gw.port

    def log(self) -> str:
        return self.gw.log()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    artifacts = module_artifacts("test_hostile_http")
    key, other = new_key(), new_key()
    sim = start_sim(artifacts)
    cfg = {
        "tenants": {
            "acme": {"api_key_hashes": [hash_key(key)]},
            "globex": {"api_key_hashes": [hash_key(other)]},
        },
        "metrics": {"access": "public"},  # this module reads the gateway's counters
    }
    gw = start_gateway(artifacts, [sim], cfg)
    with running(gw, sim):
        yield Fleet(sim, gw, key, other)


def secret_fragments(key: str) -> list[str]:
    """The key and every 12-character piece of its random part: a log line quoting
    part of a key leaks it as surely as one quoting all of it."""
    secret = key.removeprefix("sk-sw-")
    return [key] + [secret[i : i + 12] for i in range(0, len(secret) - 11, 4)]


def assert_no_secret(text: str, key: str) -> None:
    for fragment in secret_fragments(key):
        assert fragment not in text, f"key fragment {fragment!r} found"


# ---------------------------------------------------------------- item 1: keys in logs


def _bad_authorization_lines(key: str) -> dict[str, bytes]:
    """Authorization header lines aiohttp's parser refuses, each carrying a real key."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    tail = b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    k = key.encode()
    return {
        "bare_lf": head + b"Authorization: Bearer " + k + b"\n" + tail,
        "control_byte": head + b"Authorization: Bearer " + k + b"\x01\r\n" + tail,
        "nul_byte": head + b"Authorization: Bearer " + k + b"\x00x\r\n" + tail,
        "line_over_8k": head + b"Authorization: Bearer " + k + b"A" * 9000 + b"\r\n" + tail,
        "bare_cr": head + b"Authorization: Bearer " + k + b"\rX-Other: 1\r\n" + tail,
        "obs_fold": head + b"Authorization: Bearer\r\n " + k + b"\r\n" + tail,
        "space_before_colon": head + b"Authorization : Bearer " + k + b"\r\n" + tail,
        "in_request_line": b"POST /v1/completions?k=" + k + b"\x01 HTTP/1.1\r\n\r\n",
    }


@pytest.mark.parametrize(
    "variant",
    [
        "bare_lf",
        "control_byte",
        "nul_byte",
        "line_over_8k",
        "bare_cr",
        "obs_fold",
        "space_before_colon",
        "in_request_line",
    ],
)
def test_unparseable_authorization_never_reaches_a_log_and_gets_json(
    fleet: Fleet, variant: str
) -> None:
    before = len(fleet.log())
    responses, _ = raw_exchange(fleet.port, _bad_authorization_lines(fleet.key)[variant])
    assert len(responses) == 1, responses
    r = responses[0]
    assert r.status in (400, 401, 431), r
    err = assert_openai_error(r, r.status)
    assert_no_secret(r.body.decode(errors="replace"), fleet.key)
    assert_no_secret(str(r.headers), fleet.key)
    if r.status != 401:
        assert r.closed, "a request the parser refused must close its connection"
    assert err["type"]
    # The gateway logs at INFO by default; nothing it wrote may quote the key.
    assert_no_secret(fleet.log()[before:], fleet.key)
    assert "Traceback" not in fleet.log()[before:]


def test_keys_in_other_headers_and_ids_are_not_logged(fleet: Fleet) -> None:
    """A client that puts its key where the gateway logs (the request id) or sends it
    in every header the gateway reads still finds it in no log line or error body."""
    before = len(fleet.log())
    for headers in (
        {"X-Request-Id": fleet.key},
        {"Authorization": "Basic " + fleet.key},
        {"api-key": fleet.key + "x"},
        {"Authorization": "Bearer " + fleet.key + "x"},
    ):
        r = httpx.post(fleet.gw.url + "/v1/completions", content=BODY, headers=headers, timeout=10)
        assert r.status_code in (200, 401), r.text
        assert_no_secret(r.text, fleet.key)
        assert_no_secret(r.headers.get("x-request-id", ""), fleet.key)
    assert_no_secret(fleet.log()[before:], fleet.key)
    assert_no_secret(httpx.get(fleet.gw.url + "/metrics").text, fleet.key)


# ------------------------------------------------- item 9: malformed HTTP becomes JSON


@pytest.mark.parametrize(
    ("name", "payload", "status"),
    [
        ("garbage_request_line", b"HELLO THERE\r\n\r\n", 400),
        ("bad_method", b"GE\x01T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        ("bad_version", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", 400),
        ("invalid_header_name", b"GET /v1/models HTTP/1.1\r\nBad Header: 1\r\n\r\n", 400),
        (
            "bad_chunk_size",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz\r\nabc\r\n0\r\n\r\n",
            400,
        ),
        (
            "bad_content_length",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
            400,
        ),
        ("header_line_over_8k", request_bytes(headers={"X-Pad": "a" * 9000}, body=BODY), 431),
        (
            "too_many_headers",
            request_bytes(headers={f"X-H{i}": "1" for i in range(200)}, body=BODY),
            431,
        ),
        ("url_over_8k", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ],
)
def test_malformed_http_gets_an_openai_error(
    fleet: Fleet, name: str, payload: bytes, status: int
) -> None:
    before = len(fleet.log())
    responses, closed = raw_exchange(fleet.port, payload)
    assert len(responses) == 1, (name, responses)
    assert_openai_error(responses[0], status)
    assert closed
    assert "Traceback" not in fleet.log()[before:]


def test_unsupported_content_encoding_is_415_json(fleet: Fleet) -> None:
    for encoding in ("br", "zstd", "compress", "x-made-up"):
        r = httpx.post(
            fleet.gw.url + "/v1/completions",
            content=BODY,
            headers={
                "Content-Encoding": encoding,
                "Authorization": f"Bearer {fleet.key}",
                "Content-Type": "application/json",
            },
            timeout=10,
        )
        err = assert_openai_error(r, 415)
        assert err["code"] == "unsupported_content_encoding", (encoding, err)


def test_corrupt_gzip_body_is_400_json(fleet: Fleet) -> None:
    r = httpx.post(
        fleet.gw.url + "/v1/completions",
        content=b"\x1f\x8b\x08\x00not really gzip at all",
        headers={"Content-Encoding": "gzip", "Authorization": f"Bearer {fleet.key}"},
        timeout=10,
    )
    assert_openai_error(r, 400)


@pytest.mark.parametrize("value", ["é-accented", "日本語-id", "emoji-\U0001f600", "tab\there"])
def test_non_ascii_request_id_is_replaced_not_forwarded(fleet: Fleet, value: str) -> None:
    """A request id the replica cannot take (a raw non-ASCII byte made vLLM-like
    servers answer 500, and a character outside latin-1 made the gateway answer 500)
    is replaced by one the gateway makes; the request is served."""
    responses, _ = raw_exchange(
        fleet.port,
        request_bytes(
            body=BODY, headers={"Authorization": f"Bearer {fleet.key}", "Connection": "close"}
        ).replace(
            b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\nX-Request-Id: " + value.encode() + b"\r\n"
        ),
    )
    assert len(responses) == 1
    r = responses[0]
    assert r.status == 200, r
    rid = r.headers["x-request-id"]
    assert rid.isascii() and rid.isprintable() and " " not in rid and rid != value


def test_a_reasonable_request_id_is_kept(fleet: Fleet) -> None:
    r = httpx.post(
        fleet.gw.url + "/v1/completions",
        content=BODY,
        headers={"Authorization": f"Bearer {fleet.key}", "X-Request-Id": "trace-42.a_b:c"},
        timeout=10,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a_b:c"


def test_body_nested_too_deep_for_the_encoder_is_400(fleet: Fleet) -> None:
    """orjson reads 1,024 levels but writes 254: when the gateway edits such a body
    (here it adds a default max_tokens) the encoder failed with a plain-text 500."""
    nested = b'{"x":' * 300 + b"1" + b"}" * 300
    body = b'{"model": "sim-model", "prompt": "hi", "deep": ' + nested + b"}"
    r = httpx.post(
        fleet.gw.url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert_openai_error(r, 400)


# ------------------------------------------------------------------- the classics


def test_malformed_json_and_wrong_types_are_400(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"}
    bodies = [
        b"{not json",
        b"[1, 2, 3]",
        b'"a string"',
        b'{"model": 5, "prompt": "x"}',
        b'{"model": "sim-model", "messages": "not a list"}',
        # ("7" is an integer to vLLM's lax pydantic, and passes as it does: issue 13)
        b'{"model": "sim-model", "prompt": "x", "max_tokens": "seven"}',
        b'{"model": "sim-model", "prompt": "x", "stream": "yes"}',
        b'{"model": "sim-model", "prompt": {"nested": "object"}}',
        b'{"model": "sim-model", "prompt": "x", "n": "many"}',
        b"\xff\xfe\x00garbage",
    ]
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in bodies:
            r = httpx.post(fleet.gw.url + path, content=body, headers=auth, timeout=10)
            assert_openai_error(r, 400)


def test_smuggling_with_both_content_length_and_chunked_is_refused(fleet: Fleet) -> None:
    """CL.TE: a front end honouring Content-Length and a back end honouring chunked
    would disagree on where the first request ends. The gateway refuses the request,
    answers once, and closes, so the smuggled request is never served."""
    smuggled = request_bytes("/v1/models", method="GET")
    chunked = b"0\r\n\r\n" + smuggled
    payload = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked) + chunked
    )
    responses, closed = raw_exchange(fleet.port, payload)
    assert len(responses) == 1 and closed
    assert_openai_error(responses[0], 400)


def test_smuggling_with_two_content_lengths_is_refused(fleet: Fleet) -> None:
    payload = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Content-Length: 60\r\n\r\n" + BODY
    )
    responses, closed = raw_exchange(fleet.port, payload)
    assert len(responses) == 1 and closed
    assert_openai_error(responses[0], 400)


def test_pipelined_requests_are_answered_in_order(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.key}"}
    first = request_bytes(body=BODY, headers={**auth, "X-Request-Id": "first"})
    second = request_bytes("/v1/models", method="GET", headers={"X-Request-Id": "second"})
    third = request_bytes(body=b"{oops", headers={**auth, "X-Request-Id": "third"})
    responses, _ = raw_exchange(fleet.port, first + second + third, timeout_s=5)
    assert [r.status for r in responses] == [200, 200, 400]
    assert responses[0].headers["x-request-id"] == "first"
    assert responses[0].json()["object"] == "text_completion"
    assert responses[1].json()["object"] == "list"
    assert_openai_error(responses[2], 400)


def test_gzip_bomb_is_refused_without_inflating_memory(fleet: Fleet) -> None:
    """64 MiB of zeros compress to ~64 KiB; inflating it must stop at the body limit."""
    bomb = gzip.compress(b"0" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 256 * 1024
    deflate = zlib.compress(b"0" * (64 * 1024 * 1024), 9)
    assert fleet.gw.pid
    with resources_return(fleet.gw.pid):
        for encoding, body in (("gzip", bomb), ("deflate", deflate)):
            for _ in range(3):
                r = httpx.post(
                    fleet.gw.url + "/v1/completions",
                    content=body,
                    headers={
                        "Content-Encoding": encoding,
                        "Authorization": f"Bearer {fleet.key}",
                        "Content-Type": "application/json",
                    },
                    timeout=30,
                )
                assert_openai_error(r, 413)


def test_the_gateway_keeps_serving_a_bystander_through_all_of_it(fleet: Fleet) -> None:
    """After every hostile input above (and during a last burst of them), another
    tenant's long stream arrives intact and the error counters name no key."""
    from tests.support.hostile import Bystander

    bystander = Bystander(fleet.gw.url, fleet.other_key, max_tokens=300).start()
    lines = _bad_authorization_lines(fleet.key)
    for _ in range(3):
        for payload in lines.values():
            raw_exchange(fleet.port, payload, timeout_s=5)
    assert_intact(bystander.finish(), 300)
    assert_intact(stream_completion(fleet.gw.url, fleet.other_key, 20), 20)
    m = scrape(fleet.gw.url)
    assert metric_sum(m, "seawall_requests_total", model=MODEL) >= 1
    assert_no_secret(str(m), fleet.key)
    assert_no_secret(fleet.log(), fleet.key)
