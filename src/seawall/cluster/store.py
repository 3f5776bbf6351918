"""The cluster store: the few primitives every shared feature of several gateway
instances is built on, and `MemoryStore`, their one-process implementation.

Why a small protocol. Leadership, the published fleet view, the restart ledger, and the
features others build on them (leader-issued KV quotas, fleet-wide retry budgets) all
need the same three things and no more:

- **membership**: `heartbeat(instance, report, ttl_s)` keeps an instance and its latest
  report alive for `ttl_s`; `members()` is every live instance's report. A crashed
  instance leaves by itself when its TTL runs out.
- **leadership**: `acquire(instance, info, ttl_s)` takes the lease when it is free or
  expired and renews it when `instance` already holds it; anyone else gets None.
  `leader()` reads it, `release()` gives it up. A `Lease` carries the holder, its `info`
  (the leader's admin URL) and an **epoch** that grows by one at every change of holder.
- **fenced writes**: `put`/`delete`, `append` (a capped list) and `hset`/`hdel` take the
  writer's epoch. The store keeps the highest epoch it has seen; a write with an older
  one is refused (`FencedOut`), so a leader that was deposed while it stalled cannot
  overwrite what its successor wrote (Kleppmann's fencing token). A write with a newer
  epoch raises the store's (a leader elected elsewhere, by a Kubernetes Lease, may write
  before it called `raise_epoch`). Reads are not fenced.

Implementations: `MemoryStore` (here; the single-process default and the test double
that the conformance tests hold the others to), `RedisStore` (`redis_store.py`) and
`LocalStoreClient` (`local.py`, a `MemoryStore` in another process on the same host).
Every implementation raises `StoreUnavailable` when it cannot reach its backend, and
nothing else for that: callers turn it into fail-static.

`acquire(..., min_epoch)`: the new epoch is above both the store's and `min_epoch` (the
highest the caller has seen), so a store that lost its data (a Redis restarted without
persistence) still hands out epochs above every leader the fleet remembers.

Must not: decide who should lead (callers do; `policy.leadership` decides when to step
down), interpret values (they are bytes), or read the clock except through the `now`
callable it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from seawall import clock

__all__ = [
    "ClusterStore",
    "Elector",
    "FencedOut",
    "Lease",
    "MemoryStore",
    "StoreUnavailable",
]

# `append` keeps at most this many entries per list unless told otherwise: the restart
# ledger needs the last K per domain within a window, never the whole history.
DEFAULT_LIST_CAP = 1000


class StoreUnavailable(Exception):
    """The store could not be reached (refused, reset, timed out). Fail static."""


class FencedOut(Exception):
    """A write carried an epoch older than the store's: the writer is no longer leader."""

    def __init__(self, epoch: int, current: int) -> None:
        super().__init__(f"write with epoch {epoch} refused: the store is at epoch {current}")
        self.epoch = epoch
        self.current = current


@dataclass(frozen=True, slots=True)
class Lease:
    """Who leads, how to reach it, and its fencing token."""

    holder: str
    info: str  # what the holder published with it: its admin URL
    epoch: int  # grows at every change of holder; the fencing token of its writes


class Elector(Protocol):
    """Leadership alone: a `ClusterStore` is one; so is a Kubernetes Lease (`kube.py`)."""

    async def acquire(
        self, instance: str, info: str, ttl_s: float, min_epoch: int = 0
    ) -> Lease | None:
        """Take the lease if free or expired, renew it if `instance` holds it; else None."""
        ...

    async def release(self, instance: str) -> None:
        """Give the lease up if `instance` holds it (a clean shutdown: no TTL to wait)."""
        ...

    async def leader(self) -> Lease | None: ...

    async def close(self) -> None: ...


