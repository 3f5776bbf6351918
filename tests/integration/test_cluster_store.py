"""Every cluster store keeps the same promises: the in-process `MemoryStore`, `RedisStore`
on a real redis-server, and `LocalStoreClient` over a real Unix socket to a
`StoreServer`. One test body per promise, run against each of the three.

TTLs here are real (short) ones: Redis expires keys on its own clock, so the waits poll
for the expiry with a bounded deadline rather than sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from seawall import clock
from seawall.cluster.local import LocalStoreClient, StoreServer
from seawall.cluster.redis_store import RedisStore
from seawall.cluster.store import ClusterStore, FencedOut, MemoryStore, StoreUnavailable
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis", "local"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer
) -> AsyncIterator[ClusterStore]:
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "redis":
        s = RedisStore(redis_server.url, key_prefix="conformance:")
        yield s
        await s.close()
    else:
        server = StoreServer(tmp_path / "cluster.sock")
        await server.start()
        client = LocalStoreClient(server.path)
        yield client
        await client.close()
        await server.close()


async def _until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = clock.monotonic() + timeout_s
    while not await predicate():  # type: ignore[operator]
        assert clock.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_one_holder_at_a_time_and_the_epoch_grows_at_each_change(
    store: ClusterStore,
) -> None:
    a = await store.acquire("a", "http://a:8081", ttl_s=0.3)
    assert a is not None and a.holder == "a" and a.info == "http://a:8081"
    assert await store.acquire("b", "http://b:8081", ttl_s=0.3) is None
    renewed = await store.acquire("a", "http://a:9999", ttl_s=0.3)
    assert renewed is not None and renewed.epoch == a.epoch and renewed.info == "http://a:9999"
    assert await store.leader() == renewed

    async def b_took_over() -> bool:
        return await store.acquire("b", "http://b:8081", ttl_s=5.0) is not None

    await _until(b_took_over)  # a stopped renewing: its lease expired
    b = await store.leader()
    assert b is not None and b.holder == "b" and b.epoch == a.epoch + 1

    await store.release("a")  # not a's to give up
    assert (await store.leader()) == b
    await store.release("b")
    assert await store.leader() is None
    c = await store.acquire("c", "", ttl_s=5.0, min_epoch=b.epoch + 10)
    assert c is not None and c.epoch == b.epoch + 11  # above what the caller remembers


async def test_a_deposed_leaders_writes_are_refused(store: ClusterStore) -> None:
    old = await store.acquire("a", "", ttl_s=0.2)
    assert old is not None
    await store.put("view", b"from a", old.epoch)

    async def b_leads() -> bool:
        return await store.acquire("b", "", ttl_s=5.0) is not None

    await _until(b_leads)
    new = await store.leader()
    assert new is not None
    await store.put("view", b"from b", new.epoch)
    for write in (
        store.put("view", b"late a", old.epoch),
        store.delete("view", old.epoch),
        store.append("rows", b"late a", old.epoch),
        store.hset("cordons", "n1", b"late a", old.epoch),
        store.hdel("cordons", "n1", old.epoch),
    ):
        with pytest.raises(FencedOut):
            await write
    assert await store.get("view") == b"from b"
    assert await store.range("rows") == []
    # A leader elected elsewhere (a Kubernetes Lease) raises the epoch before writing.
    assert await store.raise_epoch(new.epoch + 5) == new.epoch + 5
    assert await store.raise_epoch(1) == new.epoch + 5
    with pytest.raises(FencedOut):
        await store.put("view", b"b after the raise", new.epoch)


async def test_values_lists_and_hashes(store: ClusterStore) -> None:
    assert await store.get("missing") is None
    await store.put("k", b"\x00binary\xff", 0)
    assert await store.get("k") == b"\x00binary\xff"
    await store.delete("k", 0)
    assert await store.get("k") is None
    for i in range(5):
        await store.append("rows", f"row {i}".encode(), 0, cap=3)
    assert await store.range("rows") == [b"row 2", b"row 3", b"row 4"]
    assert await store.range("missing") == []
    await store.hset("h", "n1", b"one", 0)
    await store.hset("h", "n2", b"two", 0)
    await store.hdel("h", "n1", 0)
    assert await store.hgetall("h") == {"n2": b"two"}
    assert await store.hgetall("missing") == {}


async def test_members_live_for_their_ttl(store: ClusterStore) -> None:
    await store.heartbeat("a", b"report a", ttl_s=5.0)
    await store.heartbeat("b", b"report b1", ttl_s=0.3)
    await store.heartbeat("b", b"report b2", ttl_s=0.3)
    assert await store.members() == {"a": b"report a", "b": b"report b2"}

    async def b_gone() -> bool:
        return "b" not in await store.members()

    await _until(b_gone)
    assert await store.members() == {"a": b"report a"}
    await store.leave("a")
    assert await store.members() == {}


async def test_an_unreachable_redis_is_store_unavailable_and_it_recovers(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(redis_server.url, key_prefix="outage:")
    try:
        await store.heartbeat("a", b"r", 5.0)
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.members()
        with pytest.raises(StoreUnavailable):
            await store.acquire("a", "", 1.0)
        redis_server.start()
        assert await store.members() == {}  # a Redis without persistence comes back empty
        assert await store.acquire("a", "", 1.0) is not None
    finally:
        await store.close()


async def test_the_local_store_is_unavailable_without_its_server_and_reconnects(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cluster.sock"
    client = LocalStoreClient(path)
    with pytest.raises(StoreUnavailable):
        await client.members()
    server = StoreServer(path)
    await server.start()
    await client.heartbeat("a", b"r", 5.0)
    await server.close()
    with pytest.raises(StoreUnavailable):
        await client.members()
    again = StoreServer(path)
    await again.start()
    assert await client.members() == {}
    await client.close()
    await again.close()


async def test_redis_keys_live_under_the_prefix(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, key_prefix="tenant-x:cluster:")
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        lease = await store.acquire("a", "", 5.0)
        assert lease is not None
        await store.heartbeat("a", b"r", 5.0)
        await store.append("ledger", b"row", lease.epoch)
        keys = sorted(k.decode() for k in await raw.keys("*"))
        assert keys and all(k.startswith("tenant-x:cluster:") for k in keys), keys
    finally:
        await raw.aclose()
        await store.close()


@contextlib.asynccontextmanager
async def _store_outside_this_loop(
    kind: str, tmp_path: Path, redis_server: RedisServer
) -> AsyncIterator[ClusterStore]:
    """A client with a 0.1 s timeout to a store that keeps answering while this loop is
    blocked: the real redis-server, or a `StoreServer` on its own loop in a thread."""
    if kind == "redis":
        store = RedisStore(redis_server.url, key_prefix="stall:", socket_timeout_s=0.1)
        try:
            yield store
        finally:
            await store.close()
        return
    path = tmp_path / "cluster.sock"
    started = threading.Event()
    stop: list[Callable[[], None]] = []

    async def serve() -> None:
        server = StoreServer(path)
        await server.start()
        done = asyncio.Event()
        stop.append(lambda: loop.call_soon_threadsafe(done.set))
        started.set()
        await done.wait()
        await server.close()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    client = LocalStoreClient(path, timeout_s=0.1)
    try:
        yield client
    finally:
        await client.close()
        stop[0]()
        thread.join(10)
        loop.close()


def _stall_after_the_next_write(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Block this process's loop once the next request is handed to the kernel and the
    caller waits for the answer, so that the answer arrives during the stall (both
    clients write through asyncio's StreamWriter; the stall is the only thing changed)."""
    for name in ("write", "writelines"):
        real = getattr(asyncio.StreamWriter, name)

        def stalling(self: asyncio.StreamWriter, data: Any, real: Any = real) -> None:
            real(self, data)
            monkeypatch.undo()
            # A few turns of the loop later: by then the caller waits for the answer with
            # its timer armed (redis-py's write and read take three), and the answer,
            # ~0.1 ms away, has not been read yet.
            loop = asyncio.get_running_loop()

            def later(turns: int) -> None:
                if turns:
                    loop.call_soon(later, turns - 1)
                else:
                    time.sleep(seconds)

            later(4)

        monkeypatch.setattr(asyncio.StreamWriter, name, stalling)


