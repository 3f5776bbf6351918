"""Per-instance quotas in the gateway: the leader's issuer, and every instance's grants.

Several gateway instances in front of the same replicas must not together reserve more
than a replica has (its KV cache, its `inflight_max` sequences). The fleet leader divides
each replica's capacity between the live instances by their reported demand
(`policy.quota.split`) as it publishes each fleet view, and puts every instance's grants
in the view's `quotas` (`QuotaIssuer`, called through the role manager's `quotas`
hook). Each instance reads its own entry from the newest view it applied (`Grants`,
parsed once per view) and fleet admission admits against it.

One instance's entry on the wire: `{replica id: {"kv_blocks": [grant, of, held],
"seqs": [grant, of, held]}}`: `of` is the capacity that was divided (a share needs no
second source), `held` the leader's count of what the instance may be using (its
exposure: what a successor leader inherits). A resource absent from a replica's entry
is not divided (its capacity is unknown, or nothing limits it).

Must not: sit on the request path beyond `Grants.get` (an identity check and a dict
lookup), read the clock (callers pass `now`), or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from seawall.cluster.report import (
    KV_HELD,
    KV_WANTED,
    SEQS_HELD,
    SEQS_WANTED,
    InstanceReport,
)
from seawall.policy.quota import Book, Claim, Order, inherit, split

KV = "kv_blocks"
SEQS = "seqs"
# Resource -> its (held, wanted) keys in a report's demand.
RESOURCES: dict[str, tuple[str, str]] = {KV: (KV_HELD, KV_WANTED), SEQS: (SEQS_HELD, SEQS_WANTED)}

# Capacities the leader divides: replica id -> resource -> units.
Capacities = Mapping[str, Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class ReplicaGrant:
    """This instance's grants on one replica (None: that resource is not divided)."""

    kv_blocks: int | None = None
    kv_of: int | None = None
    seqs: int | None = None
    seqs_of: int | None = None

    @property
    def kv_share(self) -> float:
        """The grant as a share of the KV divided (1.0: the whole, as if alone)."""
        if self.kv_blocks is None or not self.kv_of:
            return 1.0
        return min(1.0, self.kv_blocks / self.kv_of)

    @property
    def empty(self) -> bool:
        """Nothing granted yet of a divided resource (a join the leader had not finished
        handing over: it grows a grant only once the others confirmed their shrink)."""
        return self.kv_blocks == 0 or self.seqs == 0

    @property
    def kv_shared(self) -> bool:
        """Less than the whole replica's KV: this instance is not alone on it."""
        return self.kv_blocks is not None and self.kv_of is not None and self.kv_blocks < self.kv_of


def _triple(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list | tuple) and len(value) >= 2:
        try:
            return int(value[0]), int(value[1])
        except (TypeError, ValueError):
            return None
    return None


def parse_entry(entry: Any) -> dict[str, ReplicaGrant]:
    """One instance's entry of a view's `quotas` (see the module docstring)."""
    out: dict[str, ReplicaGrant] = {}
    if not isinstance(entry, Mapping):
        return out
    for rid, per in entry.items():
        if not isinstance(per, Mapping):
            continue
        kv, seqs = _triple(per.get(KV)), _triple(per.get(SEQS))
        out[str(rid)] = ReplicaGrant(
            kv[0] if kv else None,
            kv[1] if kv else None,
            seqs[0] if seqs else None,
            seqs[1] if seqs else None,
        )
    return out


def capacity_of(load: Any, kv_ratio: float | None, inflight_max: int | None) -> dict[str, int]:
    """What is divided of one replica: its KV blocks as admission counts them (times
    `kv_ratio`: kv_reserve_max, or the adaptive kv_target) and `inflight_max` sequences.
    `load` is the replica's `EngineLoad` (None: never scraped, KV not divided)."""
    per: dict[str, int] = {}
    if kv_ratio is not None and load is not None and load.kv_capacity_tokens:
        blocks = load.kv_capacity_tokens / max(load.kv_block_size or 16, 1)
        per[KV] = int(blocks * kv_ratio + 1e-9)
    if inflight_max is not None:
        per[SEQS] = inflight_max
    return per


class Grants:
    """This instance's grants, from `source()` (the role manager's `quotas()`: its entry
    in the newest view applied, None before it has one). Re-parsed only when the entry
    is a new object, so a read per request costs an identity check and a lookup.

    `fallback_share()` (the role manager's) is this instance's even share of the fleet
    while the store is unreachable, None otherwise: an instance cut off before the
    leader granted it anything (or while its grant was still empty) admits within that
    share (`fallback`) instead of nothing."""

    def __init__(
        self,
        source: Callable[[], Any],
        fallback_share: Callable[[], float | None] = lambda: None,
    ) -> None:
        self._source = source
        self.fallback_share = fallback_share
        self._raw: Any = None
        self._parsed: dict[str, ReplicaGrant] = {}

    def _current(self) -> dict[str, ReplicaGrant] | None:
        raw = self._source()
        if raw is None:
            return None
        if raw is not self._raw:
            self._raw, self._parsed = raw, parse_entry(raw)
        return self._parsed

    @property
    def any(self) -> bool:
        """Whether this instance has been granted anything yet."""
        return self._current() is not None

    def get(self, replica_id: str) -> ReplicaGrant | None:
        """The grant on `replica_id`, or None when this instance has none there (yet)."""
        current = self._current()
        return None if current is None else current.get(replica_id)

    def fallback(self, capacity: Mapping[str, int]) -> ReplicaGrant | None:
        """With the store unreachable and no grant on a replica whose divided `capacity`
        is this: an even share of it (at least one sequence). None while the store
        answers: then the leader's grant is a second or two away."""
        share = self.fallback_share()
        if share is None:
            return None
        kv, seqs = capacity.get(KV), capacity.get(SEQS)
        return ReplicaGrant(
            None if kv is None else int(kv * share + 1e-9),
            kv,
            None if seqs is None else max(1, int(seqs * share + 1e-9)),
            seqs,
        )

    def figures(self) -> dict[str, dict[str, Any]]:
        current = self._current() or {}
        return {
            rid: {
                KV: None if g.kv_blocks is None else {"grant": g.kv_blocks, "of": g.kv_of},
                SEQS: None if g.seqs is None else {"grant": g.seqs, "of": g.seqs_of},
            }
            for rid, g in current.items()
        }


