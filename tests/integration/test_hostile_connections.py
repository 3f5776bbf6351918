"""Slowloris, idle floods and descriptor exhaustion against a real gateway, no key needed
(issue 11, item 4).

Before: no timeout on reading headers or a body and aiohttp's 3,630 s keep-alive, so
tricklers at 1 byte/s stayed open indefinitely, and ~20,000 idle connections exhausted
the descriptor limit so that new clients and the admin API were reset. Each test runs
the attack beside a bystander tenant and asserts what that tenant notices (its long
stream intact, its TTFT near the unloaded value), that the attackers are cut off within
the configured bounds, and that the gateway's descriptors and memory come back.

The settings are small (2 s timeouts, caps of a few hundred) so that the suite stays
short; `bench/bench_hostile.py` runs the 10,000-connection flood with the defaults.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key, new_key
from tests.support.fleet import MODEL, running, start_sim
from tests.support.hostile import (
    Bystander,
    assert_intact,
    assert_openai_error,
    assert_ttft_within,
    fd_count,
    fd_soft_limit,
    parse_responses,
    raise_own_fd_limit,
    resources_return,
    ttft_samples,
    wait_for,
)
from tests.support.procs import Proc, free_port, module_artifacts, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "sk-sw-admin-token-for-hostile-tests-00000000000000"
TIMEOUT_S = 2.0
SERVER = {
    "header_timeout_s": TIMEOUT_S,
    "body_timeout_s": TIMEOUT_S,
    # Longer than the header timeout, as by default: aiohttp's keep-alive clock runs
    # from the connection's start too, and closes without an answer.
    "keepalive_timeout_s": TIMEOUT_S + 1,
    "max_connections": 400,
    "max_unauthenticated_connections": 200,
    "max_unauthenticated_per_address": 200,
}
# The gateway runs under a hard descriptor limit of 1,024 (many distributions' default
# for services), so that a flood can exhaust it the way it did in production.
GATEWAY_FD_LIMIT = 1024


@dataclass
class Fleet:
    sim: Proc
    gw: Proc
    admin_url: str
    key: str

    @property
    def port(self) -> int:
        assert self.gw.port is not None
        return self.gw.port


def _start_gateway(artifacts: Path, sim: Proc, key: str) -> tuple[Proc, str]:
    port, admin_port = free_port(), free_port()
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": sim.url, "id": "r0", "model": MODEL}],
        "tenants": {"acme": {"api_key_hashes": [hash_key(key)]}},
        "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(ADMIN_TOKEN)},
        "fleet": {"ledger_path": str(artifacts / "ledger.sqlite")},
        "server": SERVER,
    }
    path = artifacts / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = seawall_argv("serve", "--config", str(path))
    shell = f"ulimit -n {GATEWAY_FD_LIMIT}; exec " + " ".join(f"'{a}'" for a in argv)
    proc = spawn(["sh", "-c", shell], artifacts / "gateway.log", port=port)
    wait_http(f"{proc.url}/healthz", timeout=20, proc=proc)
    wait_http(f"{proc.url}/readyz", timeout=20, proc=proc)
    return proc, f"http://127.0.0.1:{admin_port}"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    raise_own_fd_limit(16384)
    artifacts = module_artifacts("test_hostile_connections")
    key = new_key()
    sim = start_sim(artifacts)
    gw, admin = _start_gateway(artifacts, sim, key)
    with running(gw, sim):
        yield Fleet(sim, gw, admin, key)


def _open(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def _closed_by_server(sock: socket.socket) -> tuple[bool, bytes]:
    """Whether the server has closed this connection (what it sent before, if anything)."""
    sock.setblocking(False)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True, data
            data += chunk
    except BlockingIOError:
        return False, data
    except OSError:
        return True, data


class Tricklers:
    """Connections that each send a prefix, then one byte per `interval_s`, forever (or
    until the server closes them, or `stop()`)."""

    def __init__(self, port: int, count: int, prefix: bytes, interval_s: float = 1.0) -> None:
        self.socks = [_open(port, prefix) for _ in range(count)]
        self.closed_at: dict[int, float] = {}
        self.answers: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                closed, data = _closed_by_server(s)
                if data:
                    self.answers[i] = self.answers.get(i, b"") + data
                if closed:
                    self.closed_at[i] = time.monotonic()
                    continue
                s.setblocking(True)
                try:
                    s.sendall(b"x")
                except OSError:
                    self.closed_at[i] = time.monotonic()

    def all_closed(self) -> bool:
        return len(self.closed_at) == len(self.socks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def test_header_and_body_tricklers_are_cut_off_within_their_timeouts(fleet: Fleet) -> None:
    baseline = ttft_samples(fleet.gw.url, fleet.key)
    with resources_return(fleet.gw.pid):
        bystander = Bystander(fleet.gw.url, fleet.key, max_tokens=300).start()
        header_prefix = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        body_prefix = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n"
        )
        keyed_body_prefix = body_prefix + f"Authorization: Bearer {fleet.key}\r\n".encode()
        heads = Tricklers(fleet.port, 150, header_prefix)
        bodies = Tricklers(fleet.port, 50, body_prefix + b"\r\n{")
        keyed_bodies = Tricklers(fleet.port, 20, keyed_body_prefix + b"\r\n{")
        try:
            during = ttft_samples(fleet.gw.url, fleet.key)
            for group, what in ((heads, "headers"), (bodies, "bodies"), (keyed_bodies, "keyed")):
                # Cut off after the timeout (+ the time it took to open them, + slack),
                # where before they stayed open for aiohttp's 3,630 s keep-alive.
                wait_for(group.all_closed, TIMEOUT_S + 8, f"every {what} trickler closed")
                waited = max(group.closed_at.values()) - group.started
                assert waited < TIMEOUT_S + 8, (what, waited)
            # Without a key a body trickler may be refused at once (401, when auth runs
            # before the body is read) or when its body times out (408).
            for group, statuses in ((heads, {408}), (bodies, {401, 408}), (keyed_bodies, {408})):
                answered = [parse_responses(a) for a in group.answers.values() if a]
                assert answered, "the slow clients were closed without an answer"
                for responses in answered:
                    assert len(responses) == 1 and responses[0].status in statuses
                    assert_openai_error(responses[0], responses[0].status)
        finally:
            for group in (heads, bodies, keyed_bodies):
                group.stop()
        assert_intact(bystander.finish(), 300)
    assert_ttft_within(baseline, during, 3.0)


def test_idle_keepalive_connections_are_closed(fleet: Fleet) -> None:
    """A connection left idle after its response is closed after keepalive_timeout_s."""
    socks = []
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # answered, then kept alive
    for _ in range(20):
        socks.append(_open(fleet.port, request))
    try:
        wait_for(
            lambda: all(_closed_by_server(s)[0] for s in socks),
            TIMEOUT_S + 6,
            "idle keep-alive connections closed by the gateway",
        )
    finally:
        for s in socks:
            s.close()


def test_idle_flood_cannot_exhaust_descriptors_or_lock_out_tenants_and_admin(
    fleet: Fleet,
) -> None:
    """3,000 connections that never send a byte, against a gateway whose descriptor
    limit is 1,024: the gateway's descriptors stay bounded, the tenant's new requests
    and the admin API are served throughout, and everything is given back after."""
    assert fd_soft_limit(fleet.gw.pid) == GATEWAY_FD_LIMIT
    baseline = ttft_samples(fleet.gw.url, fleet.key)
    with resources_return(fleet.gw.pid):
        bystander = Bystander(fleet.gw.url, fleet.key, max_tokens=300).start()
        flood: list[socket.socket] = []
        try:
            for _ in range(3000):
                try:
                    flood.append(_open(fleet.port))
                except OSError:
                    break  # the gateway's backlog may push back; that is fine
            assert len(flood) >= 2000
            # The gateway holds at most its cap of client connections, never its limit.
            assert fd_count(fleet.gw.pid) < SERVER["max_connections"] + 100
            during = ttft_samples(fleet.gw.url, fleet.key)
            state = httpx.get(
                fleet.admin_url + "/admin/state",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=10,
            )
            assert state.status_code == 200
            r = httpx.post(
                fleet.gw.url + "/v1/completions",
                json={"model": MODEL, "prompt": "still here", "max_tokens": 4},
                headers={"Authorization": f"Bearer {fleet.key}"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
        finally:
            for s in flood:
                s.close()
        assert_intact(bystander.finish(), 300)
    assert_ttft_within(baseline, during, 3.0)
