"""Leader-issued quotas (policy/quota.py): the division of one replica's capacity between
gateway instances, with literal values, and the invariant as a property of a whole
simulated fleet: instances that learn their grants late (or skip views), report late
(or out of order), reserve and release at will, crash, and a leader that is replaced;
at every step what they reserve together stays within the capacity."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.policy.quota import (
    BEFORE_ANY,
    Book,
    Claim,
    Order,
    fair_shares,
    inherit,
    split,
)

RELEASE_S = 6.0


def test_fair_shares_split_spare_evenly_and_cap_the_greedy() -> None:
    assert fair_shares(159, {"a": 0, "b": 0, "c": 0}) == {"a": 53, "b": 53, "c": 53}
    # Everything wanted fits: each gets what it wants and a third of the rest.
    assert fair_shares(100, {"a": 10, "b": 40, "c": 20}) == {"a": 20, "b": 50, "c": 30}
    # Max-min fair: the small demand is met in full, the others share the rest.
    assert fair_shares(100, {"a": 10, "b": 400, "c": 200}) == {"a": 10, "b": 45, "c": 45}
    assert sum(fair_shares(101, {"a": 400, "b": 400, "c": 400}).values()) == 101
    assert fair_shares(0, {"a": 5}) == {"a": 0}
    assert fair_shares(10, {}) == {}


def test_three_new_instances_get_a_third_each_at_once() -> None:
    claims = {n: Claim(BEFORE_ANY, 0, 200) for n in "abc"}
    s = split({}, claims, 159, (1, 1), 0.0, RELEASE_S)
    assert s.grants == {"a": 53, "b": 53, "c": 53}
    assert s.exposed() == 159


def test_a_single_instance_is_granted_the_whole_capacity() -> None:
    s = split({}, {"a": Claim(BEFORE_ANY, 0, 0)}, 159, (1, 1), 0.0, RELEASE_S)
    assert s.grants == {"a": 159}


def test_capacity_moves_only_after_the_shrink_is_confirmed() -> None:
    """a wants little now, c wants much: a is shrunk at once, but c grows into a's old
    share only once a has reported applying the view with its smaller grant."""
    busy = {n: Claim(BEFORE_ANY, 0, 200) for n in "abc"}
    s1 = split({}, busy, 150, (1, 1), 0.0, RELEASE_S)
    assert s1.grants == {"a": 50, "b": 50, "c": 50}
    # a's demand drops to 10 (it still reports the view before s1: it has not seen its
    # grant yet); c's grows.
    claims = {
        "a": Claim(BEFORE_ANY, 10, 10),
        "b": Claim((1, 1), 50, 200),
        "c": Claim((1, 1), 50, 400),
    }
    s2 = split(s1.books, claims, 150, (1, 2), 1.0, RELEASE_S)
    assert s2.grants["a"] == 10  # shrunk at once
    assert s2.grants["c"] == 50  # but no room yet: a may still use its 50
    assert s2.exposed() <= 150
    # a confirms (1, 2) and holds 10: its 40 go to the others.
    claims["a"] = Claim((1, 2), 10, 10)
    s3 = split(s2.books, claims, 150, (1, 3), 2.0, RELEASE_S)
    assert s3.grants == {"a": 10, "b": 70, "c": 70}
    assert s3.exposed() == 150


def test_reservations_above_a_shrunk_grant_stay_counted_until_released() -> None:
    first = {"a": Claim(BEFORE_ANY, 0, 300), "b": Claim(BEFORE_ANY, 0, 0)}
    s1 = split({}, first, 100, (1, 1), 0, RELEASE_S)
    assert s1.grants == {"a": 100, "b": 0}
    # b now wants 100; a holds 90 under its grant of 100 and has confirmed it.
    claims = {"a": Claim((1, 1), 90, 300), "b": Claim((1, 1), 0, 100)}
    s2 = split(s1.books, claims, 100, (1, 2), 1.0, RELEASE_S)
    assert s2.grants == {"a": 50, "b": 0}
    # a confirmed 50 but still holds 90: only 10 can go to b.
    claims["a"] = Claim((1, 2), 90, 300)
    s3 = split(s2.books, claims, 100, (1, 3), 2.0, RELEASE_S)
    assert s3.grants == {"a": 50, "b": 10}
    claims["a"] = Claim((1, 3), 40, 300)
    s4 = split(s3.books, claims, 100, (1, 4), 3.0, RELEASE_S)
    assert s4.grants == {"a": 50, "b": 50}


def test_an_instance_that_leaves_keeps_its_share_counted_for_a_while() -> None:
    s1 = split({}, {n: Claim(BEFORE_ANY, 0, 100) for n in "ab"}, 100, (1, 1), 0, 6)
    claims = {"a": Claim((1, 1), 50, 100)}  # b's reports stop
    s2 = split(s1.books, claims, 100, (1, 2), 1.0, RELEASE_S)
    assert s2.grants == {"a": 50, "b": 0}
    s3 = split(s2.books, claims, 100, (1, 3), 1.0 + RELEASE_S, RELEASE_S)
    assert "b" not in s3.books
    assert s3.grants == {"a": 100}


def test_no_grant_grows_while_a_shrunk_capacity_is_overcommitted() -> None:
    s1 = split({}, {n: Claim(BEFORE_ANY, 0, 100) for n in "ab"}, 100, (1, 1), 0, 6)
    claims = {n: Claim((1, 1), 50, 100) for n in "ab"}
    s2 = split(s1.books, claims, 60, (1, 2), 1.0, RELEASE_S)  # a smaller cache now
    assert s2.grants == {"a": 30, "b": 30}
    assert s2.exposed() == 100  # what they hold: nothing more is granted until it fits


def test_a_new_leader_counts_the_old_leaders_holds() -> None:
    books = inherit({"a": 80, "b": 20}, now=0.0)
    claims = {"a": Claim((1, 9), 10, 10), "b": Claim((1, 9), 20, 200)}
    s = split(books, claims, 100, (2, 10), 0.5, RELEASE_S)
    assert s.grants["a"] == 10
    assert s.grants["b"] == 20  # a may still be using the 80 it had
    claims["a"] = Claim((2, 10), 10, 10)
    s2 = split(s.books, claims, 100, (2, 11), 1.0, RELEASE_S)
    assert s2.grants == {"a": 10, "b": 90}


def test_a_new_leader_releases_a_dead_instance_from_its_last_report_not_its_promotion() -> None:
    """The old leader (a) died holding 100 of 100 before b's share was confirmed; b saw
    a's last report at t=0 and takes over at t=4. a's hold is released 6 s after that
    last report, as the old leader would have released any instance's, not 6 s after
    the promotion (b admitted nothing for 4 s longer)."""
    books = inherit({"a": 100, "b": 0}, now=4.0, last_seen={"a": 0.0})
    b_wants = {"b": Claim((1, 5), 0, 100)}
    s = split(books, b_wants, 100, (2, 6), 4.0, RELEASE_S)
    assert s.grants == {"a": 0, "b": 0}  # a may still be using it: nothing for b yet
    s = split(s.books, {"b": Claim((2, 6), 0, 100)}, 100, (2, 7), 5.9, RELEASE_S)
    assert s.grants["b"] == 0
    s = split(s.books, {"b": Claim((2, 7), 0, 100)}, 100, (2, 8), 6.1, RELEASE_S)
    assert s.grants == {"b": 100} and "a" not in s.books
    # An instance the successor never saw counts from the promotion.
    never = inherit({"a": 100}, now=4.0, last_seen={})
    assert never["a"].seen_at == 4.0


# --------------------------------------------------------------- the fleet, simulated


@dataclass
class Inst:
    applied: Order = BEFORE_ANY
    grant: int = 0  # from the newest view applied
    reserved: int = 0
    alive: bool = True
    sent: list[Claim] = field(default_factory=list)
    read_at: float = 0.0  # when the leader last read a report of it


@dataclass
class Fleet:
    capacity: int
    insts: dict[str, Inst]
    views: list[tuple[Order, dict[str, int], dict[str, int]]] = field(default_factory=list)
    books: dict[str, Book] = field(default_factory=dict)
    epoch: int = 1
    seq: int = 0
    now: float = 0.0

    def check(self) -> None:
        live = [i for i in self.insts.values() if i.alive]
        assert sum(i.reserved for i in live) <= self.capacity
        # Stronger: what each may be using is within what the leader counts for it.
        for name, inst in self.insts.items():
            if inst.alive and (inst.reserved or inst.grant):
                book = self.books.get(name)
                assert book is not None and max(inst.reserved, inst.grant) <= book.exposure
        assert sum(b.exposure for b in self.books.values()) <= self.capacity


NAMES = ("a", "b", "c", "d")

event = st.one_of(
    # Per instance: read its newest report (0), an older one (1..3), or none this round
    # (-1: its heartbeat is late; it is alive and keeps what it holds).
    st.tuples(st.just("publish"), st.lists(st.integers(-1, 3), min_size=4, max_size=4)),
    st.tuples(st.just("apply"), st.sampled_from(NAMES), st.integers(0, 50)),
    st.tuples(st.just("reserve"), st.sampled_from(NAMES), st.integers(1, 40)),
    st.tuples(st.just("release"), st.sampled_from(NAMES), st.integers(1, 40)),
    st.tuples(st.just("report"), st.sampled_from(NAMES), st.integers(0, 120)),
    st.tuples(st.just("crash"), st.sampled_from(NAMES), st.just(0)),
    st.tuples(st.just("failover"), st.just(""), st.just(0)),
    st.tuples(st.just("tick"), st.just(""), st.integers(1, 4000)),
)


@settings(max_examples=500, deadline=None)
@given(capacity=st.integers(0, 200), events=st.lists(event, max_size=120))
def test_instances_together_never_reserve_more_than_the_capacity(
    capacity: int, events: list[tuple[object, ...]]
) -> None:
    fleet = Fleet(capacity, {n: Inst() for n in NAMES})
    for ev in events:
        kind = ev[0]
        if kind == "publish":
            # The leader reads, for each live instance, one of the reports it has sent
            # (the newest, or a delayed older one), or none when it is late (never for
            # as long as `release_after_s`: then it counts as gone); a crashed one's
            # reports are gone.
            picks = ev[1]
            assert isinstance(picks, list)
            claims: dict[str, Claim] = {}
            for (name, inst), back in zip(fleet.insts.items(), picks, strict=True):
                late_ok = fleet.now - inst.read_at < RELEASE_S / 2
                if inst.alive and (back >= 0 or not late_ok):
                    inst.read_at = fleet.now
                    back = max(back, 0)
                    sent = inst.sent or [Claim(BEFORE_ANY, 0, 0)]
                    claims[name] = sent[max(0, len(sent) - 1 - back)]
            fleet.seq += 1
            order = (fleet.epoch, fleet.seq)
            s = split(fleet.books, claims, capacity, order, fleet.now, RELEASE_S)
            fleet.books = dict(s.books)
            holds = {n: b.exposure for n, b in s.books.items()}
            fleet.views.append((order, dict(s.grants), holds))
        elif kind == "apply":
            name, back = ev[1], ev[2]
            assert isinstance(name, str) and isinstance(back, int)
            inst = fleet.insts[name]
            if fleet.views and inst.alive:
                order, grants, _ = fleet.views[max(0, len(fleet.views) - 1 - back)]
                if order > inst.applied:  # views are applied in order, some skipped
                    inst.applied, inst.grant = order, grants.get(name, 0)
        elif kind == "reserve":
            name, amount = ev[1], ev[2]
            assert isinstance(name, str) and isinstance(amount, int)
            inst = fleet.insts[name]
            if inst.alive and inst.reserved + amount <= inst.grant:
                inst.reserved += amount
        elif kind == "release":
            name, amount = ev[1], ev[2]
            assert isinstance(name, str) and isinstance(amount, int)
            inst = fleet.insts[name]
            inst.reserved -= min(amount, inst.reserved)
        elif kind == "report":
            name, extra = ev[1], ev[2]
            assert isinstance(name, str) and isinstance(extra, int)
            inst = fleet.insts[name]
            if inst.alive:
                inst.sent.append(Claim(inst.applied, inst.reserved, inst.reserved + extra))
        elif kind == "crash":
            name = ev[1]
            assert isinstance(name, str)
            inst = fleet.insts[name]
            # Its connections close: the engine frees what its requests held.
            inst.alive, inst.reserved, inst.grant = False, 0, 0
        elif kind == "failover" and fleet.views:
            # A new leader, from the last view in the store.
            _, _, holds = fleet.views[-1]
            # The successor saw each instance's report when the leader did (they read
            # the same store at the same rate).
            seen = {n: i.read_at for n, i in fleet.insts.items()}
            fleet.books = inherit(holds, fleet.now, seen)
            fleet.epoch += 1
        elif kind == "tick":
            ms = ev[2]
            assert isinstance(ms, int)
            fleet.now += min(ms / 1000, RELEASE_S / 4)
        fleet.check()


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 300),
    wanted=st.lists(st.integers(0, 300), min_size=1, max_size=5),
)
def test_with_reports_current_grants_settle_on_the_fair_shares_within_two_rounds(
    capacity: int, wanted: list[int]
) -> None:
    names = [f"i{k}" for k in range(len(wanted))]
    books: dict[str, Book] = {}
    applied: dict[str, Order] = dict.fromkeys(names, BEFORE_ANY)
    held = dict.fromkeys(names, 0)
    target = fair_shares(capacity, dict(zip(names, wanted, strict=True)))
    grants: dict[str, int] = {}
    for seq in range(1, 4):
        claims = {
            n: Claim(applied[n], held[n], max(w, held[n]))
            for n, w in zip(names, wanted, strict=True)
        }
        s = split(books, claims, capacity, (1, seq), float(seq), RELEASE_S)
        books, grants = dict(s.books), dict(s.grants)
        applied = dict.fromkeys(names, (1, seq))
        # Each fills what it wants, within its grant.
        held = {n: min(grants[n], w) for n, w in zip(names, wanted, strict=True)}
    assert grants == target
