"""The Kubernetes manifests agree with what the gateway and vLLM actually serve.

A probe on the wrong path or port, or a grace period shorter than the preStop sleep,
only shows up in a cluster at the worst time; these checks catch it at review.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import seawall.gateway.app
from seawall.config import parse_config
from seawall.fleet.config import FleetMonitorConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def all_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    matches = [o for _, o in all_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0]


def pre_stop_sleep_s(c: dict[str, Any]) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_every_file_parses_and_every_object_is_named() -> None:
    objects = all_objects()
    assert {name for name, _ in objects} >= {
        "gateway.yaml",
        "gateway-config.yaml",
        "redis.yaml",
        "vllm.yaml",
    }
    for name, obj in objects:
        assert obj.get("apiVersion"), name
        assert obj.get("kind"), name
        assert obj.get("metadata", {}).get("name"), name


def test_gateway_probes_hit_routes_the_gateway_serves_on_its_port() -> None:
    gateway = one("Deployment", "seawall-gateway")
    c = container(gateway)
    port = c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    source = Path(seawall.gateway.app.__file__).read_text()
    assert 'add_get("/readyz"' in source and 'add_get("/healthz"' in source
    config = parse_config(
        yaml.safe_load(one("ConfigMap", "seawall-gateway")["data"]["gateway.yaml"])
    )
    assert config.listen.port == port
    assert config.listen.host == "0.0.0.0"  # reachable from the kubelet and the Service
    service = one("Service", "seawall-gateway")
    assert service["spec"]["ports"][0]["targetPort"] == port
    assert any(e["name"] == "SEAWALL_REDIS_URL" for e in c["env"])
    assert gateway["spec"]["replicas"] >= 2


def test_gateway_config_fleet_section_is_valid() -> None:
    data = yaml.safe_load(one("ConfigMap", "seawall-gateway")["data"]["gateway.yaml"])
    fleet = FleetMonitorConfig.model_validate(data["fleet"])
    vllm_service = one("Service", "vllm")
    assert fleet.discovery is not None
    assert fleet.discovery.service == vllm_service["metadata"]["name"]
    assert fleet.discovery.port == vllm_service["spec"]["ports"][0]["port"]


def test_vllm_probes_use_health_on_the_container_port_with_a_generous_startup() -> None:
    c = container(one("Deployment", "vllm"))
    port = c["ports"][0]["containerPort"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port}, probe
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1200
    headless = one("Service", "vllm")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["targetPort"] == port


@pytest.mark.parametrize("name", ["vllm", "seawall-gateway"])
def test_rollouts_never_remove_capacity_first(name: str) -> None:
    strategy = one("Deployment", name)["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_grace_periods_cover_the_pre_stop_sleep_and_the_drain() -> None:
    vllm = one("Deployment", "vllm")
    c = container(vllm)
    grace = vllm["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown_s = next(
        int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--shutdown-timeout=")
    )
    assert grace > pre_stop_sleep_s(c) + shutdown_s
    data = yaml.safe_load(one("ConfigMap", "seawall-gateway")["data"]["gateway.yaml"])
    config = parse_config(data)
    assert shutdown_s >= config.timeouts.total_s  # the longest stream can finish

    gateway = one("Deployment", "seawall-gateway")
    g = container(gateway)
    g_grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert g_grace > pre_stop_sleep_s(g) + config.drain.timeout_s


def test_selectors_match_the_pods_they_select() -> None:
    for kind, name, deployment in [
        ("Service", "seawall-gateway", "seawall-gateway"),
        ("Service", "vllm", "vllm"),
        ("Service", "seawall-redis", "seawall-redis"),
    ]:
        labels = one("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
        selector = one(kind, name)["spec"]["selector"]
        assert selector.items() <= labels.items(), name
    pdb = one("PodDisruptionBudget", "seawall-gateway")
    gateway = one("Deployment", "seawall-gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < gateway["spec"]["replicas"]
