"""Pools (issue 16): two pools of real `seawall sim` replicas behind a real gateway, one of
them standing in for a remote region through a loopback relay that adds latency.

Each test is bounded in time and count and talks only to 127.0.0.1."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key
from tests.support.chop import ChoppingRelay
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc, free_port, seawall_argv, stable_port

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "sk-sw-admin-pools-0000000000000000000000000000000"
GOLD = "sk-sw-pools-gold-00000000000000000000000000000000"
FREE = "sk-sw-pools-free-00000000000000000000000000000000"
WESTWARD = "sk-sw-pools-westward-0000000000000000000000000000"  # a tier of its own order
WAN_S = 0.02  # one-way latency to the remote region
WEST_KEY = "sk-sw-pools-east-region-0000000000000000000000000"  # the standby's tenant key


def config(pools: dict[str, Any], replicas: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "replicas": replicas,
        "pools": pools,
        "failover": {"after_s": 1.0, "failback_after_s": 4.0, "retry_after_s": 7},
        "tiers": {
            "gold": {"priority": 0},
            "free": {"priority": 1, "pools": {"overflow": False, "failover": False}},
            "westward": {
                "priority": 0,
                "pools": {"order": [p for p in ("west", "east") if p in pools]},
            },
        },
        "tenants": {
            "westward": {"tier": "westward", "api_key_hashes": [hash_key(WESTWARD)]},
            "gold": {"tier": "gold", "api_key_hashes": [hash_key(GOLD)]},
            "free": {"tier": "free", "api_key_hashes": [hash_key(FREE)]},
        },
        "admin": {"enabled": True, "port": free_port(), "token_hash": hash_key(ADMIN_TOKEN)},
        "metrics": {"access": "public"},
        "fleet": {
            "liveness_interval_s": 0.25,
            "scrape_interval_s": 0.25,
            "deep_probe_interval_s": 30,
            "deep_probe_idle_interval_s": 30,
        },
        **extra,
    }


def replica(rid: str, url: str, pool: str) -> dict[str, Any]:
    return {"id": rid, "url": url, "model": MODEL, "pool": pool}


def admin_state(gw: Proc, cfg: dict[str, Any]) -> dict[str, Any]:
    r = httpx.get(
        f"http://127.0.0.1:{cfg['admin']['port']}/admin/state",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def serving(gw: Proc, cfg: dict[str, Any]) -> str | None:
    for p in admin_state(gw, cfg)["pools"]:
        if MODEL in p["serving"]:
            return str(p["pool"])
    return None


def routable(gw: Proc, cfg: dict[str, Any], rids: list[str]) -> bool:
    by_id = {r["id"]: r for r in admin_state(gw, cfg)["replicas"]}
    return all(by_id.get(rid, {}).get("routable") for rid in rids)


FAIL_BEFORE_FIRST_TOKEN = {"kind": "errors", "rate": 1.0, "when": "before_first_token"}


def gold_completions(gw: Proc, prompts: list[str]) -> list[int]:
    """One short completion per prompt as the gold tenant, one after another: statuses."""
    with httpx.Client(timeout=30) as c:
        return [
            c.post(
                gw.url + "/v1/completions",
                json={"model": MODEL, "prompt": p, "max_tokens": 2},
                headers={"Authorization": f"Bearer {GOLD}"},
            ).status_code
            for p in prompts
        ]


@dataclass
class Outcome:
    first_token: bool = False
    ok: bool = False
    status: int = 0
    error: str = ""


@dataclass
class Clients:
    """Closed-loop streaming clients of one tenant, until `stop` (bounded by `limit`)."""

    url: str
    key: str
    max_tokens: int = 20
    prompt: str = "pools"  # what a relay's bytes tell this tenant's requests by
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, n: int, limit_s: float = 60.0) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(limit_s,)) for _ in range(n)]
        for t in threads:
            t.start()
        return threads

    def _loop(self, limit_s: float) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens}
        body["stream"] = True
        body["ignore_eos"] = True
        end = time.monotonic() + limit_s
        with httpx.Client(timeout=30) as c:
            for _ in range(10_000):
                if self.stop.is_set() or time.monotonic() > end:
                    return
                o = Outcome()
                try:
                    with c.stream(
                        "POST",
                        self.url + "/v1/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {self.key}"},
                    ) as r:
                        o.status = r.status_code
                        data = b""
                        for chunk in r.iter_raw():
                            data += chunk
                            o.first_token = o.first_token or b'"text"' in data
                    o.ok = o.status == 200 and data.endswith(b"data: [DONE]\n\n")
                    o.ok = o.ok and b'"error"' not in data
                except httpx.HTTPError as e:
                    o.error = type(e).__name__
                self.outcomes.append(o)
                if o.status == 429:
                    time.sleep(0.05)


def test_losing_the_active_pool_fails_over_and_back_with_nothing_lost_before_a_token(
    artifacts: Path,
) -> None:
    """The standby region is another Seawall that wants an API key, which this gateway
    reads from its environment (`${WEST_API_KEY}`): its probes carry the key as its
    requests do, or the standby never becomes routable and a pool loss is a 503."""
    east_ports = [stable_port(), stable_port()]  # they come back on the same ports
    east = [start_sim(artifacts, name=f"east{i}", port=p) for i, p in enumerate(east_ports)]
    west_sim = start_sim(artifacts, name="west")
    west = start_gateway(
        artifacts,
        [west_sim],
        {"tenants": {"east-region": {"api_key_hashes": [hash_key(WEST_KEY)]}}},
        name="west-gateway",
    )
    with running(west, west_sim), ChoppingRelay(west.port or 0, piece=None, delay_s=WAN_S) as wan:
        probe = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(wan.url + "/v1/completions", json=probe, timeout=5).status_code == 401
        pools = {
            "east": {"priority": 0},
            "west": {"priority": 1, "mode": "passive", "timeouts": {"ttft_s": 30}},
        }
        replicas = [replica(f"e{i}", s.url, "east") for i, s in enumerate(east)]
        # Another gateway: no engine /metrics of its own to read, the deep probe decides.
        replicas.append(
            {**replica("w0", wan.url, "west"), "engine": "openai", "api_key": "${WEST_API_KEY}"}
        )
        cfg = config(pools, replicas)
        gw = start_gateway(artifacts, [], cfg, env={"WEST_API_KEY": WEST_KEY})
        with running(gw):
            wait_until(lambda: routable(gw, cfg, ["e0", "e1", "w0"]), 20, what="all routable")
            wait_until(lambda: serving(gw, cfg) == "east", 10, what="east serving")
            gold = Clients(gw.url, GOLD)
            threads = gold.run(4)
            try:
                wait_until(lambda: sum(o.ok for o in gold.outcomes) >= 8, 20, what="traffic")
                before_kill = len(gold.outcomes)
                # A passive pool takes no traffic while the active one is healthy.
                m = scrape(gw.url)
                assert metric_sum(m, "seawall_upstream_attempts_total", replica="w0") == 0
                # Every move the pools allow is a series at 0 before it happens, so that
                # Prometheus's increase() (and `seawall budget --from-prometheus`) sees
                # the first one.
                for family in ("seawall_pool_failovers_total", "seawall_pool_failbacks_total"):
                    for a, b in (("east", "west"), ("west", "east")):
                        key = f'{family}{{from_pool="{a}",model="{MODEL}",to_pool="{b}"}}'
                        assert m.get(key) == 0, key
                for s in east:
                    s.popen.send_signal(signal.SIGKILL)
                wait_until(lambda: serving(gw, cfg) == "west", 15, what="failover to west")
                # The tier that may not leave its pool is refused cleanly, and told when.
                r = httpx.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {FREE}"},
                    timeout=10,
                )
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "pool_unavailable"
                assert r.headers["retry-after"] == "7" and r.headers["x-should-retry"] == "true"
                wait_until(
                    lambda: sum(o.ok for o in gold.outcomes[before_kill:]) >= 6,
                    20,
                    what="gold served by the standby region",
                )
                # East comes back on the same addresses; traffic returns after the hold.
                # The hold cannot start before east's processes do: time it from there.
                east_started_wall = time.time()
                east = [
                    start_sim(artifacts, name=f"east{i}-again", port=p)
                    for i, p in enumerate(east_ports)
                ]
                wait_until(
                    lambda: routable(gw, cfg, ["e0"]) or routable(gw, cfg, ["e1"]),
                    20,
                    what="east routable",
                )
                assert serving(gw, cfg) == "west"  # not on the first healthy probe
                wait_until(lambda: serving(gw, cfg) == "east", 20, what="failback to east")
                wait_until(lambda: routable(gw, cfg, ["e0", "e1"]), 20, what="all east routable")
                # `seawall map` tells the operator where each model is served and what moved.
                admin = f"http://127.0.0.1:{cfg['admin']['port']}"
                shown = subprocess.run(
                    seawall_argv("map", "--admin", admin, "--admin-token", ADMIN_TOKEN),
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=True,
                ).stdout
                assert f"east (active, 2/2 routable serving {MODEL})" in shown, shown
                assert "west (passive, 1/1 routable)" in shown, shown
                assert "last move: failback west -> east" in shown, shown
                assert "default (" not in shown  # no pool that no replica is in
                # What the gateway recorded, read while east is still up (stopping it
                # below is a pool loss of its own).
                gold.stop.set()
                for t in threads:
                    t.join(timeout=40)
                events = [e for e in admin_state(gw, cfg)["pool_events"] if e["change"] != "first"]
                m = scrape(gw.url)
                written = yaml.safe_load(Path(str(gw.extra["config_path"])).read_text())
                ledger = sqlite3.connect(written["fleet"]["ledger_path"])
                query = "SELECT change, from_pool, to_pool FROM pool_events"
                wait_until(lambda: len(ledger.execute(query).fetchall()) >= 2, 10, what="ledger")
                rows = ledger.execute(query).fetchall()
            finally:
                gold.stop.set()
                for t in threads:
                    t.join(timeout=40)
                for s in east:
                    s.stop()
            failed = [o for o in gold.outcomes if not o.ok]
            # Anything that failed had its first token already (cut mid-stream by the
            # crash); nothing failed before it.
            assert all(o.first_token for o in failed), failed
            assert [(e["change"], e["from"], e["to"]) for e in events] == [
                ("failover", "east", "west"),
                ("failback", "west", "east"),
            ]
            hold = cfg["failover"]["failback_after_s"]
            assert events[1]["at_wall"] - east_started_wall >= hold  # the failback hold
            assert metric_sum(m, "seawall_pool_failovers_total", to_pool="west") == 1
            assert metric_sum(m, "seawall_pool_failbacks_total", to_pool="east") == 1
            assert metric_sum(m, "seawall_upstream_attempts_total", replica="w0", outcome="ok") > 0
            assert rows == [("failover", "east", "west"), ("failback", "west", "east")]


def test_overflow_keeps_preemptions_at_zero_and_sheds_only_the_tier_that_may_not_leave(
    artifacts: Path,
) -> None:
    small_kv = ("--kv-blocks", "160", "--max-model-len", "2048", "--step-base-ms", "10")
    east = start_sim(artifacts, *small_kv, name="east")
    west = [start_sim(artifacts, *small_kv, name=f"west{i}") for i in range(2)]
    relays = [ChoppingRelay(s.port or 0, piece=None, delay_s=WAN_S) for s in west]
    with running(east, *west), relays[0] as wan0, relays[1] as wan1:
        pools = {"east": {"priority": 0}, "west": {"priority": 1}}
        replicas = [replica("e0", east.url, "east")]
        replicas += [replica("w0", wan0.url, "west"), replica("w1", wan1.url, "west")]
        # Exact reservations: at 3x the first pool's capacity, nothing may preempt.
        cfg = config(pools, replicas, admission={"mode": "reserve"})
        gw = start_gateway(artifacts, [], cfg)
        with running(gw):
            wait_until(lambda: routable(gw, cfg, ["e0", "w0", "w1"]), 20, what="routable")
            # East holds about 11 of these (200 tokens each, 160 blocks of 16): 3x is 33.
            gold = Clients(gw.url, GOLD, 200, "pools gold")
            free = Clients(gw.url, FREE, 200, "pools free")
            threads = gold.run(17, limit_s=12) + free.run(16, limit_s=12)
            for t in threads:
                t.join(timeout=60)
            m = scrape(gw.url)
            for sim in (east, *west):
                assert metric_sum(scrape(sim.url), "vllm:num_preemptions_total") == 0
            assert metric_sum(m, "seawall_shed_total", tier="gold") == 0
            assert metric_sum(m, "seawall_shed_total", tier="free") > 0
            assert sum(o.ok for o in gold.outcomes) > 0 and sum(o.ok for o in free.outcomes) > 0
            west_ok = sum(
                metric_sum(m, "seawall_upstream_attempts_total", replica=r, outcome="ok")
                for r in ("w0", "w1")
            )
            assert west_ok > 0  # gold overflowed to the next region
            # ... and free never did: none of its requests crossed to the remote region.
            crossed = bytes(wan0.sent + wan1.sent)
            assert b"pools gold" in crossed and b"pools free" not in crossed
            # A tier with an order of its own starts in its own first pool, though the
            # fleet's first pool is healthy and idle now.
            for i in range(4):
                r = httpx.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": f"pools westward {i}", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {WESTWARD}"},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
            crossed = bytes(wan0.sent + wan1.sent)
            assert all(f"pools westward {i}".encode() in crossed for i in range(4))
            assert all(o.status in (200, 429) for o in gold.outcomes + free.outcomes)


def test_a_failing_remote_pool_is_cut_off_by_its_breaker_and_probed_at_its_own_rate(
    artifacts: Path,
) -> None:
    """The remote pool answers every request with a 500: after `failures` attempts its
    circuit opens and no more requests are sent there until the open time has passed;
    its replicas are deep-probed no more often than the pool allows."""
    west = start_sim(artifacts, name="west")
    with running(west), ChoppingRelay(west.port or 0, piece=None, delay_s=WAN_S) as wan:
        pools = {
            "west": {
                "priority": 0,
                "breaker": {"failures": 3, "open_s": 30},
                "deep_probe_min_interval_s": 4.0,
            }
        }
        fleet = {"liveness_interval_s": 0.25, "deep_probe_idle_interval_s": 0.25}
        cfg = config(pools, [replica("w0", wan.url, "west")])
        cfg["fleet"] = {**cfg["fleet"], **fleet, "deep_probe_interval_s": 0.25}
        gw = start_gateway(artifacts, [], cfg)
        with running(gw):
            wait_until(lambda: routable(gw, cfg, ["w0"]), 20, what="w0 routable")
            probes_at_start = wan.sent.count(b"POST /v1/completions")
            started = time.monotonic()
            set_fault(west, FAIL_BEFORE_FIRST_TOKEN)
            statuses = gold_completions(gw, ["x"] * 12)
            attempts = metric_sum(scrape(gw.url), "seawall_upstream_attempts_total", replica="w0")
            assert attempts == 3, statuses  # the breaker opened after three failures
            assert statuses[:3] == [500] * 3 and set(statuses[3:]) == {503}
            time.sleep(max(0.0, 6.0 - (time.monotonic() - started)))
            sent = wan.sent.count(b"POST /v1/completions") - probes_at_start
            # Three requests plus, in 6 s, at most two deep probes at one per 4 s.
            assert sent <= 3 + 2, sent


def test_a_remote_pool_has_timeouts_of_its_own(artifacts: Path) -> None:
    """The gateway's timeouts are sized for its own region (first token in 1 s, a gap of
    1 s between tokens); the remote region, reached over a WAN and slower per step, gets
    the budgets its pool names, for the first token and for the stream after it."""
    east = start_sim(artifacts, name="east")
    west = start_sim(artifacts, "--step-base-ms", "1300", name="west")  # a 1.3 s step
    with running(east, west), ChoppingRelay(west.port or 0, piece=None, delay_s=0.2) as wan:
        pools = {
            "east": {"priority": 0},
            "west": {"priority": 1, "timeouts": {"ttft_s": 10, "itl_s": 5}},
        }
        replicas = [replica("e0", east.url, "east"), replica("w0", wan.url, "west")]
        cfg = config(pools, replicas, timeouts={"ttft_s": 1, "itl_s": 1, "total_s": 60})
        cfg["fleet"] = {**cfg["fleet"], "deep_probe_timeout_s": 10}
        gw = start_gateway(artifacts, [], cfg)
        with running(gw):
            wait_until(lambda: routable(gw, cfg, ["e0", "w0"]), 30, what="routable")
            body = {"model": MODEL, "prompt": "pools westward", "max_tokens": 3,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            started = time.monotonic()
            r = httpx.post(
                gw.url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {WESTWARD}"},  # west first
                timeout=60,
            )
            took = time.monotonic() - started
            assert r.status_code == 200, r.text
            assert r.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in r.content
            assert took > 2.5  # it really ran in the slow region, past both local budgets
            m = scrape(gw.url)
            assert metric_sum(m, "seawall_upstream_attempts_total", replica="w0", outcome="ok") == 1
            assert metric_sum(m, "seawall_upstream_attempts_total", replica="e0") == 0


def test_retries_into_another_pool_spend_the_one_fleet_wide_budget(artifacts: Path) -> None:
    """East answers every request with a 500 before its first token. A retry in west costs
    the same budget as a retry within a pool: with a reserve of one token, the first
    request is saved in west and the next ones get east's error, not a free pass west."""
    east = start_sim(artifacts, name="east")
    west = start_sim(artifacts, name="west")
    with running(east, west), ChoppingRelay(west.port or 0, piece=None, delay_s=WAN_S) as wan:
        pools = {"east": {"priority": 0}, "west": {"priority": 1}}
        replicas = [replica("e0", east.url, "east"), replica("w0", wan.url, "west")]
        # A reserve of exactly one token (0.1/s over 10 s), no earning in this short test.
        retry = {"budget_ratio": 0.0, "budget_min_per_s": 0.1, "budget_reserve_window_s": 10}
        cfg = config(pools, replicas, retry=retry)
        gw = start_gateway(artifacts, [], cfg)
        with running(gw):
            wait_until(lambda: routable(gw, cfg, ["e0", "w0"]), 20, what="routable")
            set_fault(east, FAIL_BEFORE_FIRST_TOKEN)
            statuses = gold_completions(gw, [f"budget {i}" for i in range(3)])
            m = scrape(gw.url)
    assert statuses == [200, 500, 500], statuses
    assert metric_sum(m, "seawall_upstream_attempts_total", replica="w0", outcome="ok") == 1
    assert metric_sum(m, "seawall_retries_total") == 1
    assert metric_sum(m, "seawall_retry_budget_exhausted_total") == 2
