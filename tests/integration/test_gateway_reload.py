"""Reload without restart (issue 14): SIGHUP (and, when asked, a change of the file)
applies tenants, keys, tiers and replicas at once, refuses a bad file and keeps the
running configuration, and disturbs no request in flight.

The first tests run the composition root in-process (its fleet monitor started, probing
loopback ports) to see each replica step exactly; the others run `seawall serve` as a
real process with `seawall sim` replicas and send it real signals."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key
from seawall.config import parse_config
from seawall.gateway.app import Gateway
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

A, B, C = (f"sk-sw-reload-{n}-" + "0" * 36 for n in "abc")


def config(tmp: Path, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": [
            {"url": "http://127.0.0.1:9001", "model": "m", "id": "r0"},
            {"url": "http://127.0.0.1:9002", "model": "m", "id": "r1"},
        ],
        "fleet": {"ledger_path": str(tmp / "ledger.sqlite")},
    }
    return {**base, **over}


async def started(tmp: Path) -> Gateway:
    gw = Gateway(parse_config(config(tmp)), access_log=False)
    await gw.monitor.start()
    return gw


async def test_replicas_join_leave_after_draining_and_change_in_place(tmp_path: Path) -> None:
    gw = await started(tmp_path)
    r1_hold = gw.ledger.hold("r1")  # a request in flight on r1
    new = config(
        tmp_path,
        replicas=[
            {"url": "http://127.0.0.1:9001", "model": "m", "id": "r0", "api_key": "k2"},
            {"url": "http://127.0.0.1:9003", "model": "m", "id": "r2"},
        ],
        timeouts={"ttft_s": 5},
    )
    report = gw.reload(parse_config(new))
    assert str(report.replicas) == "+r2 -r1 ~r0"
    assert report.not_applied == ("timeouts",)
    r0 = gw.replicas.get("r0")
    assert r0 is not None and r0.api_key == "k2"  # the same engine: changed in place
    assert gw.replicas.get("r2") is not None and gw.monitor.watches("r2")
    # r1 is held out of routing before reload() returns, and stays while its request runs.
    assert gw.monitor.snapshot().replicas["r1"].held and gw.replicas.get("r1") is not None
    await asyncio.sleep(0)
    assert gw.replicas.get("r1") is not None
    r1_hold.release()
    await asyncio.wait_for(asyncio.gather(*gw._retiring.values()), 5)
    assert gw.replicas.get("r1") is None and not gw.monitor.watches("r1")
    await gw.close()


async def test_a_replica_that_moved_drains_then_joins_at_its_new_address(tmp_path: Path) -> None:
    gw = await started(tmp_path)
    hold = gw.ledger.hold("r0")
    moved = config(
        tmp_path,
        replicas=[
            {"url": "http://127.0.0.1:9101", "model": "m", "id": "r0"},
            {"url": "http://127.0.0.1:9002", "model": "m", "id": "r1"},
        ],
    )
    assert str(gw.reload(parse_config(moved)).replicas) == "~r0"
    r0 = gw.replicas.get("r0")
    assert r0 is not None and r0.url == "http://127.0.0.1:9001"  # the old one, draining
    assert gw.monitor.snapshot().replicas["r0"].held
    hold.release()
    await asyncio.wait_for(asyncio.gather(*gw._retiring.values()), 5)
    r0 = gw.replicas.get("r0")
    assert r0 is not None and r0.url == "http://127.0.0.1:9101"
    assert not gw.monitor.snapshot().replicas["r0"].held  # a new replica, not held
    await gw.close()


# -- a real `seawall serve` ----------------------------------------------------------------


def tenants(**keys: tuple[str, str]) -> dict[str, Any]:
    return {
        name: {"tier": tier, "api_key_hashes": [hash_key(key)]}
        for name, (key, tier) in keys.items()
    }


def rewrite(gw: Proc, change: dict[str, Any]) -> None:
    path = Path(str(gw.extra["config_path"]))
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **change}))


def ask(http: httpx.Client, key: str, max_tokens: int = 4) -> int:
    body = {"model": MODEL, "prompt": "Sea walls", "max_tokens": max_tokens}
    r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return r.status_code


def attempts_on(gw: Proc, rid: str) -> float:
    return metric_sum(scrape(gw.url), "seawall_upstream_attempts_total", replica=rid)


def test_sighup_applies_the_new_file_and_refuses_a_bad_one(artifacts: Path) -> None:
    sims = [start_sim(artifacts, "--step-base-ms", "20", name=f"s{i}") for i in range(2)]
    replicas = [{"url": s.url, "model": MODEL, "id": f"r{i}"} for i, s in enumerate(sims)]
    gw = start_gateway(
        artifacts,
        [],
        {
            "replicas": replicas,
            "tiers": {"small": {"max_tokens": 10}},
            "tenants": tenants(alpha=(A, "small"), beta=(B, "default")),
            "fleet": {"liveness_interval_s": 0.25},
            "metrics": {"access": "public"},  # the test reads the gateway's counters
        },
    )
    with running(gw, *sims), httpx.Client(base_url=gw.url, timeout=30) as http:
        assert (ask(http, A, 50), ask(http, B), ask(http, C)) == (400, 200, 401)

        # A long stream in flight on one replica; the new file drops that replica.
        long_body = {
            "model": MODEL, "prompt": "Tell a story", "max_tokens": 120, "stream": True,
            "ignore_eos": True,
        }  # fmt: skip
        with http.stream(
            "POST", "/v1/completions", json=long_body, headers={"Authorization": f"Bearer {B}"}
        ) as stream:
            chunks = stream.iter_raw()
            got = next(chunks)
            victim = next(
                i
                for i, s in enumerate(sims)
                if metric_sum(scrape(s.url), "vllm:num_requests_running")
            )
            survivor = 1 - victim
            rewrite(
                gw,
                {
                    "replicas": [replicas[survivor]],
                    "tiers": {"small": {"max_tokens": 100}},
                    "tenants": tenants(alpha=(A, "small"), gamma=(C, "default")),
                },
            )
            gw.signal(signal.SIGHUP)
            wait_until(lambda: "reload (SIGHUP) applied" in gw.log(), 10, what="the reload")
            before = attempts_on(gw, f"r{survivor}")
            # The new tenant's key works, the removed one's does not, the tier's new limit
            # applies; and every new request goes to the replica that stayed (two reach a
            # replica: the 401 is answered by the gateway).
            assert (ask(http, C), ask(http, B), ask(http, A, 50)) == (200, 401, 200)
            assert attempts_on(gw, f"r{survivor}") == before + 2
            got += b"".join(chunks)  # the stream in flight was not disturbed
        assert got.endswith(b"data: [DONE]\n\n") and b'"error"' not in got
        assert got.count(b'"text"') >= 100
        # Drained, the removed replica leaves the fleet.
        wait_until(
            lambda: http.get("/readyz").json()["fleet"]["replicas"] == 1, 10, what="the drain"
        )
        assert "+gamma -beta" in gw.log() and f"-r{victim}" in gw.log()

        # A file that does not validate is refused with one clear line; nothing changes.
        rewrite(gw, {"tenants": {"gamma": {"tier": "gold", "api_key_hashes": [hash_key(C)]}}})
        gw.signal(signal.SIGHUP)
        wait_until(lambda: "reload (SIGHUP) refused" in gw.log(), 10, what="the refusal")
        refusal = next(line for line in gw.log().splitlines() if "refused" in line)
        assert "tenants.gamma.tier: unknown tier 'gold'" in refusal
        assert "the running configuration stays" in refusal
        assert (ask(http, C), ask(http, B), ask(http, A, 50)) == (200, 401, 200)


def test_watch_config_reloads_when_the_file_changes(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(
        artifacts,
        [sim],
        {"tenants": tenants(alpha=(A, "default"))},
        args=["--watch-config", "0.2"],
    )
    with running(gw, sim), httpx.Client(base_url=gw.url, timeout=30) as http:
        assert ask(http, C) == 401
        rewrite(gw, {"tenants": tenants(alpha=(A, "default"), gamma=(C, "default"))})
        wait_until(lambda: "reload (the file changed) applied" in gw.log(), 10, what="the watch")
        assert ask(http, C) == 200 and ask(http, A) == 200
