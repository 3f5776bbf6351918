"""Leadership through a coordination.k8s.io Lease, and pod deletes that no second actor
can turn against a replacement: real `kubernetes_asyncio` clients against a loopback
server playing the API server (`tests/support/kube_api.py`; no real one can run here),
the way tests/unit/test_k8s_actuator.py and test_fleet_discovery.py test the actuator
and EndpointSlice discovery."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from seawall import clock
from seawall.actuate.base import ReplicaRef
from seawall.actuate.kubernetes import KubernetesActuator
from seawall.cluster.kube import INFO_ANNOTATION, KubernetesLeaseElector
from seawall.cluster.store import StoreUnavailable
from seawall.fleet.discovery import EndpointSliceDiscovery
from tests.support.kube_api import KubeApi, Pod, serve


@pytest.fixture
async def api() -> AsyncIterator[tuple[KubeApi, int]]:
    fake = KubeApi()
    runner, port = await serve(fake)
    yield fake, port
    await runner.cleanup()


def _client(port: int) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))


class Stepped:
    """seawall.clock.monotonic, stepped by the test (the elector judges expiry on it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = clock.monotonic()
        monkeypatch.setattr(clock, "monotonic", lambda: self.now)


async def test_one_holder_renewals_and_a_takeover_after_the_ttl_on_our_own_clock(
    api: tuple[KubeApi, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, port = api
    t = Stepped(monkeypatch)
    a = KubernetesLeaseElector(_client(port), "seawall-leader", "serving")
    b = KubernetesLeaseElector(_client(port), "seawall-leader", "serving")
    try:
        first = await a.acquire("gw-a", "http://10.0.0.1:8081", ttl_s=4.0)
        assert first is not None and (first.holder, first.epoch) == ("gw-a", 0)
        [created] = fake.recorded("POST", "/leases")
        assert created.path == "/apis/coordination.k8s.io/v1/namespaces/serving/leases"
        spec = created.body["spec"]
        assert spec["holderIdentity"] == "gw-a" and spec["leaseDurationSeconds"] == 4
        assert created.body["metadata"]["annotations"] == {INFO_ANNOTATION: "http://10.0.0.1:8081"}

        assert await b.acquire("gw-b", "http://10.0.0.2:8081", ttl_s=4.0) is None
        assert await b.leader() == first  # b learns who leads, and where
        t.now += 3.0
        assert await a.acquire("gw-a", "http://10.0.0.1:8081", ttl_s=4.0) == first  # renewed
        t.now += 3.0  # 6 s since b first looked, but the record changed 3 s ago
        assert await b.acquire("gw-b", "http://10.0.0.2:8081", ttl_s=4.0) is None
        t.now += 4.0  # a stopped renewing 4 s ago, as b saw it
        took = await b.acquire("gw-b", "http://10.0.0.2:8081", ttl_s=4.0)
        assert took is not None and (took.holder, took.epoch) == ("gw-b", 1)
        puts = fake.recorded("PUT", "/leases/seawall-leader")
        assert puts[-1].body["spec"]["leaseTransitions"] == 1
        # a, late, still thinks it holds the lease: its renewal is a replace with the
        # resourceVersion it last read, which the API server refuses.
        assert await a.acquire("gw-a", "http://10.0.0.1:8081", ttl_s=4.0) is None
        assert await a.leader() == took
    finally:
        await a.close()
        await b.close()


async def test_two_racing_for_an_expired_lease_get_one_leader(
    api: tuple[KubeApi, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both read the same expired record, then both replace it: optimistic concurrency
    lets exactly one through (the other's resourceVersion is stale: 409)."""
    fake, port = api
    t = Stepped(monkeypatch)
    old, b, c = (KubernetesLeaseElector(_client(port), "l", "default") for _ in range(3))
    try:
        assert await old.acquire("gw-old", "", 2.0) is not None
        assert await b.leader() is not None and await c.leader() is not None
        t.now += 2.0
        fake.lease_read_barrier = asyncio.Barrier(2)
        wins = await asyncio.gather(b.acquire("gw-b", "", 2.0), c.acquire("gw-c", "", 2.0))
        fake.lease_read_barrier = None
        assert len(fake.recorded("PUT", "/leases/l")) == 2  # both tried
        [won] = [w for w in wins if w is not None]
        assert won.epoch == 1 and await old.leader() == won
    finally:
        for e in (old, b, c):
            await e.close()


async def test_a_released_lease_is_taken_at_once(api: tuple[KubeApi, int]) -> None:
    _, port = api
    a = KubernetesLeaseElector(_client(port), "l", "default")
    b = KubernetesLeaseElector(_client(port), "l", "default")
    try:
        assert await a.acquire("gw-a", "", 15.0) is not None
        await a.release("gw-a")
        got = await b.acquire("gw-b", "", 15.0)
        assert got is not None and (got.holder, got.epoch) == ("gw-b", 1)
    finally:
        await a.close()
        await b.close()


async def test_an_unreachable_api_server_is_store_unavailable() -> None:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    await runner.cleanup()  # nothing listens there now
    elector = KubernetesLeaseElector(_client(port), "l", "default", timeout_s=1.0)
    try:
        with pytest.raises(StoreUnavailable):
            await elector.acquire("gw-a", "", 4.0)
    finally:
        await elector.close()


# ------------------------------------------------------------- one actor: uid deletes


async def test_a_delete_carries_the_pods_uid_and_a_stale_uid_is_refused(
    api: tuple[KubeApi, int],
) -> None:
    fake, port = api
    pod = fake.add_pod(Pod("vllm-0", "serving", "10.0.0.7", "node-a"))
    discovery = EndpointSliceDiscovery(_client(port), "engines", "serving", 8000)
    [endpoint] = await discovery.resolve()
    assert (endpoint.pod, endpoint.uid) == ("vllm-0", pod.uid)  # from the targetRef
    ref = ReplicaRef(
        "vllm-0", endpoint.url, "node-a", pod="vllm-0", namespace="serving", uid=pod.uid
    )

    first = KubernetesActuator(_client(port), default_namespace="serving")
    second = KubernetesActuator(_client(port), default_namespace="serving")
    try:
        assert await first.restart(ref, "hang")
        [delete] = fake.recorded("DELETE", "/pods/vllm-0")
        assert delete.body["preconditions"] == {"uid": pod.uid}
        # The StatefulSet brings the pod back under its name, loading; a second actor
        # that saw the same hang sends its delete for the same (old) pod.
        replacement = fake.recreate("serving", "vllm-0", "10.0.0.7", "node-a")
        assert not await second.restart(ref, "hang")  # nothing restarted by it
        assert len(fake.recorded("DELETE", "/pods/vllm-0")) == 2
        assert fake.pods[("serving", "vllm-0")].uid == replacement.uid  # still alive
    finally:
        await first.close()
        await second.close()
        await discovery._api.api_client.close()


async def test_a_pod_found_by_ip_is_deleted_with_the_uid_it_had_then(
    api: tuple[KubeApi, int],
) -> None:
    fake, port = api
    pod = fake.add_pod(Pod("vllm-7f9c", "serving", "10.0.0.9", "node-b"))
    actuator = KubernetesActuator(_client(port), default_namespace="serving")
    try:
        assert await actuator.restart(ReplicaRef("r", "http://10.0.0.9:8000", None), "hang")
        [delete] = fake.recorded("DELETE", "/pods/")
        assert delete.path == "/api/v1/namespaces/serving/pods/vllm-7f9c"
        assert delete.body["preconditions"] == {"uid": pod.uid}
    finally:
        await actuator.close()
