"""The restart ledger store: every restart and every cordon, kept across monitor restarts.

Owns the `Ledger` interface the fleet monitor writes through and its two
implementations: `RestartLedger`, a SQLite file (stdlib `sqlite3`, the default for one
gateway instance), and `StoreLedger`, the same rows in the cluster store (Redis, or the
local store server), for several instances: one ledger for the whole fleet, which
survives the loss of any instance, written only by the leader and fenced by its epoch
(a deposed leader's late write is refused, see `seawall.cluster.store`). The ledger is what lets
"K restarts on one node within an hour" survive a gateway redeploy: without it a node that
kills its replicas every 20 minutes would be forgiven at every rollout.

Times are wall-clock (`at_wall`, unix seconds): the ledger outlives the process, so
monotonic time would mean nothing after a restart. The record type is the policy's
(`seawall.policy.ledger.RestartRecord`), re-exported here. Rows are of two kinds: real
restarts, which `restarts()` returns and the cordon rule counts, and failures that
restarted nothing (actuator `none`), which `failures()` returns for people to see. The
last uncordon of each domain is kept too: restarts before it no longer count.

Schema versions: 1 had no `kind` column (every row was counted as a restart) and no
`uncordons` table; opening a version-1 file adds both, keeping its rows as restarts.

Must not decide anything: whether a node should be cordoned is `seawall.policy`'s call.
Calls run in a worker thread (`asyncio.to_thread`) so a slow disk never stalls the event
loop; one lock serialises them because one connection is shared across those threads.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

from seawall import clock
from seawall.actuate.base import Evidence
from seawall.cluster.store import ClusterStore, FencedOut, StoreUnavailable
from seawall.policy.ledger import RecordKind, RestartRecord
from seawall.policy.pools import PoolEvent

T = TypeVar("T")

__all__ = [
    "CordonRecord",
    "Ledger",
    "LedgerError",
    "RecordKind",
    "RestartLedger",
    "RestartRecord",
    "StoreLedger",
]

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS restarts (
    at_wall REAL NOT NULL,
    node TEXT NOT NULL,
    replica_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    kind TEXT NOT NULL DEFAULT 'restart'
);
CREATE INDEX IF NOT EXISTS restarts_node_time ON restarts (node, at_wall);
CREATE TABLE IF NOT EXISTS cordons (
    node TEXT PRIMARY KEY,
    since_wall REAL NOT NULL,
    evidence TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS uncordons (
    node TEXT PRIMARY KEY,
    at_wall REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pool_events (
    at_wall REAL NOT NULL,
    change TEXT NOT NULL,
    model TEXT NOT NULL,
    from_pool TEXT,
    to_pool TEXT,
    reason TEXT NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class PoolRecord:
    """A pool event as the ledger keeps it (wall-clock time)."""

    at_wall: float
    change: str  # failover | failback
    model: str
    from_pool: str | None
    to_pool: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class CordonRecord:
    node: str
    since_wall: float
    evidence: Evidence


class LedgerError(Exception):
    """The ledger could not be read or written (its store is unreachable, or this
    instance is no longer the leader allowed to write). The caller logs it; an action
    already taken stands."""


class Ledger(Protocol):
    """What the fleet monitor keeps: restarts and failures per failure domain, cordons,
    and the last uncordon of each domain. Times are wall-clock (unix seconds)."""

    async def record(self, rec: RestartRecord) -> None: ...

    async def restarts(self, node: str, since_wall: float) -> list[RestartRecord]:
        """Real restarts in domain `node` at or after `since_wall`, oldest first."""
        ...

    async def failures(self, node: str, since_wall: float) -> list[RestartRecord]:
        """Failures in domain `node` that restarted nothing, at or after `since_wall`."""
        ...

    async def uncordoned_at(self, node: str) -> float | None: ...

    async def cordoned_nodes(self) -> dict[str, CordonRecord]: ...

    async def set_cordoned(
        self, node: str, cordoned: bool, evidence: Evidence | None = None
    ) -> None: ...

    async def record_pool_event(self, event: PoolEvent) -> None:
        """A model's traffic moved between pools (failover, failback)."""
        ...

    async def pool_events(self, since_wall: float) -> list[PoolRecord]: ...

    async def close(self) -> None: ...


