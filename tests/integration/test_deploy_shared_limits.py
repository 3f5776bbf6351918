"""The shipped Kubernetes manifests, as applied, make one fleet of the gateway pods and
an actuator pod, sharing one tenant's limit and the fleet's state through Redis.

Three real `seawall serve` processes load the ConfigMap's own `gateway.yaml` with the
environment the gateway Deployment gives its pods, and one more with the actuator
Deployment's. The only changes are the ones a loopback run needs: listen on 127.0.0.1
and a free port (the admin API on port 0), list the sims as replicas instead of
discovering them through the API server, elect through the Redis instead of a Lease
and act through no actuator (there is no API server here; the Lease election runs in
test_cluster_kubernetes.py against a loopback one), give each pod its name and
127.0.0.1 for the downward API, and point `SEAWALL_REDIS_URL` at a real redis-server
on loopback. Requests go round-robin to the three serving pods, as the Service spreads
them.
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
from tests.support.fleet import MODEL, running, start_sim, wait_until
from tests.support.procs import REPO, Proc, free_port, seawall_argv, spawn, wait_http
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MANIFESTS = REPO / "deploy" / "kubernetes"
GATEWAYS = 3


def _objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def _pod_env(file: str, pod: str, redis_url: str, key_hash: str) -> dict[str, str]:
    [deployment] = [d for d in _objects(file) if d["kind"] == "Deployment"]
    env = {}
    for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:  # the downward API
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod, "status.podIP": "127.0.0.1"}[path]
        else:  # a key hash, from the seawall-tenant-keys Secret
            env[e["name"]] = key_hash
    assert env["SEAWALL_REDIS_URL"].startswith("redis://seawall-redis.")
    env["SEAWALL_REDIS_URL"] = redis_url
    if env["SEAWALL_ACTUATOR"] == "kubernetes":
        env["SEAWALL_ACTUATOR"] = "none"  # no API server to act through here
    return env


def _loopback_config(port: int, sims: list[Proc]) -> dict[str, Any]:
    [cm] = _objects("gateway-config.yaml")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["gateway.yaml"])
    config["listen"] = {"host": "127.0.0.1", "port": port}
    config["admin"]["port"] = 0
    assert config["cluster"]["election"] == "kubernetes"
    config["cluster"]["election"] = "store"  # no API server for a Lease here
    fleet = config["fleet"]
    assert fleet.pop("discovery")["mode"] == "endpointslices"
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
    pods: list[Proc] = []
    for file, pod in [
        ("actuator.yaml", "seawall-actuator-0"),
        *(("gateway.yaml", f"seawall-gateway-{i}") for i in range(GATEWAYS)),
    ]:
        port = free_port()
        path = artifacts / f"{pod}.yaml"
        config = _loopback_config(port, sims)
        path.write_text(yaml.safe_dump(config))
        pods.append(
            spawn(
                seawall_argv("serve", "--config", str(path), "--no-access-log"),
                artifacts / f"{pod}.log",
                port=port,
                env=_pod_env(file, pod, redis_server.url, hash_key(key)),
            )
        )
    actuator, gateways = pods[0], pods[1:]
    limit = int(config["tiers"][config["tenants"]["example"]["tier"]]["requests_per_min"])
    attempts = 2 * limit
    with running(*pods, *sims), httpx.Client(timeout=30) as client:
        for gw in pods:
            wait_http(gw.url + "/readyz?fleet=1", timeout=30, proc=gw)

        # One fleet of four: the actuator pod leads, every serving pod follows it (a pod
        # may see the four instances a heartbeat before it reads who leads them).
        def settled(gw: Proc) -> bool:
            cluster = client.get(gw.url + "/readyz").json()["cluster"]
            return bool(cluster["instances"] == 4 and cluster["leader"])

        for gw in pods:
            wait_until(
                lambda gw=gw: settled(gw), 15, what=f"four instances and a leader seen by {gw.url}"
            )
        roles = {gw.url: client.get(gw.url + "/readyz").json()["cluster"] for gw in pods}
        assert roles[actuator.url]["role"] == "leader", roles
        assert all(roles[gw.url]["role"] == "follower" for gw in gateways), roles
        assert {c["leader"] for c in roles.values()} == {"seawall-actuator-0"}
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