def _claim(report: InstanceReport, replica_id: str, resource: str) -> Claim:
    confirmed: Order = report.view_applied
    r = report.replicas.get(replica_id)
    if r is None:
        return Claim(confirmed, 0, 0)
    held_key, wanted_key = RESOURCES[resource]
    held = math.ceil(max(0.0, float(r.demand.get(held_key, 0.0))) - 1e-9)
    wanted = math.ceil(max(0.0, float(r.demand.get(wanted_key, 0.0))) - 1e-9)
    return Claim(confirmed, held, max(held, wanted))


class QuotaIssuer:
    """The leader's side. `capacities()` says what to divide (from the leader's own
    snapshot); `issue` is called once per published view, with every live instance's
    report (the leader's own included) and the order of the view being published."""

    def __init__(self, capacities: Callable[[], Capacities], release_after_s: float) -> None:
        self.capacities = capacities
        self.release_after_s = release_after_s
        self._books: dict[tuple[str, str], dict[str, Book]] = {}
        self._fresh = True  # no view issued yet as this leader: inherit the last one's holds
        self._last: dict[tuple[str, str], tuple[int, dict[str, int]]] = {}

    def reset(self) -> None:
        """Leadership (re)gained or lost: the next `issue` starts from the view's holds."""
        self._books.clear()
        self._last.clear()
        self._fresh = True

    def _inherit(
        self, quotas: Mapping[str, Any], now: float, last_seen: Mapping[str, float] | None
    ) -> None:
        holds: dict[tuple[str, str], dict[str, int]] = {}
        for name, entry in quotas.items():
            if not isinstance(entry, Mapping):
                continue
            for rid, per in entry.items():
                if not isinstance(per, Mapping):
                    continue
                for resource in RESOURCES:
                    value = per.get(resource)
                    if isinstance(value, list | tuple) and len(value) >= 3:
                        try:
                            hold = max(int(value[0]), int(value[2]))
                        except (TypeError, ValueError):
                            continue
                        holds.setdefault((str(rid), resource), {})[str(name)] = hold
        for key, by_name in holds.items():
            self._books[key] = inherit(by_name, now, last_seen)

    def issue(
        self,
        reports: Mapping[str, InstanceReport],
        order: Order,
        now: float,
        last_view_quotas: Mapping[str, Any],
        last_seen: Mapping[str, float] | None = None,
    ) -> dict[str, dict[str, dict[str, list[int]]]]:
        """Every instance's entry for the view `order` (see the module docstring).
        `last_seen`: when each instance's report was last read (`Peers.last_seen`), for
        a new leader's inherited holds."""
        if self._fresh:
            self._fresh = False
            self._inherit(last_view_quotas, now, last_seen)
        out: dict[str, dict[str, dict[str, list[int]]]] = {}
        capacities = self.capacities()
        for rid, per in capacities.items():
            for resource, capacity in per.items():
                key = (rid, resource)
                claims = {name: _claim(rep, rid, resource) for name, rep in reports.items()}
                s = split(
                    self._books.get(key, {}), claims, capacity, order, now, self.release_after_s
                )
                self._books[key] = dict(s.books)
                self._last[key] = (s.capacity, dict(s.grants))
                for name, grant in s.grants.items():
                    held = s.books[name].exposure
                    out.setdefault(name, {}).setdefault(rid, {})[resource] = [
                        grant,
                        s.capacity,
                        held,
                    ]
        for key in [k for k in self._books if k[0] not in capacities]:
            del self._books[key]  # the replica left (or its capacity is no longer known)
            self._last.pop(key, None)
        return out

    def figures(self) -> dict[str, dict[str, Any]]:
        """What the leader has divided, per replica and resource (the admin API, bench)."""
        out: dict[str, dict[str, Any]] = {}
        for (rid, resource), books in self._books.items():
            capacity, grants = self._last.get((rid, resource), (0, {}))
            out.setdefault(rid, {})[resource] = {
                "capacity": capacity,
                "exposed": sum(b.exposure for b in books.values()),
                "instances": {
                    name: {"grant": grants.get(name, 0), "exposure": b.exposure, "held": b.held}
                    for name, b in sorted(books.items())
                },
            }
        return out
