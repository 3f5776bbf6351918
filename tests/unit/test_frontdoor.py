"""The front door's pure parts: request ids, refusals of bad HTTP, redaction, caps."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    InvalidHeader,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestPayloadError
from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.config import ServerConfig
from seawall.errors import ApiError
from seawall.gateway.frontdoor import (
    MAX_HEADER_LINE_BYTES,
    MAX_REQUEST_LINE_BYTES,
    Admitted,
    Conn,
    ConnectionTable,
    RedactSecrets,
    Refused,
    canned_response,
    content_coding_refusal,
    effective_caps,
    redact,
    refusal_for,
    safe_request_id,
)
from seawall.gateway.proxy import new_request_id

KEY = "sk-sw-Zq3yTQ1c7m1hV4d0yNqJHk8bB0l3p2Wm5s9rXyZa1Bc"

# ------------------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    "value",
    ["abc", "3f2c1a9e-7d4b-4c55-9a1f-2b3c4d5e6f70", "trace:42/span=7+a@b", "a" * 128],
)
def test_ordinary_request_ids_are_kept(value: str) -> None:
    assert safe_request_id(value) == value
    assert new_request_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "é",
        "日本語",
        "tab\there",
        "new\nline",
        "a b",
        "a" * 129,
        "\x00",
        KEY,
        "sk-proj-abcdefghijklmnop",
        "Bearer-token",
    ],
)
def test_unsafe_request_ids_are_replaced(value: str | None) -> None:
    assert safe_request_id(value) is None
    fresh = new_request_id(value)
    assert fresh != value and re.fullmatch(r"[0-9a-f]{16}", fresh)  # vLLM's id shape


@given(st.text(max_size=200))
def test_any_request_id_the_gateway_keeps_is_ascii_and_forwardable(value: str) -> None:
    kept = safe_request_id(value)
    if kept is not None:
        assert kept == value and kept.isascii() and kept.isprintable() and " " not in kept
        kept.encode("latin-1")  # what aiohttp and the upstream writer need


# ---------------------------------------------------------------------- bad HTTP answers


def _secret_errors() -> list[BaseException]:
    raw = f"Authorization: Bearer {KEY}".encode()
    return [
        LineTooLong(raw[:100] + b"...", MAX_HEADER_LINE_BYTES),
        LineTooLong(b"POST /" + raw, MAX_REQUEST_LINE_BYTES),
        InvalidHeader(raw),
        BadHttpMessage(f"Invalid header value char:\n\n  {raw!r}\n  ^"),
        BadHttpMessage(f"Duplicate '{KEY}' header found."),
        BadStatusLine(f"Bad status line {raw!r}"),
        BadHttpMethod(raw.decode()),
        TransferEncodingError(f"bad chunk {raw!r}"),
        ContentEncodingError(f"Can not decode {raw!r}"),
        RequestPayloadError(raw.decode()),
        ValueError(KEY),
    ]


@pytest.mark.parametrize("exc", _secret_errors(), ids=lambda e: type(e).__name__)
def test_a_refusal_never_quotes_the_exception(exc: BaseException) -> None:
    refusal = refusal_for(exc, 400 if not isinstance(exc, ValueError) else 500)
    body = refusal.error().json_bytes().decode()
    assert KEY not in body and "Bearer" not in body and KEY[6:18] not in body
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert KEY.encode() not in canned_response(refusal)


def test_refusal_statuses() -> None:
    assert refusal_for(LineTooLong(b"x", MAX_HEADER_LINE_BYTES), 400).status == 431
    assert refusal_for(LineTooLong(b"x", MAX_REQUEST_LINE_BYTES), 400).status == 414
    assert refusal_for(BadHttpMessage("Too many headers received"), 400).status == 431
    brotli = ContentEncodingError("Can not decode content-encoding: br. Please install `Brotli`")
    assert refusal_for(brotli, 400).status == 415
    assert refusal_for(ContentEncodingError("Can not decode content-encoding: gzip"), 400) == (
        refusal_for(ContentEncodingError("deflate"), 400)
    )
    assert refusal_for(ContentEncodingError("x"), 400).status == 400
    assert refusal_for(BadHttpMethod("GE\x01T"), 400).code == "malformed_http"
    assert refusal_for(TimeoutError(), 504).status == 504
    assert refusal_for(RuntimeError("boom"), 500).status == 500
    assert refusal_for(ApiError(408, "slow", code="body_timeout"), 500).status == 408


def test_llhttp_reason_phrase_is_kept_but_not_the_bytes() -> None:
    exc = BadHttpMessage("Missing expected CR after header value:\n\n  b'x: sk-abc'\n  ^")
    message = refusal_for(exc, 400).message
    assert "Missing expected CR after header value" in message and "sk-abc" not in message


@pytest.mark.parametrize(
    ("coding", "status"),
    [
        (None, None),
        ("identity", None),
        ("gzip", None),
        ("Deflate", None),
        ("br", 415),
        ("zstd", 415),
        ("gzip, gzip", 415),
        ("compress", 415),
    ],
)
def test_content_codings(coding: str | None, status: int | None) -> None:
    headers = {} if coding is None else {"Content-Encoding": coding}
    refusal = content_coding_refusal(headers)
    assert (refusal.status if refusal else None) == status


def test_canned_response_is_valid_http_with_json() -> None:
    raw = canned_response(refusal_for(ApiError(408, "slow", code="header_timeout"), 500))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"Connection: close" in head and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body)["error"]["code"] == "header_timeout"


# ---------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(
    "text",
    [
        f"b'Authorization: Bearer {KEY}\\nContent-Length: 58'",
        f"authorization={KEY}",
        f'{{"api-key": "{KEY}"}}',
        f"x-api-key: {KEY}",
        f"token {KEY} in the middle",
        f"Bearer {KEY[6:]}",
        f"Proxy-Authorization: Basic {KEY[6:]}",
    ],
)
def test_redact_removes_credentials(text: str) -> None:
    cleaned = redact(text)
    assert KEY not in cleaned and KEY[6:] not in cleaned and "[redacted]" in cleaned


def test_redact_leaves_ordinary_text() -> None:
    text = "refused a request from 127.0.0.1: 400 malformed_http (BadHttpMessage)"
    assert redact(text) == text


def test_log_filter_rewrites_messages_and_tracebacks() -> None:
    try:
        raise ValueError(f"bad header Authorization: Bearer {KEY}")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "aiohttp.server", logging.ERROR, __file__, 1, "from %s: %s", ("x", KEY), exc_info
    )
    assert RedactSecrets().filter(record)
    formatted = logging.Formatter().format(record)
    assert KEY not in formatted and "ValueError" in formatted


# --------------------------------------------------------------------------------- caps


def test_effective_caps_fit_the_descriptor_limit() -> None:
    settings = ServerConfig()
    caps = effective_caps(settings, 1024)
    assert caps.max_total == (1024 - settings.fd_reserve) // 2
    assert caps.max_unkeyed <= caps.max_total
    assert caps.max_unkeyed_per_address <= caps.max_unkeyed
    big = effective_caps(settings, 1 << 20)
    assert big.max_total == settings.max_connections
    assert big.max_unkeyed == settings.max_unauthenticated_connections


def test_an_open_gateway_caps_one_address_only_by_the_connection_cap() -> None:
    # No keys: every connection is "unauthenticated", and one address may be a balancer.
    caps = effective_caps(ServerConfig(), 1 << 20, keys_exist=False)
    assert caps.max_unkeyed == caps.max_unkeyed_per_address == caps.max_total == 4096
    # An operator's own values stand.
    chosen = ServerConfig(max_unauthenticated_per_address=64)
    assert effective_caps(chosen, 1 << 20, keys_exist=False).max_unkeyed_per_address == 64
    # With tenants, strangers keep the tighter defaults.
    keyed = effective_caps(ServerConfig(), 1 << 20, keys_exist=True)
    assert (keyed.max_unkeyed, keyed.max_unkeyed_per_address) == (1024, 128)


def _admit(table: ConnectionTable, address: str) -> Conn:
    decision = table.admit(address)
    assert isinstance(decision, Admitted), decision
    return decision.conn


def test_a_flood_without_keys_evicts_only_its_own_kind() -> None:
    table = ConnectionTable(max_total=10, max_unkeyed=4, max_unkeyed_per_address=3)
    tenant = _admit(table, "10.0.0.1")
    table.update(tenant, keyed=True, evictable=False)  # in a request, with a valid key
    flood = [_admit(table, "10.0.0.2") for _ in range(3)]
    # The fourth from the same address evicts that address's oldest, not the tenant.
    decision = table.admit("10.0.0.2")
    assert isinstance(decision, Admitted) and decision.evict == (flood[0],)
    # Other addresses still get in; the global unauthenticated cap evicts the oldest.
    decision = table.admit("10.0.0.3")
    assert isinstance(decision, Admitted) and decision.evict == ()
    decision = table.admit("10.0.0.4")
    assert isinstance(decision, Admitted) and decision.evict == (flood[1],)
    assert tenant in table._all and table.unauthenticated == 4


def test_a_connection_sending_a_request_is_not_evicted_and_refusal_touches_nothing() -> None:
    table = ConnectionTable(max_total=2, max_unkeyed=2, max_unkeyed_per_address=2)
    a, b = _admit(table, "x"), _admit(table, "x")
    table.update(a, keyed=True, evictable=False)
    table.update(b, keyed=True, evictable=False)
    assert table.admit("y") == Refused("max_connections")
    assert len(table) == 2
    table.update(b, evictable=True)  # b's request ended: idle, evictable at the global cap
    decision = table.admit("y")
    assert isinstance(decision, Admitted) and decision.evict == (b,)


def test_an_idle_keyed_connection_goes_only_after_every_evictable_unkeyed_one() -> None:
    table = ConnectionTable(max_total=3, max_unkeyed=3, max_unkeyed_per_address=3)
    keyed = _admit(table, "x")
    table.update(keyed, keyed=True, evictable=True)
    first, second = _admit(table, "y"), _admit(table, "z")
    decision = table.admit("w")
    assert isinstance(decision, Admitted) and decision.evict == (first,)
    table.update(second, evictable=False)
    table.update(decision.conn, evictable=False)
    decision = table.admit("v")
    assert isinstance(decision, Admitted) and decision.evict == (keyed,)


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "start", "key", "finish", "close"]),
            st.integers(0, 3),
            st.integers(0, 40),
        ),
        max_size=80,
    )
)
def test_caps_hold_for_any_sequence(ops: list[tuple[str, int, int]]) -> None:
    table = ConnectionTable(max_total=8, max_unkeyed=5, max_unkeyed_per_address=3)
    open_conns: list[Conn] = []
    busy_keyed: set[int] = set()
    evictable: dict[int, bool] = {}  # the test's own model of each connection's state
    for op, address, pick in ops:
        if op == "admit":
            decision = table.admit(f"a{address}")
            if isinstance(decision, Admitted):
                for victim in decision.evict:
                    assert evictable[id(victim)] and id(victim) not in busy_keyed
                    open_conns.remove(victim)
                open_conns.append(decision.conn)
                evictable[id(decision.conn)] = True
            continue
        if not open_conns:
            continue
        conn = open_conns[pick % len(open_conns)]
        if op == "start":
            table.update(conn, evictable=not conn.keyed)
            evictable[id(conn)] = not conn.keyed
        elif op == "key":
            table.update(conn, keyed=True, evictable=False)
            busy_keyed.add(id(conn))
            evictable[id(conn)] = False
        elif op == "finish":
            table.update(conn, evictable=True)
            busy_keyed.discard(id(conn))
            evictable[id(conn)] = True
        else:
            table.remove(conn)
            open_conns.remove(conn)
            busy_keyed.discard(id(conn))
        assert len(table) == len(open_conns)
    unkeyed = [c for c in open_conns if not c.keyed]
    assert len(open_conns) <= 8 and len(unkeyed) <= 5 == table.max_unkeyed
    for address in {c.address for c in unkeyed}:
        assert sum(1 for c in unkeyed if c.address == address) <= 3