class RestartLedger:
    """`RestartLedger(path)`; `":memory:"` keeps it in the process (tests, `none` mode)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            # `CREATE TABLE IF NOT EXISTS` keeps a version-1 `restarts`. Its columns are
            # read, not the file's user_version: a gateway rolled back to the release
            # before opens the file too and sets user_version back to 1, and the next
            # one must not add a column that is there.
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(restarts)")}
            if "kind" not in columns:
                self._db.execute(
                    "ALTER TABLE restarts ADD COLUMN kind TEXT NOT NULL DEFAULT 'restart'"
                )
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn(self._db)

        return await asyncio.to_thread(locked)

    async def record(self, rec: RestartRecord) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT INTO restarts (at_wall, node, replica_id, reason, kind) "
                "VALUES (?, ?, ?, ?, ?)",
                (rec.at_wall, rec.node, rec.replica_id, rec.reason, rec.kind.value),
            )
        )

    async def restarts(self, node: str, since_wall: float) -> list[RestartRecord]:
        """Real restarts in domain `node` at or after `since_wall`, oldest first."""
        return await self._rows(node, since_wall, RecordKind.restart)

    async def failures(self, node: str, since_wall: float) -> list[RestartRecord]:
        """Failures in domain `node` that restarted nothing, at or after `since_wall`."""
        return await self._rows(node, since_wall, RecordKind.failure)

    async def _rows(self, node: str, since_wall: float, kind: RecordKind) -> list[RestartRecord]:
        rows: list[tuple[float, str, str, str]] = await self._run(
            lambda db: db.execute(
                "SELECT at_wall, node, replica_id, reason FROM restarts "
                "WHERE node = ? AND at_wall >= ? AND kind = ? ORDER BY at_wall",
                (node, since_wall, kind.value),
            ).fetchall()
        )
        return [RestartRecord(n, r, why, t, kind) for t, n, r, why in rows]

    async def uncordoned_at(self, node: str) -> float | None:
        """When an operator last uncordoned `node` (unix seconds), or None."""
        row: tuple[float] | None = await self._run(
            lambda db: db.execute(
                "SELECT at_wall FROM uncordons WHERE node = ?", (node,)
            ).fetchone()
        )
        return row[0] if row is not None else None

    async def cordoned_nodes(self) -> dict[str, CordonRecord]:
        rows: list[tuple[str, float, str]] = await self._run(
            lambda db: db.execute("SELECT node, since_wall, evidence FROM cordons").fetchall()
        )
        return {node: CordonRecord(node, since, _evidence(raw)) for node, since, raw in rows}

    async def set_cordoned(
        self, node: str, cordoned: bool, evidence: Evidence | None = None
    ) -> None:
        now = clock.wall()
        if not cordoned:

            def uncordon(db: sqlite3.Connection) -> None:
                # One transaction (the connection is in autocommit mode otherwise): a
                # crash between the two statements must not lose the uncordon time.
                db.execute("BEGIN")
                try:
                    db.execute("DELETE FROM cordons WHERE node = ?", (node,))
                    db.execute(
                        "INSERT INTO uncordons (node, at_wall) VALUES (?, ?) "
                        "ON CONFLICT(node) DO UPDATE SET at_wall = excluded.at_wall",
                        (node, now),
                    )
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")

            await self._run(uncordon)
            return
        raw = orjson.dumps(evidence or Evidence(node=node, reasons=("manual",))).decode()
        await self._run(
            lambda db: db.execute(
                "INSERT INTO cordons (node, since_wall, evidence) VALUES (?, ?, ?) "
                "ON CONFLICT(node) DO UPDATE SET evidence = excluded.evidence",
                (node, now, raw),
            )
        )

    async def record_pool_event(self, event: PoolEvent) -> None:
        row = (clock.wall(), event.change.value, event.model, event.from_pool, event.to_pool)
        await self._run(
            lambda db: db.execute(
                "INSERT INTO pool_events (at_wall, change, model, from_pool, to_pool, reason) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (*row, event.reason),
            )
        )

    async def pool_events(self, since_wall: float) -> list[PoolRecord]:
        rows: list[tuple[float, str, str, str | None, str | None, str]] = await self._run(
            lambda db: db.execute(
                "SELECT at_wall, change, model, from_pool, to_pool, reason FROM pool_events "
                "WHERE at_wall >= ? ORDER BY at_wall",
                (since_wall,),
            ).fetchall()
        )
        return [PoolRecord(*row) for row in rows]

    async def close(self) -> None:
        await self._run(lambda db: db.close())


def _evidence(raw: str | dict[str, Any]) -> Evidence:
    data: dict[str, Any] = orjson.loads(raw) if isinstance(raw, str) else raw
    return Evidence(
        node=str(data.get("node", "")),
        reasons=tuple(data.get("reasons", ())),
        restarts=tuple(
            (float(t), str(replica), str(reason)) for t, replica, reason in data.get("restarts", ())
        ),
        extra={str(k): str(v) for k, v in data.get("extra", {}).items()},
    )


# The rows of one domain kept in the store: the cordon rule reads the last K within a
# window, and people the last few; a node that restarts forever must not grow a list
# forever.
STORE_ROWS_PER_DOMAIN = 1000


class StoreLedger:
    """The ledger in the cluster store, fenced by the leader's epoch.

    `epoch()` is the current leader epoch of this instance (`RoleManager.epoch`). Keys:
    `ledger:restarts:<domain>` (a capped list of JSON rows, oldest first),
    `ledger:cordons` and `ledger:uncordons` (hashes by domain). Closing it does not
    close the store, which the composition root owns.
    """

    def __init__(self, store: ClusterStore, epoch: Callable[[], int]) -> None:
        self._store = store
        self._epoch = epoch

    async def _do(self, coro: Any) -> Any:
        try:
            return await coro
        except StoreUnavailable as e:
            raise LedgerError(f"restart ledger unreachable: {e}") from e
        except FencedOut as e:
            raise LedgerError(f"restart ledger refused a write: {e}") from e

    async def record(self, rec: RestartRecord) -> None:
        row = orjson.dumps(
            {
                "at_wall": rec.at_wall,
                "node": rec.node,
                "replica_id": rec.replica_id,
                "reason": rec.reason,
                "kind": rec.kind.value,
            }
        )
        key = f"ledger:restarts:{rec.node}"
        await self._do(self._store.append(key, row, self._epoch(), STORE_ROWS_PER_DOMAIN))

    async def _rows(self, node: str, since_wall: float, kind: RecordKind) -> list[RestartRecord]:
        raw: list[bytes] = await self._do(self._store.range(f"ledger:restarts:{node}"))
        rows = []
        for item in raw:
            d = orjson.loads(item)
            rec = RestartRecord(
                str(d["node"]),
                str(d["replica_id"]),
                str(d["reason"]),
                float(d["at_wall"]),
                RecordKind(d.get("kind", RecordKind.restart.value)),
            )
            if rec.kind is kind and rec.at_wall >= since_wall:
                rows.append(rec)
        return sorted(rows, key=lambda r: r.at_wall)

    async def restarts(self, node: str, since_wall: float) -> list[RestartRecord]:
        return await self._rows(node, since_wall, RecordKind.restart)

    async def failures(self, node: str, since_wall: float) -> list[RestartRecord]:
        return await self._rows(node, since_wall, RecordKind.failure)

    async def uncordoned_at(self, node: str) -> float | None:
        raw: dict[str, bytes] = await self._do(self._store.hgetall("ledger:uncordons"))
        return float(raw[node]) if node in raw else None

    async def cordoned_nodes(self) -> dict[str, CordonRecord]:
        raw: dict[str, bytes] = await self._do(self._store.hgetall("ledger:cordons"))
        out = {}
        for node, item in raw.items():
            d = orjson.loads(item)
            out[node] = CordonRecord(node, float(d["since_wall"]), _evidence(d["evidence"]))
        return out

    async def set_cordoned(
        self, node: str, cordoned: bool, evidence: Evidence | None = None
    ) -> None:
        now = clock.wall()
        epoch = self._epoch()
        if not cordoned:
            # The uncordon time first: a crash between the two writes leaves the node
            # cordoned (the operator asks again), never uncordoned with its old count.
            await self._do(self._store.hset("ledger:uncordons", node, repr(now).encode(), epoch))
            await self._do(self._store.hdel("ledger:cordons", node, epoch))
            return
        existing = await self.cordoned_nodes()
        since = existing[node].since_wall if node in existing else now  # kept, as in SQLite
        evidence = evidence or Evidence(node=node, reasons=("manual",))
        row = orjson.dumps({"since_wall": since, "evidence": asdict(evidence)})
        await self._do(self._store.hset("ledger:cordons", node, row, epoch))

    async def record_pool_event(self, event: PoolEvent) -> None:
        row = orjson.dumps(
            {
                "at_wall": clock.wall(),
                "change": event.change.value,
                "model": event.model,
                "from_pool": event.from_pool,
                "to_pool": event.to_pool,
                "reason": event.reason,
            }
        )
        await self._do(
            self._store.append("ledger:pools", row, self._epoch(), STORE_ROWS_PER_DOMAIN)
        )

    async def pool_events(self, since_wall: float) -> list[PoolRecord]:
        raw: list[bytes] = await self._do(self._store.range("ledger:pools"))
        rows = [PoolRecord(**orjson.loads(item)) for item in raw]
        return sorted((r for r in rows if r.at_wall >= since_wall), key=lambda r: r.at_wall)

    async def close(self) -> None:
        return None
