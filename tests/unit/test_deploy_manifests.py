"""The Kubernetes manifests agree with what the gateway and vLLM actually serve and call.

A probe on the wrong path or port, a grace period shorter than the drain, an RBAC rule
the code never uses or a scrape job that selects no pod only shows up in a cluster at
the worst time; these checks catch it at review.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

import seawall.actuate.kubernetes
import seawall.cluster.kube
import seawall.fleet.discovery
import seawall.gateway.app
from seawall import envref
from seawall.config import GatewayConfig, parse_config
from tests.support import prometheus_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
IMAGE = "ghcr.io/seawall/seawall"
# Every grace period is its drain plus this much for the process to exit.
GRACE_MARGIN_S = 10
EXAMPLE_KEY_HASH = "sha256:" + "0" * 64


def all_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def one(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    matches = [
        o
        for _, o in all_objects()
        if o["kind"] == kind
        and o["metadata"]["name"] == name
        and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def pre_stop_sleep_s(c: dict[str, Any]) -> int:
    if "lifecycle" not in c:
        return 0
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def config_data() -> Any:
    return yaml.safe_load(one("ConfigMap", "seawall-gateway")["data"]["gateway.yaml"])


def pod_env(deployment: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it; Secret values are made up."""
    env = {}
    for e in container(deployment).get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
        else:
            assert e["valueFrom"]["secretKeyRef"]["name"] == "seawall-tenant-keys"
            env[e["name"]] = EXAMPLE_KEY_HASH
    return env


def config_in(deployment_name: str) -> GatewayConfig:
    """The ConfigMap's config as the named Deployment's pods load it."""
    deployment = one("Deployment", deployment_name)
    return parse_config(envref.resolve(config_data(), env=pod_env(deployment)))


def test_every_file_parses_and_every_object_is_named() -> None:
    objects = all_objects()
    assert {name for name, _ in objects} >= {
        "actuator.yaml",
        "gateway.yaml",
        "gateway-config.yaml",
        "rbac.yaml",
        "redis.yaml",
        "vllm.yaml",
    }
    for name, obj in objects:
        assert obj.get("apiVersion"), name
        assert obj.get("kind"), name
        assert obj.get("metadata", {}).get("name"), name


def test_the_config_references_only_variables_every_pod_sets() -> None:
    for name in ("seawall-gateway", "seawall-actuator"):
        env = pod_env(one("Deployment", name))
        envref.resolve(config_data(), env=env)  # raises on a variable the pod lacks
    with pytest.raises(envref.EnvRefError, match=r"variable SEAWALL_\w+ is not set"):
        envref.resolve(config_data(), env={})


def test_gateway_probes_hit_routes_the_gateway_serves_on_its_port() -> None:
    gateway = one("Deployment", "seawall-gateway")
    c = container(gateway)
    port = c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    source = Path(seawall.gateway.app.__file__).read_text()
    assert 'add_get("/readyz"' in source and 'add_get("/healthz"' in source
    config = config_in("seawall-gateway")
    assert config.listen.port == port
    assert config.listen.host == "0.0.0.0"  # reachable from the kubelet and the Service
    service = one("Service", "seawall-gateway")
    assert service["spec"]["ports"][0]["targetPort"] == port
    assert gateway["spec"]["replicas"] >= 2


def test_gateway_readiness_tolerates_a_slow_answer() -> None:
    # Readiness fails only while draining (the fleet's state does not count), so a
    # single slow probe under load must not pull a healthy gateway from the Service.
    probe = container(one("Deployment", "seawall-gateway"))["readinessProbe"]
    assert probe["failureThreshold"] >= 2
    assert probe.get("timeoutSeconds", 1) >= 2


def test_gateway_config_fleet_section_is_valid() -> None:
    fleet = config_in("seawall-gateway").fleet
    vllm_service = one("Service", "vllm")
    assert fleet.discovery is not None
    assert fleet.discovery.service == vllm_service["metadata"]["name"]
    assert fleet.discovery.namespace == vllm_service["metadata"]["namespace"]
    assert fleet.discovery.port == vllm_service["spec"]["ports"][0]["port"]


