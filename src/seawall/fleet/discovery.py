"""Replica discovery: which engine endpoints exist right now.

Owns two ways to find replicas behind a Kubernetes headless Service:
- `DnsDiscovery`: the A records of `name.namespace.svc` (a headless Service answers with
  one record per ready pod). Needs nothing but cluster DNS; knows addresses only.
- `EndpointSliceDiscovery`: the Service's EndpointSlices through the API server. Needs
  RBAC (list endpointslices) but also tells the node and pod of each endpoint, which the
  restart ledger and the Kubernetes actuator use (K restarts *per node*).

Both re-resolve on an interval and call `on_change` with the whole new set when it
differs; the fleet monitor reconciles its replicas from that set. Must not probe or
judge replicas (that is the monitor's job) and must not read the clock directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from seawall.fleet.config import DiscoveryConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    address: str
    port: int
    node: str = ""  # unknown with DNS discovery
    pod: str | None = None
    namespace: str | None = None
    uid: str | None = None  # the pod's uid, from the EndpointSlice's targetRef

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    @property
    def replica_id(self) -> str:
        return self.pod or f"{self.address}:{self.port}"


class Discovery(Protocol):
    async def resolve(self) -> frozenset[Endpoint]: ...


class DnsDiscovery:
    """A records of a headless Service; `DnsDiscovery("vllm.serving.svc", 8000)`."""

    def __init__(self, name: str, port: int, family: int = socket.AF_UNSPEC) -> None:
        self.name = name
        self.port = port
        self.family = family

    async def resolve(self) -> frozenset[Endpoint]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            self.name, self.port, family=self.family, type=socket.SOCK_STREAM
        )
        return frozenset(Endpoint(str(info[4][0]), self.port) for info in infos)


class EndpointSliceDiscovery:
    """Ready endpoints of a Service from `discovery.k8s.io/v1` EndpointSlices."""

    def __init__(self, api_client: Any, service: str, namespace: str, port: int) -> None:
        from kubernetes_asyncio import client

        self._api = client.DiscoveryV1Api(api_client)
        self.service = service
        self.namespace = namespace
        self.port = port

    async def resolve(self) -> frozenset[Endpoint]:
        slices = await self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
        )
        found: set[Endpoint] = set()
        for item in slices.items:
            for ep in item.endpoints or []:
                # `ready` unset means ready (API docs); terminating pods are not ready.
                if ep.conditions is not None and ep.conditions.ready is False:
                    continue
                ref = ep.target_ref
                pod = ref.name if ref is not None else None
                uid = ref.uid if ref is not None else None
                for address in ep.addresses or []:
                    found.add(
                        Endpoint(address, self.port, ep.node_name or "", pod, self.namespace, uid)
                    )
        return frozenset(found)


async def watch(
    discovery: Discovery,
    interval_s: float,
    on_change: Callable[[frozenset[Endpoint]], None],
    stop: asyncio.Event,
) -> None:
    """Resolve every `interval_s` until `stop`; report each new set once.

    A failed lookup keeps the last known set: a DNS hiccup must not empty the fleet.
    """
    last: frozenset[Endpoint] | None = None
    while not stop.is_set():
        try:
            current = await discovery.resolve()
        except Exception as exc:  # DNS errors, API errors from kubernetes_asyncio, timeouts
            log.warning("replica discovery failed, keeping the last set: %r", exc)
        else:
            if current != last:
                last = current
                on_change(current)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


def build_discovery(config: DiscoveryConfig, api_client: Any | None = None) -> Discovery:
    """The discovery the config asks for; EndpointSlices need a kubernetes_asyncio
    `ApiClient` (in-cluster config when None is given)."""
    if config.mode == "dns":
        return DnsDiscovery(f"{config.service}.{config.namespace}.svc", config.port)
    if api_client is None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as kube_config

        loader: Any = kube_config  # the client's loaders are untyped
        loader.load_incluster_config()
        api_client = client.ApiClient()
    return EndpointSliceDiscovery(api_client, config.service, config.namespace, config.port)
