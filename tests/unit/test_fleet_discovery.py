"""DNS replica discovery finds a headless Service's addresses (here: localhost)."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from seawall.fleet.config import DiscoveryConfig
from seawall.fleet.discovery import DnsDiscovery, Endpoint, build_discovery, watch


async def test_dns_discovery_resolves_localhost_to_loopback_endpoints() -> None:
    found = await DnsDiscovery("localhost", 8000, family=socket.AF_INET).resolve()
    assert Endpoint("127.0.0.1", 8000) in found
    assert all(e.port == 8000 and e.url.endswith(":8000") for e in found)


async def test_watch_reports_a_set_once_and_keeps_it_through_failures() -> None:
    class Flaky:
        calls = 0

        async def resolve(self) -> frozenset[Endpoint]:
            self.calls += 1
            if self.calls == 2:
                raise OSError("temporary failure in name resolution")
            if self.calls >= 4:
                stop.set()
            return frozenset({Endpoint("10.0.0.1", 8000)})

    stop = asyncio.Event()
    seen: list[frozenset[Endpoint]] = []
    await asyncio.wait_for(watch(Flaky(), 0.0, seen.append, stop), timeout=10)
    assert seen == [frozenset({Endpoint("10.0.0.1", 8000)})]


def test_endpoint_ids_and_urls() -> None:
    assert Endpoint("10.0.0.1", 8000).replica_id == "10.0.0.1:8000"
    assert Endpoint("10.0.0.1", 8000, "n1", "vllm-0").replica_id == "vllm-0"
    assert Endpoint("fd00::1", 8000).url == "http://[fd00::1]:8000"


def test_config_dns_mode_resolves_the_headless_service_name() -> None:
    found = build_discovery(DiscoveryConfig(service="vllm", namespace="serving", port=8001))
    assert isinstance(found, DnsDiscovery)
    assert (found.name, found.port) == ("vllm.serving.svc", 8001)


async def test_endpointslices_give_ready_pods_with_their_nodes() -> None:
    """A real kubernetes_asyncio client against a loopback server playing the API server
    (no real one can run here), answering with EndpointSlices as discovery.k8s.io/v1
    documents them: ready endpoints are replicas, named by pod and placed on their node;
    not-ready and terminating ones are not; `ready` unset means ready."""
    from kubernetes_asyncio import client

    from seawall.fleet.discovery import EndpointSliceDiscovery

    def endpoint(ip: str, pod: str, node: str, **conditions: bool) -> dict[str, object]:
        return {
            "addresses": [ip],
            "conditions": conditions,
            "nodeName": node,
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "serving"},
        }

    slices = {
        "kind": "EndpointSliceList",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": "7"},
        "items": [
            {
                "metadata": {"name": f"vllm-{i}", "namespace": "serving"},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                "endpoints": eps,
            }
            for i, eps in enumerate(
                [
                    [
                        endpoint("10.0.0.7", "vllm-0", "gpu-1", ready=True, serving=True),
                        endpoint("10.0.0.8", "vllm-1", "gpu-2", ready=False, serving=False),
                    ],
                    [
                        endpoint("10.0.1.9", "vllm-2", "gpu-2"),  # conditions unset: ready
                        endpoint("10.0.1.3", "vllm-3", "gpu-3", ready=False, terminating=True),
                    ],
                ]
            )
        ],
    }
    asked: list[tuple[str, dict[str, str]]] = []

    async def handle(request: web.Request) -> web.Response:
        asked.append((request.path, dict(request.query)))
        return web.json_response(slices)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        found = await EndpointSliceDiscovery(api, "vllm", "serving", 8000).resolve()
    finally:
        await api.close()
        await runner.cleanup()
    assert asked == [
        (
            "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices",
            {"labelSelector": "kubernetes.io/service-name=vllm"},
        )
    ]
    assert found == {
        Endpoint("10.0.0.7", 8000, "gpu-1", "vllm-0", "serving"),
        Endpoint("10.0.1.9", 8000, "gpu-2", "vllm-2", "serving"),
    }
    assert {e.replica_id for e in found} == {"vllm-0", "vllm-2"}
