"""The shipped Kubernetes manifests, as applied, share one tenant's limit across the
three gateway pods through Redis.

Three real `seawall serve` processes load the ConfigMap's own `gateway.yaml` with the
environment the gateway Deployment gives its pods. The only changes are the ones a
loopback run needs: listen on 127.0.0.1 and a free port, list the sims as replicas
instead of discovering them through the API server, keep the ledger in the test's
folder, and point `SEAWALL_REDIS_URL` at a real redis-server on loopback. Requests go
round-robin to the three, as the Service spreads them.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key, new_key
from tests.support.fleet import MODEL, running, start_sim
from tests.support.procs import REPO, Proc, free_port, seawall_argv, spawn, wait_http
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MANIFESTS = REPO / "deploy" / "kubernetes"
GATEWAYS = 3


def _objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def _gateway_env(redis_url: str, key_hash: str) -> dict[str, str]:
    [deployment] = [d for d in _objects("gateway.yaml") if d["kind"] == "Deployment"]
    env = {}
    for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:  # the tenant key hash, from the seawall-tenant-keys Secret
            env[e["name"]] = key_hash
    assert env["SEAWALL_REDIS_URL"].startswith("redis://seawall-redis.")
    env["SEAWALL_REDIS_URL"] = redis_url  # the one substitution in the environment
    return env


def _loopback_config(port: int, sims: list[Proc], ledger: Path) -> dict[str, Any]:
    [cm] = _objects("gateway-config.yaml")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["gateway.yaml"])
    config["listen"] = {"host": "127.0.0.1", "port": port}
    fleet = config["fleet"]
    assert fleet.pop("discovery")["mode"] == "endpointslices"
    fleet["ledger_path"] = str(ledger)
    config["replicas"] = [
        {"url": s.url, "model": MODEL, "id": f"sim{i}", "node": f"node-{i}"}
        for i, s in enumerate(sims)
    ]
    return config


def test_one_tenants_limit_holds_across_three_gateways(
    artifacts: Path, redis_server: RedisServer
) -> None:
    key = new_key()
    sims = [start_sim(artifacts, name=f"sim{i}") for i in range(2)]
    gateways: list[Proc] = []
    env = _gateway_env(redis_server.url, hash_key(key))
    for i in range(GATEWAYS):
        port = free_port()
        path = artifacts / f"gateway-{i}.yaml"
        config = _loopback_config(port, sims, artifacts / f"ledger-{i}.sqlite")
        path.write_text(yaml.safe_dump(config))
        gateways.append(
            spawn(
                seawall_argv("serve", "--config", str(path), "--no-access-log"),
                artifacts / f"gateway-{i}.log",
                port=port,
                env=env,
            )
        )
    limit = int(config["tiers"][config["tenants"]["example"]["tier"]]["requests_per_min"])
    attempts = 2 * limit
    with running(*gateways, *sims), httpx.Client(timeout=30) as client:
        for gw in gateways:
            wait_http(gw.url + "/readyz?fleet=1", timeout=30, proc=gw)
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        admitted: dict[str, int] = {gw.url: 0 for gw in gateways}
        refused: list[httpx.Response] = []
        started = time.monotonic()
        for gw in itertools.islice(itertools.cycle(gateways), attempts):
            r = client.post(gw.url + "/v1/completions", json=body, headers=headers)
            if r.status_code == 200:
                admitted[gw.url] += 1
            else:
                assert r.status_code == 429, r.text
                refused.append(r)
        elapsed_s = time.monotonic() - started
        degraded = [
            line
            for gw in gateways
            # Every Secret value here is the tenant's key hash, so its key also
            # passes as the scrape credential (metrics.token_hash).
            for line in client.get(gw.url + "/metrics", headers=headers).text.splitlines()
            if line.startswith("seawall_ratelimit_backend_degraded ")
        ]

    # One bucket of `limit` for the tenant, refilled at limit/60 per second while the
    # test ran. Alone, each gateway would have admitted its third of 2 x limit: all.
    allowed = limit + math.ceil(elapsed_s * limit / 60) + 1
    total = sum(admitted.values())
    assert limit <= total <= allowed, (admitted, elapsed_s)
    assert all(n > 0 for n in admitted.values()), admitted  # every pod served some
    assert len(refused) == attempts - total
    error = refused[-1].json()["error"]
    assert error["code"] == "rate_limit_exceeded" and float(refused[-1].headers["retry-after"]) > 0
    assert degraded == ["seawall_ratelimit_backend_degraded 0.0"] * GATEWAYS