def test_limits_are_shared_through_the_redis_the_manifests_run() -> None:
    for name in ("seawall-gateway", "seawall-actuator"):
        config = config_in(name)
        tiers, tenants, rate = config.tiers, config.tenants, config.ratelimit
        assert rate.backend == "redis"
        redis = one("Service", "seawall-redis")
        host = f"{redis['metadata']['name']}.{redis['metadata']['namespace']}.svc"
        assert rate.redis_url == f"redis://{host}:{redis['spec']['ports'][0]['port']}/0"
        assert tenants and all(tiers[t.tier].requests_per_min for t in tenants.values())


def test_one_elected_leader_acts_and_only_an_actuator_pod_can_be_it() -> None:
    gateway = config_in("seawall-gateway")
    actuator = config_in("seawall-actuator")
    # The serving pods follow: no actuator, never a candidate.
    assert gateway.fleet.actuator == "none" and gateway.cluster.may_lead is False
    assert actuator.fleet.actuator == "kubernetes" and actuator.cluster.may_lead is True
    deployment = one("Deployment", "seawall-actuator")
    # Two candidates (one node lost is one fail-over, not a fleet without a leader);
    # a rolling update may run two at once: the Lease elects one.
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pdb = one("PodDisruptionBudget", "seawall-actuator")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert pod_spec(deployment)["serviceAccountName"] == "seawall-actuator"
    assert pod_spec(one("Deployment", "seawall-gateway"))["serviceAccountName"] == (
        "seawall-gateway"
    )
    # The pods with the power take no client traffic.
    service_selectors = [
        o["spec"].get("selector", {}) for _, o in all_objects() if o["kind"] == "Service"
    ]
    assert not any(s and s.items() <= labels.items() for s in service_selectors)


