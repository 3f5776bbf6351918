"""`MemoryStore` with its clock stepped by the test: leases, memberships and fencing at
exact times. (The same promises against Redis and the local socket server, with real
TTLs: tests/integration/test_cluster_store.py.)"""

from __future__ import annotations

import pytest

from seawall.cluster.store import FencedOut, MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_lease_lasts_exactly_its_ttl_unless_renewed() -> None:
    t = Clock()
    store = MemoryStore(t)
    first = await store.acquire("a", "http://a", ttl_s=4.0)
    assert first is not None and first.epoch == 1
    t.now += 3.9
    assert await store.acquire("b", "http://b", ttl_s=4.0) is None
    assert await store.acquire("a", "http://a", ttl_s=4.0) == first  # renewed at 1003.9
    t.now += 3.9
    assert (await store.leader()) == first
    t.now += 0.1  # 4.0 s after the renewal
    assert await store.leader() is None
    second = await store.acquire("b", "http://b", ttl_s=4.0)
    assert second is not None and (second.holder, second.epoch) == ("b", 2)


async def test_the_old_leader_is_fenced_out_once_a_successor_exists() -> None:
    t = Clock()
    store = MemoryStore(t)
    a = await store.acquire("a", "", 1.0)
    assert a is not None
    await store.hset("ledger:cordons", "n1", b"a's", a.epoch)
    t.now += 5.0
    # Expired but no successor yet: nobody can have written after it, so it still may.
    await store.append("ledger:restarts:n1", b"a, late", a.epoch)
    b = await store.acquire("b", "", 1.0)
    assert b is not None and b.epoch == a.epoch + 1
    with pytest.raises(FencedOut) as refused:
        await store.append("ledger:restarts:n1", b"a, later", a.epoch)
    assert (refused.value.epoch, refused.value.current) == (a.epoch, b.epoch)
    assert await store.range("ledger:restarts:n1") == [b"a, late"]


async def test_members_expire_at_their_ttl_and_a_heartbeat_renews() -> None:
    t = Clock()
    store = MemoryStore(t)
    await store.heartbeat("a", b"1", ttl_s=3.0)
    await store.heartbeat("b", b"1", ttl_s=3.0)
    t.now += 2.0
    await store.heartbeat("a", b"2", ttl_s=3.0)
    t.now += 1.0
    assert await store.members() == {"a": b"2"}
    t.now += 2.0
    assert await store.members() == {}


async def test_a_new_epoch_is_above_what_the_fleet_remembers() -> None:
    """A store that lost its data (a Redis restarted without persistence) must not hand
    out an epoch an old leader still holds."""
    store = MemoryStore(Clock())
    lease = await store.acquire("a", "", 1.0, min_epoch=41)
    assert lease is not None and lease.epoch == 42
