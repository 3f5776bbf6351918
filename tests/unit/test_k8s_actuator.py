"""The Kubernetes actuator sends the API server the requests the Kubernetes API documents.

No real API server can run here, so a small aiohttp server on loopback plays it: it
records every request and answers with minimal core/v1 objects. A real
`kubernetes_asyncio` client is pointed at it, and each request's method, path,
Content-Type and body is checked against the Kubernetes API reference (core/v1):
- delete pod: DELETE /api/v1/namespaces/{ns}/pods/{name}, body DeleteOptions;
- cordon: PATCH /api/v1/nodes/{name}, `application/strategic-merge-patch+json`, setting
  `spec.unschedulable` and `spec.taints` (the whole list: taints have no merge key);
- explain: POST /api/v1/namespaces/default/events, an Event whose involvedObject is the
  Node (kind, name, uid), with reason and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from seawall.actuate.base import Evidence, ReplicaRef
from seawall.actuate.kubernetes import KubernetesActuator


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


@dataclass
class FakeApiServer:
    requests: list[Recorded] = field(default_factory=list)
    taints: list[dict[str, str]] = field(default_factory=list)
    conflicts_left: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.requests.append(
            Recorded(
                request.method,
                request.path,
                dict(request.query),
                request.headers.get("Content-Type", ""),
                body,
            )
        )
        if request.method == "GET" and request.path.startswith("/api/v1/nodes/"):
            name = request.path.rsplit("/", 1)[1]
            return web.json_response(self.node(name))
        if request.method == "PATCH" and request.path.startswith("/api/v1/nodes/"):
            if self.conflicts_left:
                self.conflicts_left -= 1
                return web.json_response(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409},
                    status=409,
                )
            self.taints = body["spec"]["taints"]
            return web.json_response(self.node(request.path.rsplit("/", 1)[1]))
        if request.method == "GET" and request.path.endswith("/pods"):
            pod = {"metadata": {"name": "vllm-abc", "namespace": "serving"}}
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": [pod]})
        if request.method == "DELETE":
            return web.json_response({"kind": "Pod", "apiVersion": "v1", "metadata": {}})
        if request.method == "POST" and request.path.endswith("/events"):
            return web.json_response(body, status=201)
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    def node(self, name: str) -> dict[str, Any]:
        return {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"name": name, "uid": "uid-" + name, "resourceVersion": "41"},
            "spec": {"taints": self.taints},
        }


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, KubernetesActuator]]:
    fake = FakeApiServer(
        taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    )
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
    actuator = KubernetesActuator(client.ApiClient(configuration), default_namespace="serving")
    yield fake, actuator
    await actuator.close()
    await runner.cleanup()


async def test_restart_deletes_the_named_pod(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    fake, actuator = api
    ref = ReplicaRef("r1", "http://10.0.0.7:8000", "n1", pod="vllm-0", namespace="prod")
    assert await actuator.restart(ref, "hang")  # True: a restart is under way
    [req] = fake.requests
    assert (req.method, req.path) == ("DELETE", "/api/v1/namespaces/prod/pods/vllm-0")
    assert req.content_type.startswith("application/json")
    assert req.body.get("gracePeriodSeconds") is None  # the pod's own grace period


async def test_stop_without_pod_name_finds_the_pod_by_ip_and_uses_the_grace(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    fake, actuator = api
    await actuator.stop(ReplicaRef("r1", "http://10.0.0.7:8000", "n1"), grace_s=30)
    list_req, delete_req = fake.requests
    assert (list_req.method, list_req.path) == ("GET", "/api/v1/namespaces/serving/pods")
    assert list_req.query["fieldSelector"] == "status.podIP=10.0.0.7"
    assert (delete_req.method, delete_req.path) == (
        "DELETE",
        "/api/v1/namespaces/serving/pods/vllm-abc",
    )
    assert delete_req.body["gracePeriodSeconds"] == 30


async def test_cordon_patches_the_node_keeps_other_taints_and_posts_an_event(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    fake, actuator = api
    evidence = Evidence(
        node="gpu-7",
        reasons=("3 restarts within 3600 s",),
        restarts=((1.0, "r1", "hang"), (2.0, "r2", "engine_dead")),
    )
    await actuator.cordon("gpu-7", evidence)
    read, patch, event = fake.requests
    assert (read.method, read.path) == ("GET", "/api/v1/nodes/gpu-7")
    assert (patch.method, patch.path) == ("PATCH", "/api/v1/nodes/gpu-7")
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body == {
        "metadata": {"resourceVersion": "41"},
        "spec": {
            "unschedulable": True,
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "seawall.io/hardware", "value": "suspect", "effect": "NoSchedule"},
            ],
        },
    }
    assert (event.method, event.path) == ("POST", "/api/v1/namespaces/default/events")
    assert event.content_type.startswith("application/json")
    assert event.body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "gpu-7",
        "uid": "uid-gpu-7",
    }
    assert event.body["reason"] == "SeawallCordon"
    assert event.body["type"] == "Warning"
    assert "3 restarts within 3600 s" in event.body["message"]
    assert "r2: engine_dead" in event.body["message"]
    assert event.body["metadata"]["namespace"] == "default"


async def test_uncordon_removes_only_our_taint(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    fake, actuator = api
    await actuator.cordon("gpu-7", Evidence("gpu-7", ("xid 79",)))
    fake.requests.clear()
    await actuator.uncordon("gpu-7")
    _, patch, event = fake.requests
    assert patch.body["spec"] == {
        "unschedulable": False,
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    }
    assert event.body["reason"] == "SeawallUncordon"


async def test_a_concurrent_node_change_is_retried(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    fake, actuator = api
    fake.conflicts_left = 1
    await actuator.cordon("gpu-7", Evidence("gpu-7", ("xid 79",)))
    methods = [r.method for r in fake.requests]
    assert methods == ["GET", "PATCH", "GET", "PATCH", "POST"]
    assert fake.taints[-1]["key"] == "seawall.io/hardware"


async def test_a_replica_known_without_its_node_is_never_node_cordoned(
    api: tuple[FakeApiServer, KubernetesActuator],
) -> None:
    """DNS discovery names no node: the replica is its own failure domain, and there is
    no Node object to mark for it (a PATCH of `nodes/replica:...` would only fail)."""
    fake, actuator = api
    await actuator.cordon("replica:10.0.0.7:8000", Evidence("replica:10.0.0.7:8000", ("x",)))
    await actuator.uncordon("replica:10.0.0.7:8000")
    assert fake.requests == []
