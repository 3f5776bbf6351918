"""Leadership through a Kubernetes `coordination.k8s.io/v1` Lease, the way
kube-controller-manager and llm-d's endpoint picker elect theirs.

Owns `KubernetesLeaseElector`, an `Elector` (see `store.py`) over one Lease object:
- the holder is `spec.holderIdentity`, its admin URL the annotation `seawall.io/leader-info`;
- the epoch (the fencing token) is `spec.leaseTransitions`, which grows by one at every
  change of holder; the role manager raises the shared store's fencing epoch to it on
  promotion, so the state in Redis is fenced by the Lease's elections;
- every write is a replace carrying the `resourceVersion` that was read (optimistic
  concurrency): two instances racing for an expired lease both send a replace, the API
  server accepts one and answers the other 409, and that one is not the leader;
- expiry is judged on this instance's own clock, from when it last saw the record change
  (client-go's rule): hosts' wall clocks may disagree, and `renewTime` is only for people;
- `release` empties the holder, so a successor takes over at its next try.

Also `kube_api_client()`: a `kubernetes_asyncio` client from the in-cluster service
account, or ~/.kube/config (or `$KUBECONFIG`) outside a cluster.

Must not: decide when to step down (the role manager and `policy.leadership` do) or raise
anything but `StoreUnavailable` for an unreachable or failing API server.
"""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime
from typing import Any

from seawall import clock
from seawall.cluster.store import Lease, StoreUnavailable

INFO_ANNOTATION = "seawall.io/leader-info"


async def kube_api_client() -> Any:
    """A `kubernetes_asyncio.client.ApiClient` for this environment."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kube_config

    loader: Any = kube_config  # the client's loaders are untyped
    try:
        loader.load_incluster_config()
    except loader.ConfigException:
        await loader.load_kube_config()
    return client.ApiClient()


class KubernetesLeaseElector:
    """`KubernetesLeaseElector(api_client, name, namespace)`; see the module docstring."""

    def __init__(self, api_client: Any, name: str, namespace: str, timeout_s: float = 2.0) -> None:
        from kubernetes_asyncio import client

        self._client = client
        self._api_client = api_client
        self._api = client.CoordinationV1Api(api_client)
        self.name = name
        self.namespace = namespace
        self.timeout_s = timeout_s
        # What we last saw of the record, and when (monotonic): expiry is judged from it.
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One API call; 404 and 409 come back as ApiException, failures as
        StoreUnavailable."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fn(*args, **kwargs)
        except self._client.ApiException as e:
            if e.status in (404, 409):
                raise
            raise StoreUnavailable(f"Kubernetes Lease {self._where}: HTTP {e.status}") from e
        except (OSError, TimeoutError) as e:
            raise StoreUnavailable(f"Kubernetes Lease {self._where} unreachable: {e!r}") from e
        except Exception as e:  # aiohttp's client errors, through kubernetes_asyncio
            if type(e).__module__.startswith("aiohttp"):
                raise StoreUnavailable(f"Kubernetes Lease {self._where}: {e!r}") from e
            raise

    @property
    def _where(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def _read(self) -> Any | None:
        try:
            lease = await self._call(self._api.read_namespaced_lease, self.name, self.namespace)
        except self._client.ApiException as e:
            if e.status == 404:
                return None
            raise StoreUnavailable(f"Kubernetes Lease {self._where}: HTTP {e.status}") from e
        self._observe(lease)
        return lease

    def _observe(self, lease: Any) -> None:
        spec = lease.spec
        key = (lease.metadata.resource_version, spec.holder_identity, spec.renew_time)
        if key != self._observed:
            self._observed, self._observed_at = key, clock.monotonic()

    def _expired(self, lease: Any) -> bool:
        spec = lease.spec
        if not spec.holder_identity:
            return True
        duration = spec.lease_duration_seconds or 0
        return clock.monotonic() - self._observed_at >= duration

    def _body(
        self,
        holder: str,
        info: str,
        ttl_s: float,
        transitions: int,
        acquired: datetime | None,
        resource_version: str | None,
    ) -> Any:
        c = self._client
        now = datetime.fromtimestamp(clock.wall(), tz=UTC)
        return c.V1Lease(
            metadata=c.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                resource_version=resource_version,
                annotations={INFO_ANNOTATION: info},
            ),
            spec=c.V1LeaseSpec(
                holder_identity=holder,
                lease_duration_seconds=max(1, math.ceil(ttl_s)),
                acquire_time=acquired or now,
                renew_time=now,
                lease_transitions=transitions,
            ),
        )

    @staticmethod
    def _lease(lease: Any) -> Lease:
        annotations = lease.metadata.annotations or {}
        return Lease(
            str(lease.spec.holder_identity),
            str(annotations.get(INFO_ANNOTATION, "")),
            int(lease.spec.lease_transitions or 0),
        )

    async def acquire(
        self, instance: str, info: str, ttl_s: float, min_epoch: int = 0
    ) -> Lease | None:
        current = await self._read()
        if current is None:
            body = self._body(instance, info, ttl_s, 0, None, None)
            try:
                created = await self._call(self._api.create_namespaced_lease, self.namespace, body)
            except self._client.ApiException:  # 409: created by someone else meanwhile
                return None
            self._observe(created)
            return self._lease(created)
        spec = current.spec
        mine = spec.holder_identity == instance
        if not mine and not self._expired(current):
            return None
        transitions = int(spec.lease_transitions or 0) + (0 if mine else 1)
        body = self._body(
            instance,
            info,
            ttl_s,
            transitions,
            spec.acquire_time if mine else None,
            current.metadata.resource_version,
        )
        try:
            replaced = await self._call(
                self._api.replace_namespaced_lease, self.name, self.namespace, body
            )
        except self._client.ApiException:  # 409: someone else wrote first
            return None
        self._observe(replaced)
        return self._lease(replaced)

    async def release(self, instance: str) -> None:
        current = await self._read()
        if current is None or current.spec.holder_identity != instance:
            return
        body = self._body(
            "",
            "",
            1,
            int(current.spec.lease_transitions or 0),
            current.spec.acquire_time,
            current.metadata.resource_version,
        )
        try:
            await self._call(self._api.replace_namespaced_lease, self.name, self.namespace, body)
        except self._client.ApiException:
            return  # changed meanwhile: it is no longer ours to release

    async def leader(self) -> Lease | None:
        current = await self._read()
        if current is None or self._expired(current):
            return None
        return self._lease(current)

    async def close(self) -> None:
        await self._api_client.close()
