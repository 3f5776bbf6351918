"""A loopback server playing the Kubernetes API server, for the parts Seawall calls.

No real API server can run here (no etcd, no kube-apiserver binary), so this one answers
the requests the Kubernetes API reference documents, with the semantics Seawall relies
on, and records every request so tests can check what was sent:

- coordination.k8s.io/v1 Leases: GET, POST (409 AlreadyExists), PUT with optimistic
  concurrency (409 Conflict when `metadata.resourceVersion` is not the current one);
- core/v1 Pods: GET list (`fieldSelector=status.podIP=...`), DELETE with
  `DeleteOptions.preconditions.uid` (409 Conflict when the uid is not the pod's, as the
  API server answers "Precondition failed: UID in precondition: ..., UID in object
  meta: ..."), 404 for a pod that does not exist;
- discovery.k8s.io/v1 EndpointSlices: GET list, built from the pods (ready ones);
- core/v1 Nodes: GET, PATCH; Events: POST.

A deleted pod comes back under the same name with a new uid when `recreate` is set
(what a StatefulSet does; a Deployment's ReplicaSet would pick a new name): the test's
`on_delete` callback plays the kubelet (restarting the process behind the pod) and then
calls `recreate(name)`.

`ThreadedKubeApi` runs it on its own event loop in a thread, for tests whose gateways
are separate processes (they reach it through a kubeconfig file).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from tests.support.served import served


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


@dataclass
class Pod:
    name: str
    namespace: str
    ip: str
    node: str
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    ready: bool = True


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        status=code,
    )


class KubeApi:
    def __init__(self, service: str = "engines", port: int = 8000) -> None:
        self.requests: list[Recorded] = []
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], Pod] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.service = service
        self.port = port
        self.on_delete: Callable[[Pod], None] | None = None
        # Set by a test: Lease reads wait here until this many are in flight together
        # (so that racing writers both read the same record before either writes).
        self.lease_read_barrier: asyncio.Barrier | None = None
        self._rv = itertools.count(100)
        self.lock = threading.Lock()

    # -- state the tests set up ---------------------------------------------------------

    def add_pod(self, pod: Pod) -> Pod:
        with self.lock:
            self.pods[(pod.namespace, pod.name)] = pod
        return pod

    def recreate(self, namespace: str, name: str, ip: str, node: str) -> Pod:
        """The pod is back under its name, with a new uid (a StatefulSet's way)."""
        return self.add_pod(Pod(name, namespace, ip, node))

    def recorded(self, method: str, fragment: str) -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.method == method and fragment in r.path]

    # -- the server ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        with self.lock:
            self.requests.append(
                Recorded(
                    request.method,
                    request.path,
                    dict(request.query),
                    request.headers.get("Content-Type", ""),
                    body,
                )
            )
        parts = request.path.strip("/").split("/")
        if request.path.startswith("/apis/coordination.k8s.io/v1/namespaces/"):
            if request.method == "GET" and self.lease_read_barrier is not None:
                await self.lease_read_barrier.wait()
            return self._lease(request.method, parts[4], parts[6] if len(parts) > 6 else None, body)
        if request.path.startswith("/apis/discovery.k8s.io/v1/namespaces/"):
            return self._slices(parts[4])
        if request.path.startswith("/api/v1/namespaces/") and parts[4] == "pods":
            return self._pods(request, parts[3], parts[5] if len(parts) > 5 else None, body)
        if request.path.startswith("/api/v1/nodes/"):
            return self._node(request.method, parts[3], body)
        if request.method == "POST" and request.path.endswith("/events"):
            return web.json_response(body, status=201)
        return _status(404, "NotFound", f"{request.path} not found")

    def _lease(self, method: str, ns: str, name: str | None, body: Any) -> web.Response:
        with self.lock:
            if method == "POST":
                name = body["metadata"]["name"]
                if (ns, name) in self.leases:
                    return _status(409, "AlreadyExists", f'leases "{name}" already exists')
                return web.json_response(self._store_lease(ns, name, body), status=201)
            assert name is not None
            current = self.leases.get((ns, name))
            if current is None:
                return _status(404, "NotFound", f'leases "{name}" not found')
            if method == "GET":
                return web.json_response(current)
            if method == "PUT":
                sent = body["metadata"].get("resourceVersion")
                if sent != current["metadata"]["resourceVersion"]:
                    return _status(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on leases "{name}": the object has '
                        "been modified; please apply your changes to the latest version",
                    )
                return web.json_response(self._store_lease(ns, name, body))
        return _status(405, "MethodNotAllowed", method)

    def _store_lease(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        lease = {
            "kind": "Lease",
            "apiVersion": "coordination.k8s.io/v1",
            "metadata": {
                **body["metadata"],
                "name": name,
                "namespace": ns,
                "resourceVersion": str(next(self._rv)),
            },
            "spec": body.get("spec") or {},
        }
        self.leases[(ns, name)] = lease
        return lease

    def _pods(self, request: web.Request, ns: str, name: str | None, body: Any) -> web.Response:
        with self.lock:
            if request.method == "GET" and name is None:
                selector = request.query.get("fieldSelector", "")
                ip = selector.removeprefix("status.podIP=") if selector else None
                items = [
                    self._pod_json(p)
                    for p in self.pods.values()
                    if p.namespace == ns and (ip is None or p.ip == ip)
                ]
                return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": items})
            assert name is not None
            pod = self.pods.get((ns, name))
            if pod is None:
                return _status(404, "NotFound", f'pods "{name}" not found')
            if request.method == "DELETE":
                wanted = ((body or {}).get("preconditions") or {}).get("uid")
                if wanted is not None and wanted != pod.uid:
                    return _status(
                        409,
                        "Conflict",
                        f"Precondition failed: UID in precondition: {wanted}, "
                        f"UID in object meta: {pod.uid}",
                    )
                del self.pods[(ns, name)]
                callback = self.on_delete
            else:
                return web.json_response(self._pod_json(pod))
        if callback is not None:
            callback(pod)
        return web.json_response(self._pod_json(pod))

    @staticmethod
    def _pod_json(p: Pod) -> dict[str, Any]:
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
            "spec": {"nodeName": p.node, "containers": [{"name": "engine", "image": "vllm"}]},
            "status": {"podIP": p.ip},
        }

    def _slices(self, ns: str) -> web.Response:
        with self.lock:
            endpoints = [
                {
                    "addresses": [p.ip],
                    "conditions": {"ready": p.ready},
                    "nodeName": p.node,
                    "targetRef": {
                        "kind": "Pod",
                        "name": p.name,
                        "namespace": p.namespace,
                        "uid": p.uid,
                    },
                }
                for p in sorted(self.pods.values(), key=lambda p: p.name)
                if p.namespace == ns
            ]
        return web.json_response(
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": "1"},
                "items": [
                    {
                        "metadata": {"name": f"{self.service}-abcde", "namespace": ns},
                        "addressType": "IPv4",
                        "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
                        "endpoints": endpoints,
                    }
                ],
            }
        )

    def _node(self, method: str, name: str, body: Any) -> web.Response:
        with self.lock:
            node = self.nodes.setdefault(
                name,
                {
                    "kind": "Node",
                    "apiVersion": "v1",
                    "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1"},
                    "spec": {"taints": []},
                },
            )
            if method == "PATCH":
                node["spec"].update(body.get("spec") or {})
                node["metadata"]["resourceVersion"] = str(next(self._rv))
            return web.json_response(node)


async def serve(api: KubeApi) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


def write_kubeconfig(path: Path, port: int, namespace: str = "default") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "loopback", "cluster": {"server": f"http://127.0.0.1:{port}"}}
                ],
                "users": [{"name": "test", "user": {"token": "loopback-test-token"}}],
                "contexts": [
                    {
                        "name": "loopback",
                        "context": {"cluster": "loopback", "user": "test", "namespace": namespace},
                    }
                ],
                "current-context": "loopback",
            }
        )
    )
    return path


@contextmanager
def threaded(api: KubeApi) -> Iterator[int]:
    """Serve `api` on a loop of its own in a thread; yields its port."""
    with served(api.app(), "kube-api") as port:
        yield port