@pytest.mark.parametrize("kind", ["redis", "local"])
async def test_a_stall_of_this_process_is_not_an_unreachable_store(
    kind: str, tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store answers while this process's own loop is blocked (a GC pause, a CPU
    taken on a loaded machine) for three times the timeout: the answer is used. Before,
    every call in flight failed as StoreUnavailable, and the instance went fail-static
    (a CI run's rollout poll met the 503 that follows)."""
    async with _store_outside_this_loop(kind, tmp_path, redis_server) as store:
        await store.heartbeat("a", b"report", 30.0)  # connected
        _stall_after_the_next_write(monkeypatch, 0.3)
        assert await store.members() == {"a": b"report"}
        _stall_after_the_next_write(monkeypatch, 0.3)
        lease = await store.acquire("a", "http://a", 30.0)
        assert lease is not None and lease.holder == "a"


async def test_a_stall_while_redis_accepts_the_connection_is_not_an_outage(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call opens the connection; this loop is blocked while Redis accepts it,
    longer than the call's timeout. Before: redis-py's own connect timeout, as long as
    the call's, expired with the connection already made, and the call failed as
    StoreUnavailable."""
    real = asyncio.open_connection

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        asyncio.get_running_loop().call_soon(time.sleep, 0.6)  # while the connect is pending
        return await real(*args, **kwargs)

    store = RedisStore(redis_server.url, key_prefix="stall-connect:", socket_timeout_s=0.5)
    monkeypatch.setattr(asyncio, "open_connection", stalled)
    try:
        await store.heartbeat("a", b"report", 30.0)
        monkeypatch.undo()
        assert await store.members() == {"a": b"report"}
    finally:
        await store.close()