class ClusterStore(Elector, Protocol):
    """The primitives. See the module docstring for the semantics every one must keep."""

    async def heartbeat(self, instance: str, report: bytes, ttl_s: float) -> None: ...

    async def leave(self, instance: str) -> None: ...

    async def members(self) -> dict[str, bytes]: ...

    async def raise_epoch(self, epoch: int) -> int:
        """The store's epoch becomes at least `epoch`; returns it."""
        ...

    async def put(self, key: str, value: bytes, epoch: int) -> None: ...

    async def delete(self, key: str, epoch: int) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def append(self, key: str, value: bytes, epoch: int, cap: int = DEFAULT_LIST_CAP) -> None:
        """Add `value` at the end of list `key`, keeping its newest `cap` entries."""
        ...

    async def range(self, key: str) -> list[bytes]:
        """List `key`, oldest first ([] when absent)."""
        ...

    async def hset(self, key: str, field: str, value: bytes, epoch: int) -> None: ...

    async def hdel(self, key: str, field: str, epoch: int) -> None: ...

    async def hgetall(self, key: str) -> dict[str, bytes]: ...


@dataclass(slots=True)
class _Held:
    holder: str
    info: str
    epoch: int
    expires_at: float


class MemoryStore:
    """The store in one process. `now` is monotonic seconds (tests pass their own)."""

    def __init__(self, now: Callable[[], float] = clock.monotonic) -> None:
        self._now = now
        self._epoch = 0
        self._lease: _Held | None = None
        self._members: dict[str, tuple[bytes, float]] = {}
        self._values: dict[str, bytes] = {}
        self._lists: dict[str, list[bytes]] = {}
        self._hashes: dict[str, dict[str, bytes]] = {}

    # -- leadership ---------------------------------------------------------------------

    def _live_lease(self) -> _Held | None:
        held = self._lease
        if held is not None and held.expires_at <= self._now():
            self._lease = held = None
        return held

    async def acquire(
        self, instance: str, info: str, ttl_s: float, min_epoch: int = 0
    ) -> Lease | None:
        held = self._live_lease()
        now = self._now()
        if held is not None and held.holder != instance:
            return None
        if held is None:
            self._epoch = max(self._epoch, min_epoch) + 1
            held = self._lease = _Held(instance, info, self._epoch, now + ttl_s)
        else:
            held.info, held.expires_at = info, now + ttl_s
        return Lease(held.holder, held.info, held.epoch)

    async def release(self, instance: str) -> None:
        held = self._live_lease()
        if held is not None and held.holder == instance:
            self._lease = None

    async def leader(self) -> Lease | None:
        held = self._live_lease()
        return None if held is None else Lease(held.holder, held.info, held.epoch)

    async def raise_epoch(self, epoch: int) -> int:
        self._epoch = max(self._epoch, epoch)
        return self._epoch

    # -- membership ---------------------------------------------------------------------

    async def heartbeat(self, instance: str, report: bytes, ttl_s: float) -> None:
        self._members[instance] = (report, self._now() + ttl_s)

    async def leave(self, instance: str) -> None:
        self._members.pop(instance, None)

    async def members(self) -> dict[str, bytes]:
        now = self._now()
        for name in [n for n, (_, expires) in self._members.items() if expires <= now]:
            del self._members[name]
        return {name: report for name, (report, _) in self._members.items()}

    # -- fenced writes ------------------------------------------------------------------

    def _fence(self, epoch: int) -> None:
        if epoch < self._epoch:
            raise FencedOut(epoch, self._epoch)
        self._epoch = epoch

    async def put(self, key: str, value: bytes, epoch: int) -> None:
        self._fence(epoch)
        self._values[key] = bytes(value)

    async def delete(self, key: str, epoch: int) -> None:
        self._fence(epoch)
        self._values.pop(key, None)

    async def get(self, key: str) -> bytes | None:
        return self._values.get(key)

    async def append(self, key: str, value: bytes, epoch: int, cap: int = DEFAULT_LIST_CAP) -> None:
        self._fence(epoch)
        items = self._lists.setdefault(key, [])
        items.append(bytes(value))
        del items[: max(0, len(items) - cap)]

    async def range(self, key: str) -> list[bytes]:
        return list(self._lists.get(key, ()))

    async def hset(self, key: str, field: str, value: bytes, epoch: int) -> None:
        self._fence(epoch)
        self._hashes.setdefault(key, {})[field] = bytes(value)

    async def hdel(self, key: str, field: str, epoch: int) -> None:
        self._fence(epoch)
        self._hashes.get(key, {}).pop(field, None)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        return dict(self._hashes.get(key, {}))

    async def close(self) -> None:
        return None
