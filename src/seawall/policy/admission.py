"""Admission: when a replica takes no new work, and what to do when none will.

Why admit at the gateway at all. An engine accepts every request it is sent and queues
it internally. Past a point, queueing inside the engine only hurts: the KV cache fills,
the engine starts preempting running requests (recomputing their work), throughput
drops and every request in the engine gets slower, including the ones that were fine.
The gateway sees the engine's load (scraped) and its own in-flight count, so it can stop
sending work to a saturated replica and, when the whole fleet is saturated, hold or
refuse requests itself, where waiting is cheap and a refusal can be made quickly with an
honest Retry-After.

Per replica (`replica_saturated`): a replica is saturated when any threshold is exceeded:

- metrics missing or older than `metrics_max_age_s`: reason exactly "metrics stale".
  Routing new work to a replica whose load is unknown is a guess; the safe default is no.
- gateway in-flight at or over `inflight_max` (when set): the gateway's own count, so
  it is never stale;
- KV usage over `kv_usage_max`, engine queue over `waiting_max`, preemption rate over
  `preemption_rate_max_per_s`. "Over" is strict: a value equal to the maximum is allowed.

A load field the engine does not export (None) skips that check: unknown is not the
same as full, and an engine without a KV gauge is still protected by `inflight_max`.

Fleet level (`on_fleet_saturated`), when every replica serving the model is saturated:
priorities are numbers where 0 is the most important tier and larger numbers are less
important. Tiers up to `lowest_priority_to_queue` may wait in the gateway queue; lower
tiers are shed at once. Within the queue, lower tiers are shed first as it fills: tier p
may queue only while

    queue_len < queue_max * (lowest_priority_to_queue - p + 1) / (lowest_priority_to_queue + 1)

so tier 0 can use the whole queue, and the lowest queueable tier its last share (with
lowest_priority_to_queue = 1: tier 0 all of it, tier 1 the first half).

Retry-After is an estimate, never a constant: the time for the fleet to work through
the requests already queued plus this one at the recent completion rate,
`(queue_len + 1) / completions_per_s`, rounded up to whole seconds (HTTP Retry-After is
whole seconds) and clamped to [min_retry_after_s, max_retry_after_s]. With nothing
completing (rate 0 or unknown) it is `max_retry_after_s`: the fleet is not draining, so
clients should back off as far as we allow.

Taking turns (`Refusals`). A tier that is shed at once never waits, so under sustained
overload whoever is already being served keeps its place: a closed-loop client sends
its next request the moment its last one ends and takes the room that request freed,
while the refused clients come back after their Retry-After and find the fleet full
again. In the issue-17 benchmark a third of the clients were never served at all. So a
request refused `patience` times (the same tenant sending the same body again, as SDKs
and retrying clients do) waits in the queue the next time, within `queue_max` and
`queue_timeout_s`, and while such a request waits no fresh request of its tier takes
room ahead of it: the room goes to whoever was refused first.

Turns held, not connections (`Turns`, `admission.turns: hold`, the default). Waiting in
the queue puts the wait in the request's time to first token: in the issue-17 benchmark
the requests that queued raised the TTFT p99 of admitted requests from 0.13 s (no
admission) to 2.3 s, for the same engine throughput. So instead a request refused
`patience` times is owed a turn: it is refused again now, with a Retry-After, and until
it comes back (or its turn lapses, `hold_s` after it was last refused: a client that
gave up) no fresh request of its tier or a worse one takes the room it needs (the
caller judges a fresh request with the needs of the turns owed added to its own: it is
admitted where it fits beside them; holding all the room while any turn was owed
refused fresh requests that fitted, which were then owed turns themselves, and in the
benchmark's mixed chats the engines ran 6-8 of 12 clients' requests for seconds with
their caches 30-60% full). The room a completion frees waits for whichever owed request
comes back first, which then starts at once; but once a turn has been owed for longer
than the caller's `overdue_s` (`queue_timeout_s`), the room goes to the oldest such
turn alone, so that a client that polls at unlucky moments is not outrun for ever. A
client that never comes back costs the fleet `hold_s` of that room.
`turns: queue` keeps the queue instead, for clients that give up after few retries
(the OpenAI SDKs retry twice by default): their third attempt waits rather than fails.

Must not: read the clock, hold the queue, or count completions. The caller passes `now`,
the in-flight count and the measured completion rate.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from seawall.policy.load import EngineLoad

METRICS_STALE = "metrics stale"
# A replica whose engine has metrics, not scraped yet (a gateway just started, a new
# leader, a /metrics slow under load): nothing says what its cache holds yet.
NOT_SCRAPED = "no engine metrics yet (waiting for the first scrape)"


@dataclass(frozen=True, slots=True)
class AdmissionThresholds:
    kv_usage_max: float = 0.9
    waiting_max: float = 5
    # Sustained preemptions above a few per second mean the engine is recomputing
    # evicted work instead of producing tokens (see `storm`).
    preemption_rate_max_per_s: float = 2.0
    metrics_max_age_s: float = 5.0
    inflight_max: int | None = None


def replica_saturated(
    load: EngineLoad | None,
    inflight: int,  # engine sequences in flight through this gateway (`n` per prompt)
    preemption_rate_per_s: float | None,
    now: float,
    t: AdmissionThresholds,
) -> str | None:
    """None when the replica may take new work, else why not (for logs and the admin API)."""
    if load is None or now - load.scraped_at > t.metrics_max_age_s:
        return METRICS_STALE
    if t.inflight_max is not None and inflight >= t.inflight_max:
        return f"{inflight} sequences in flight, at the limit of {t.inflight_max} (inflight_max)"
    if load.kv_usage is not None and load.kv_usage > t.kv_usage_max:
        return f"kv cache {load.kv_usage:.0%} used, over {t.kv_usage_max:.0%} (kv_usage_max)"
    if load.waiting is not None and load.waiting > t.waiting_max:
        return f"{load.waiting:g} requests waiting, over {t.waiting_max:g} (waiting_max)"
    if preemption_rate_per_s is not None and preemption_rate_per_s > t.preemption_rate_max_per_s:
        return (
            f"{preemption_rate_per_s:.2g} preemptions/s, over "
            f"{t.preemption_rate_max_per_s:g} (preemption_rate_max_per_s)"
        )
    return None


def slot_free(load: EngineLoad | None, in_flight: int) -> bool:
    """Whether a request sent now would start at once rather than wait for a slot, as far
    as the engine says (`slots`; engines that do not say are given the benefit). `in_flight`:
    sequences this gateway has open there, which the last scrape may not show yet."""
    if load is None or load.slots is None:
        return True
    return max(load.running or 0.0, float(in_flight)) < load.slots


@dataclass(frozen=True, slots=True)
class Queue:
    """Wait in the gateway queue; `expected_wait_s` is the drain estimate (may be inf)."""

    expected_wait_s: float


@dataclass(frozen=True, slots=True)
class Shed:
    """Refuse now (429) with `Retry-After: retry_after_s` (whole seconds)."""

    retry_after_s: float
    reason: str = ""


def estimated_drain_s(queue_len: int, completions_per_s: float) -> float:
    """Seconds for the fleet to complete the queued requests plus one more."""
    if not completions_per_s > 0:  # also catches NaN
        return math.inf
    return (max(queue_len, 0) + 1) / completions_per_s


def retry_after_s(
    queue_len: int,
    completions_per_s: float,
    min_retry_after_s: float = 1.0,
    max_retry_after_s: float = 60.0,
) -> float:
    """The Retry-After estimate (see the module docstring), whole seconds, clamped."""
    drain_s = estimated_drain_s(queue_len, completions_per_s)
    if math.isinf(drain_s):
        return max_retry_after_s
    return min(max_retry_after_s, max(min_retry_after_s, float(math.ceil(drain_s))))


def on_fleet_saturated(
    tier_priority: int,
    queue_len: int,
    queue_max: int,
    lowest_priority_to_queue: int,
    completions_per_s: float,
    min_retry_after_s: float = 1.0,
    max_retry_after_s: float = 60.0,
) -> Queue | Shed:
    """Queue or shed a request of `tier_priority` when no replica will take it now.

    `completions_per_s` is the fleet's recent completion rate for the model (requests
    finished per second); it sets both the queue's expected wait and Retry-After.
    """

    def shed(reason: str) -> Shed:
        return Shed(
            retry_after_s(queue_len, completions_per_s, min_retry_after_s, max_retry_after_s),
            reason,
        )

    if tier_priority > lowest_priority_to_queue or lowest_priority_to_queue < 0 or queue_max <= 0:
        return shed(f"requests of priority {tier_priority} are not queued")
    tiers = lowest_priority_to_queue + 1
    share = (lowest_priority_to_queue - max(tier_priority, 0) + 1) / tiers
    allowed_len = queue_max * share
    if queue_len >= allowed_len:
        if queue_len >= queue_max:
            return shed(f"queue full ({queue_len}/{queue_max})")
        return shed(
            f"priority {tier_priority}'s share of the queue is full "
            f"({queue_len}/{allowed_len:g} of {queue_max})"
        )
    return Queue(expected_wait_s=estimated_drain_s(queue_len, completions_per_s))


def kv_reservation_full(
    reserved_blocks: float, capacity_blocks: float | None, max_ratio: float | None
) -> str | None:
    """Saturated by reservations: the replica's in-flight requests may grow to fill its KV cache.

    Why reserve and not only read `kv_usage`: a request's KV grows by one token per step
    until it finishes, so a cache that is 60 % full now can be over-full in a few hundred
    steps with nothing new admitted, and then the engine preempts. Each in-flight request
    reserves the KV blocks its prompt plus `max_tokens` may grow to (whole blocks, as the
    engine allocates them); a request is admitted to a replica only while the replica's
    reservations *including this request* stay within `max_ratio` of its blocks, so the
    caller passes `reserved_blocks` with the incoming request counted. `max_ratio` 1.0 means
    no preemption even if every request runs to `max_tokens`; above 1.0 overcommits,
    betting that requests stop early (at end of sequence) as most do. None disables.
    """
    if max_ratio is None or not capacity_blocks:
        return None
    limit = capacity_blocks * max_ratio
    if reserved_blocks > limit:
        return (
            f"{reserved_blocks:.0f} KV blocks would be reserved by requests in flight, over "
            f"{max_ratio:g} x the cache's {capacity_blocks:.0f} (kv_reserve_max)"
        )
    return None


class Refusals:
    """How many times each request (a key the caller derives from tenant and body) was
    refused for a saturated fleet lately. Bounded: an entry lapses `ttl_s` after its
    last refusal, and past `max_entries` the oldest goes first. `patience` 0: never
    patient (every refusal is final, as before)."""

    def __init__(self, patience: int, ttl_s: float = 30.0, max_entries: int = 4096) -> None:
        self.patience = patience
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: OrderedDict[Hashable, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen:
            _, (_, last) = next(iter(seen.items()))
            if now - last < self.ttl_s:
                return
            seen.popitem(last=False)

    def patient(self, key: Hashable, now: float) -> bool:
        """This request was refused `patience` times already: let it wait its turn."""
        if self.patience <= 0:
            return False
        self._expire(now)
        entry = self._seen.get(key)
        return entry is not None and entry[0] >= self.patience

    def refused(self, key: Hashable, now: float) -> int:
        """Count one more refusal of `key`; returns how many it has had."""
        if self.patience <= 0:
            return 0
        self._expire(now)
        count = self._seen.pop(key, (0, now))[0] + 1
        self._seen[key] = (count, now)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return count

    def served(self, key: Hashable) -> None:
        """It got in: its next request starts afresh."""
        self._seen.pop(key, None)


class Turns:
    """Requests owed a turn (see the module doc), per model and priority, oldest first.
    Bounded: a turn lapses at its `until`, and past `max_entries` the oldest goes first.

    The room that frees goes to whichever owed request comes back first, unless a turn
    has been owed for longer than the caller's `overdue_s`: then to the oldest such one
    alone (`first_overdue`), so that no client is outrun for ever by others that poll at
    luckier moments."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        # key -> (model, priority, until, since, need); in the order first owed (a
        # renewal keeps its place and `since`).
        self._owed: OrderedDict[Hashable, tuple[str, int, float, float, int]] = OrderedDict()
        self._lapses: list[tuple[float, int, Hashable]] = []  # (until, seq, key), some stale
        self._seq = 0
        self._count: dict[tuple[str, int], int] = {}  # live turns per (model, priority)

    def __len__(self) -> int:
        return len(self._owed)

    def _drop(self, key: Hashable) -> None:
        entry = self._owed.pop(key, None)
        if entry is not None:
            model, priority = entry[0], entry[1]
            n = self._count[(model, priority)] - 1
            if n:
                self._count[(model, priority)] = n
            else:
                del self._count[(model, priority)]

    def _expire(self, now: float) -> None:
        lapses, owed = self._lapses, self._owed
        while lapses and lapses[0][0] <= now:
            until, _, key = heapq.heappop(lapses)
            entry = owed.get(key)
            if entry is not None and entry[2] == until:  # not renewed since
                self._drop(key)

    def grant(
        self, key: Hashable, model: str, priority: int, until: float, now: float, need: int = 0
    ) -> None:
        """`key` is owed a turn until the monotonic `until` (renewed when it already is:
        it keeps its place in the order). `need`: what it reserves (the caller's tokens,
        `owed_needs`)."""
        entry = self._owed.get(key)
        if entry is not None and (entry[0], entry[1]) == (model, priority):
            self._owed[key] = (model, priority, until, entry[3], need)
        else:
            self._drop(key)
            self._owed[key] = (model, priority, until, now, need)
            self._count[(model, priority)] = self._count.get((model, priority), 0) + 1
        self._seq += 1
        heapq.heappush(self._lapses, (until, self._seq, key))
        while len(self._owed) > self.max_entries:
            self._drop(next(iter(self._owed)))
        if len(self._lapses) > 4 * self.max_entries:  # stale entries of renewals
            self._lapses = [(e[2], i, k) for i, (k, e) in enumerate(self._owed.items())]
            heapq.heapify(self._lapses)

    def holds(self, key: Hashable, now: float) -> bool:
        self._expire(now)
        return key in self._owed

    def owed_ahead(self, model: str, priority: int, now: float) -> bool:
        """A turn is owed to a request of `model` at `priority` or a better one."""
        self._expire(now)
        return any(m == model and p <= priority for m, p in self._count)

    def owed_needs(self, model: str, priority: int, now: float) -> list[int]:
        """What the requests owed a turn at `priority` or a better one reserve: the room
        held for them, which a fresh request may not take (beside it, it may)."""
        if not self.owed_ahead(model, priority, now):
            return []
        return [e[4] for e in self._owed.values() if e[0] == model and e[1] <= priority]

    def first_overdue(
        self, model: str, priority: int, now: float, overdue_s: float
    ) -> Hashable | None:
        """The oldest turn owed to a request of `model` at `priority` or a better one, if
        it has been owed for longer than `overdue_s`; else None."""
        self._expire(now)
        for key, (m, p, _, since, _) in self._owed.items():
            if m == model and p <= priority:
                return key if now - since > overdue_s else None
        return None

    def take(self, key: Hashable) -> None:
        """Its request got in: the turn is used."""
        self._drop(key)