@pytest.mark.parametrize("name", ["seawall-gateway", "seawall-actuator"])
def test_every_instance_is_one_fleet_through_the_lease_and_the_shipped_redis(name: str) -> None:
    deployment = one("Deployment", name)
    namespace = deployment["metadata"]["namespace"]
    cc = config_in(name).cluster
    redis = one("Service", "seawall-redis")
    host = f"{redis['metadata']['name']}.{redis['metadata']['namespace']}.svc"
    assert cc.store == "redis"
    assert cc.redis_url == f"redis://{host}:{redis['spec']['ports'][0]['port']}/0"
    assert cc.election == "kubernetes"
    assert cc.lease_namespace == namespace
    # The instance is named after its pod and advertises an address other pods reach:
    # the pod's IP, at the admin API's port (a follower forwards operator actions there).
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container(deployment)["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    assert fields == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    assert cc.instance_id is None and cc.advertise_admin_url is None  # so: $POD_NAME, $POD_IP
    admin = config_in(name).admin
    assert admin.enabled and admin.host == "0.0.0.0" and admin.token_hash
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    assert ports["admin"] == admin.port
    # Nothing routes clients to the admin port.
    for _, o in all_objects():
        if o["kind"] == "Service":
            assert all(p["targetPort"] != admin.port for p in o["spec"]["ports"])


def test_vllm_probes_use_health_on_the_container_port_with_a_startup_sized_for_loading() -> None:
    c = container(one("Deployment", "vllm"))
    port = c["ports"][0]["containerPort"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port}, probe
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1200
    headless = one("Service", "vllm")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["targetPort"] == port


def test_vllm_has_requests_a_disruption_budget_and_spreads_across_nodes() -> None:
    vllm = one("Deployment", "vllm")
    requests = container(vllm)["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    pdb = one("PodDisruptionBudget", "vllm")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < vllm["spec"]["replicas"]
    terms = pod_spec(vllm)["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
        for t in terms
    )


@pytest.mark.parametrize("name", ["vllm", "seawall-gateway", "seawall-actuator"])
def test_rollouts_never_remove_capacity_first(name: str) -> None:
    strategy = one("Deployment", name)["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize("name", ["seawall-gateway", "seawall-actuator"])
def test_gateway_grace_period_is_pre_stop_plus_drain_timeout(name: str) -> None:
    deployment = one("Deployment", name)
    config = config_in(name)
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    pre_stop = pre_stop_sleep_s(container(deployment))
    assert grace == pre_stop + config.drain.timeout_s + GRACE_MARGIN_S


def test_vllm_drain_numbers_follow_the_gateways() -> None:
    vllm = one("Deployment", "vllm")
    c = container(vllm)
    config = config_in("seawall-gateway")
    fleet = config.fleet
    assert fleet.discovery is not None
    shutdown_s = next(
        int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--shutdown-timeout=")
    )
    # Every gateway sees the pod leave its EndpointSlice before vLLM stops taking work.
    assert pre_stop_sleep_s(c) == 2 * fleet.discovery.interval_s + GRACE_MARGIN_S
    assert shutdown_s == config.timeouts.total_s  # the longest stream can finish
    grace = pod_spec(vllm)["terminationGracePeriodSeconds"]
    assert grace == pre_stop_sleep_s(c) + shutdown_s + GRACE_MARGIN_S


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


def test_seawall_images_are_the_one_the_dockerfile_builds() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    images = {
        c["image"]
        for _, o in all_objects()
        if o["kind"] == "Deployment"
        for c in pod_spec(o)["containers"]
        if c["image"].startswith(IMAGE)
    }
    assert images == {f"{IMAGE}:{version}"}
    assert (REPO / "Dockerfile").exists()
    assert f"docker build -t {IMAGE}:{version} ." in (REPO / "deploy" / "README.md").read_text()


# -- RBAC: exactly what the code calls ------------------------------------------------

_VERBS = {"list": "list", "read": "get", "create": "create", "delete": "delete",
          "patch": "patch", "replace": "update", "watch": "watch"}  # fmt: skip
_GROUPS = {
    "CoreV1Api": "",
    "DiscoveryV1Api": "discovery.k8s.io",
    "CoordinationV1Api": "coordination.k8s.io",
}
_CLUSTER_SCOPED = {"nodes"}
# Verbs on one named object (RBAC's resourceNames can narrow these, never create or list).
_NAMED_VERBS = {"read", "replace", "patch", "delete"}
# (namespace or "*" for cluster, group, resource, verb, resource name or "*" for any)
Permission = tuple[str, str, str, str, str]
ANY = "*"


def _plural(snake: str) -> str:
    return snake.replace("_", "") + "s"


def _source(node: ast.AST) -> str:
    return ast.unparse(node)


def api_calls(
    module: Any,
    namespace: str,
    entry: tuple[str, ...] = (),
    names: dict[str, str] | None = None,
) -> set[Permission]:
    """The permissions the module's API calls need: `self.<attr>.<verb>_[namespaced_]<kind>`
    on attributes assigned a kubernetes_asyncio API class, called there or passed as the
    first argument of a wrapper (`self._call(api.read_..., name, namespace)`).

    A namespaced call's namespace argument (the first for list and create, the second
    for calls on one object) is a module constant when it is one, else the deployment's.
    The object's name is `names[source]` when the argument's source is in `names` (the
    one Lease, `self.name`), else any. With `entry`, only the functions reachable from
    those (through `self.<function>` references) count: what an instance that only
    follows calls, against what a candidate calls."""
    tree = ast.parse(Path(module.__file__).read_text())
    constants = {
        t.id: n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    apis: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            func = n.value.func
            if isinstance(func, ast.Attribute) and func.attr in _GROUPS:
                for t in n.targets:
                    if isinstance(t, ast.Attribute):
                        apis[t.attr] = _GROUPS[func.attr]
    functions = {
        f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    scanned: list[ast.AST] = [tree]
    if entry:
        reached, todo = set(entry), list(entry)
        while todo:
            for n in ast.walk(functions[todo.pop()]):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                    and n.attr in functions
                    and n.attr not in reached
                ):
                    reached.add(n.attr)
                    todo.append(n.attr)
        scanned = [functions[name] for name in reached]

    def api_method(node: ast.AST) -> ast.Attribute | None:
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in apis
        ):
            return node
        return None

    found: set[Permission] = set()
    for root in scanned:
        for n in ast.walk(root):
            if not isinstance(n, ast.Call):
                continue
            method, args = api_method(n.func), n.args
            if method is None and n.args:
                method, args = api_method(n.args[0]), n.args[1:]
            if method is None:
                continue
            m = re.fullmatch(r"([a-z]+)_(namespaced_)?([a-z_]+)", method.attr)
            assert m and m.group(1) in _VERBS, method.attr
            verb, resource = m.group(1), _plural(m.group(3))
            on_one = verb in _NAMED_VERBS
            name = ANY
            if on_one and (names or {}).get(_source(args[0])):
                name = (names or {})[_source(args[0])]
            ns = ANY
            if m.group(2):
                arg = args[1 if on_one else 0]
                ns = (
                    constants[arg.id]
                    if isinstance(arg, ast.Name) and arg.id in constants
                    else namespace
                )
            else:
                assert resource in _CLUSTER_SCOPED, method.attr
            found.add((ns, apis[method.value.attr], resource, _VERBS[verb], name))
    return found


def granted(service_account: str, namespace: str) -> set[Permission]:
    out: set[Permission] = set()
    for _, o in all_objects():
        if o["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = {(s["name"], s.get("namespace")) for s in o["subjects"]}
        if (service_account, namespace) not in subjects:
            continue
        ref = o["roleRef"]
        where = o["metadata"].get("namespace", "*") if o["kind"] == "RoleBinding" else "*"
        role = one(
            ref["kind"],
            ref["name"],
            o["metadata"].get("namespace") if ref["kind"] == "Role" else None,
        )
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames", [ANY]):
                            out.add((where, group, resource, verb, name))
    return out


def _namespace() -> str:
    fleet = config_in("seawall-gateway").fleet
    assert fleet.discovery is not None
    return fleet.discovery.namespace


def lease_calls(entry: tuple[str, ...]) -> set[Permission]:
    cc = config_in("seawall-gateway").cluster
    return api_calls(
        seawall.cluster.kube, cc.lease_namespace, entry=entry, names={"self.name": cc.lease_name}
    )


CANDIDATE = ("acquire", "release", "leader")  # what the role manager calls on its elector
FOLLOWER = ("leader",)  # with cluster.may_lead: false, only this (tests/unit/test_cluster_roles)


def test_the_call_scanner_sees_the_calls() -> None:
    # Guards the derivation below: it must find what the actuator and elector really do.
    calls = api_calls(seawall.actuate.kubernetes, "seawall")
    assert ("seawall", "", "pods", "delete", ANY) in calls
    assert ("*", "", "nodes", "patch", ANY) in calls
    assert ("default", "", "events", "create", ANY) in calls
    lease = ("seawall", "coordination.k8s.io", "leases")
    assert lease_calls(CANDIDATE) == {
        (*lease, "get", "seawall-fleet-leader"),
        (*lease, "update", "seawall-fleet-leader"),
        (*lease, "create", ANY),  # a create names no existing object: RBAC cannot narrow it
    }
    assert lease_calls(FOLLOWER) == {(*lease, "get", "seawall-fleet-leader")}


def test_serving_gateways_may_read_the_lease_and_nothing_else() -> None:
    ns = _namespace()
    assert granted("seawall-gateway", ns) == lease_calls(FOLLOWER)


def test_the_actuator_gets_exactly_what_election_the_actuator_and_discovery_call() -> None:
    ns = _namespace()
    needed = (
        api_calls(seawall.actuate.kubernetes, ns)
        | api_calls(seawall.fleet.discovery, ns)
        | lease_calls(CANDIDATE)
    )
    assert granted("seawall-actuator", ns) == needed


# -- Prometheus: the example scrape config selects these pods --------------------------


def _sd_keep(job: dict[str, Any], meta: str) -> str:
    rule = next(
        r
        for r in job["relabel_configs"]
        if r.get("action") == "keep" and r["source_labels"] == [meta]
    )
    return str(rule["regex"])


def test_prometheus_jobs_select_the_manifests_pods_and_ports() -> None:
    jobs = {j["job_name"]: j for j in prometheus_config.shipped()["scrape_configs"]}
    expected = {"seawall": {"seawall-gateway", "seawall-actuator"}, "engines": {"vllm"}}
    deployments = [o for _, o in all_objects() if o["kind"] == "Deployment"]
    for job_name, names in expected.items():
        job = jobs[job_name]
        [sd] = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod"
        name_re = _sd_keep(job, "__meta_kubernetes_pod_label_app_kubernetes_io_name")
        port_re = _sd_keep(job, "__meta_kubernetes_pod_container_port_name")
        selected = {
            d["metadata"]["name"]
            for d in deployments
            if re.fullmatch(
                name_re, d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            )
        }
        assert selected == names, job_name
        for d in deployments:
            if d["metadata"]["name"] in names:
                assert d["metadata"]["namespace"] in sd["namespaces"]["names"]
                ports = [
                    p["name"] for p in container(d)["ports"] if re.fullmatch(port_re, p["name"])
                ]
                assert len(ports) == 1, (job_name, d["metadata"]["name"])
