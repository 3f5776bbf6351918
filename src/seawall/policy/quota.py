"""Leader-issued quotas: how one replica's capacity (its KV blocks, or its sequence slots)
is divided between the gateway instances in front of it, so that together they never
reserve more than it has.

Owns the division (`split`) and the leader's book of what each instance may be using
(`Book`). Must not read the clock (`now` is an argument), do I/O, or know what the
resource is: the caller names it, sizes it and says what each instance reports.

Why quotas and not one shared count. Every admission could instead reserve on a counter
in the shared store (one atomic round trip to admit, one to release). That puts the
store on every request's path: its latency is added to every first token, and a slow or
absent store stalls or blinds admission itself. Quotas (as Google's Doorman hands out
rate capacity) keep the request path local: the leader divides each replica between
the instances, off the request path, and each admits against its own grant with an
attribute read. The store's health then only decides how fast grants move, never
whether a request is admitted. (The measured costs of both are in bench/bench_quota.py.)

Demand. Each instance reports, per replica and resource, what it holds (`held`: its
reservations there now) and what it wants (`wanted`: held, plus what waits in its
queue or was refused for want of room lately). Capacity is shared max-min fairly over
`wanted` (no instance gets more than it wants while another gets less than its equal
share); what nobody wants is split evenly, so that an instance can admit a request that
arrives before the next round.

The invariant, and why grants are versioned. An instance admits against the grant in
the newest view it has applied, and it learns of a new grant only some time after the
leader issued it (a poll interval); until then it may still use its old one. So the
leader cannot hand one instance's capacity to another the moment it shrinks the first:
the first may be using it for a while yet. Each grant is recorded with the view that
carried it (`Order`: the view's epoch and sequence number), and each instance reports
the newest view it has applied (`confirmed`). What an instance may be using is then
bounded by its `exposure`:

    exposure = max(held, every grant issued to it in a view from `confirmed` on)

(its reservations cannot exceed the grants it had since it reported, nor shrink below
what it reported holding until they are released). The leader keeps

    sum of exposures <= capacity

at every split: a shrink is issued at once (it changes no exposure until confirmed),
a grow only into the room the exposures leave. Shrink first, confirm, then grant
elsewhere. Should the capacity shrink under existing exposures (a replica restarted with
a smaller cache), no grant grows until the exposures fit again.

Instances that leave. An instance whose report stops arriving is granted nothing from
then on, but what it may be using stays counted for `release_after_s`: it may only be
slow. A crashed instance's requests end with its connections (the engine frees their
KV), so after that wait its exposure is released. One that is alive but cut off from
the store keeps admitting on its last grant (fail-static) and is the case this cannot
make exact: past `release_after_s` its share may be granted again.

A new leader. The books are the leader's own state; a successor starts them from the
last view's published holds (`inherit`), each counted as issued since the beginning, so
that nothing an instance may still use from an earlier leader's grants is forgotten.
An instance whose report the successor last saw some time ago (the old leader itself,
dead) keeps its hold for `release_after_s` from that sighting, as it would have under
the old leader, not from the promotion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

# A view's place in the order of all views, across leaders: (epoch, seq).
Order = tuple[int, int]
BEFORE_ANY: Order = (0, 0)


@dataclass(frozen=True, slots=True)
class Claim:
    """One instance's report about one resource of one replica."""

    confirmed: Order  # the newest view it had applied when it reported
    held: int  # what it has reserved there now
    wanted: int  # held plus what waits or was refused for room lately (>= held)


@dataclass(frozen=True, slots=True)
class Book:
    """What the leader knows of one instance's use of one resource of one replica.

    `issued` lists the grants issued to it as (first view carrying it, amount), oldest
    first, from the one in force at `confirmed` on (earlier ones are forgotten: the
    instance has moved past them)."""

    issued: tuple[tuple[Order, int], ...] = ()
    confirmed: Order = BEFORE_ANY
    held: int = 0
    seen_at: float = 0.0  # when its last report was read (monotonic seconds)

    @property
    def granted(self) -> int:
        """The newest grant issued to it (0 before any)."""
        return self.issued[-1][1] if self.issued else 0

    @property
    def exposure(self) -> int:
        """The most it may be using now: see the module docstring."""
        return max([self.held, *(amount for _, amount in self.issued)])


@dataclass(frozen=True, slots=True)
class Split:
    books: Mapping[str, Book]
    grants: Mapping[str, int]  # what each known instance is granted in the view `order`
    capacity: int

    def exposed(self) -> int:
        return sum(b.exposure for b in self.books.values())


def _pruned(book: Book) -> Book:
    """Forget the grants issued before the one in force at `confirmed`."""
    issued = book.issued
    keep = 0
    for i, (order, _) in enumerate(issued):
        if order <= book.confirmed:
            keep = i
    return replace(book, issued=issued[keep:]) if keep else book


def _read(book: Book, claim: Claim, now: float) -> Book:
    """A report: newer than what the book knows, it replaces `confirmed` and `held`; an
    older one (delayed) only says the instance is alive."""
    if claim.confirmed >= book.confirmed:
        book = replace(book, confirmed=claim.confirmed, held=max(claim.held, 0))
    return _pruned(replace(book, seen_at=now))


def fair_shares(available: int, wanted: Mapping[str, int]) -> dict[str, int]:
    """Max-min fair integer shares of `available` over `wanted`; when everything wanted
    fits, the rest is split evenly on top. Deterministic (ties go by name)."""
    names = sorted(wanted)
    if not names:
        return {}
    available = max(available, 0)
    want = {n: max(wanted[n], 0) for n in names}
    total = sum(want.values())
    if total <= available:
        base, extra = divmod(available - total, len(names))
        return {n: want[n] + base + (1 if i < extra else 0) for i, n in enumerate(names)}
    out: dict[str, int] = {}
    left = available
    by_want = sorted(names, key=lambda n: (want[n], n))
    for i, n in enumerate(by_want):
        share = left // (len(by_want) - i)
        out[n] = min(want[n], share)
        left -= out[n]
    for n in names:  # what the floors left over, one each to those still short
        if left <= 0:
            break
        if out[n] < want[n]:
            out[n] += 1
            left -= 1
    return out


def split(
    books: Mapping[str, Book],
    claims: Mapping[str, Claim],
    capacity: int,
    order: Order,
    now: float,
    release_after_s: float,
) -> Split:
    """The grants for the view `order`, from the live instances' `claims` (an instance
    with no claim is absent), and the books after it. `sum of exposures <= capacity`
    holds after the split whenever it held before it (and never gets worse)."""
    capacity = max(capacity, 0)
    kept: dict[str, Book] = {}
    for name, claim in claims.items():
        kept[name] = _read(books.get(name, Book(seen_at=now)), claim, now)
    gone: list[str] = []
    for name, book in books.items():
        if name in claims:
            continue
        if now - book.seen_at < release_after_s:
            kept[name] = book
            gone.append(name)
        # else: released (see "Instances that leave")

    exposure = {name: b.exposure for name, b in kept.items()}
    away = sum(exposure[n] for n in gone)
    targets = fair_shares(capacity - away, {n: c.wanted for n, c in claims.items()})
    room = capacity - sum(exposure.values())

    grants: dict[str, int] = {n: 0 for n in gone}
    growing: list[str] = []
    for name, target in targets.items():
        if target <= exposure[name]:
            grants[name] = target  # a shrink, or no change: safe at once
        else:
            growing.append(name)
    # Grow into the room left, the furthest below its target first.
    growing.sort(key=lambda n: (exposure[n] - targets[n], n))
    for name in growing:
        more = min(targets[name] - exposure[name], max(room, 0))
        grants[name] = exposure[name] + more
        room -= more

    out: dict[str, Book] = {}
    for name, book in kept.items():
        g = grants[name]
        if g != book.granted:
            book = replace(book, issued=(*book.issued, (order, g)))
        out[name] = book
    return Split(out, grants, capacity)


def inherit(
    holds: Mapping[str, int], now: float, last_seen: Mapping[str, float] | None = None
) -> dict[str, Book]:
    """A new leader's books, from the holds the last view published: each counted as
    issued before any view, so that it stays in the exposure until the instance has
    confirmed a grant of this leader's. `last_seen`: when the new leader last saw each
    instance's report (`now` for one it never saw): an instance that has stopped
    reporting is released `release_after_s` after that, as under the old leader, not
    after the new one took over."""
    seen = last_seen or {}
    return {
        name: Book(issued=((BEFORE_ANY, max(int(h), 0)),), seen_at=min(now, seen.get(name, now)))
        for name, h in holds.items()
    }
