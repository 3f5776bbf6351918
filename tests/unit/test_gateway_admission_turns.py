"""Taking turns under overload (policy.admission.Refusals and Turns, FleetAdmission.admit):
a request refused twice takes its turn, held for it (`turns: hold`) or in the queue
(`turns: queue`), and a fresh request of its tier does not take the room ahead of it.
No sockets: one replica whose KV the test fills through the in-flight
ledger, fleet admission called as the gateway calls it, time passed in where the policy
takes it."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from seawall import clock
from seawall.config import AdmissionConfig, Timeouts
from seawall.errors import ApiError
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.admission_control import _demand_of, combined
from seawall.gateway.context import RequestCtx
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.inflight import Hold, InFlight
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.metrics import Metrics
from seawall.policy.adaptive_admission import Demand
from seawall.policy.admission import Refusals, Turns
from seawall.protocol.openai import parse

MODEL = "m"
CACHE = 159  # blocks of 16 tokens
NEED = 13 * 16  # one request: 13 blocks


# -- the policy ------------------------------------------------------------------------


def test_a_request_is_patient_after_its_second_refusal_and_starts_afresh_once_served() -> None:
    r = Refusals(patience=2, ttl_s=30.0)
    assert not r.patient("a", 0.0)
    assert r.refused("a", 0.0) == 1 and not r.patient("a", 0.5)
    assert r.refused("a", 1.0) == 2 and r.patient("a", 1.5)
    assert not r.patient("b", 1.5)  # another request
    r.served("a")
    assert not r.patient("a", 2.0) and len(r) == 0


def test_refusals_lapse_and_stay_bounded() -> None:
    r = Refusals(patience=1, ttl_s=10.0, max_entries=3)
    r.refused("old", 0.0)
    assert r.patient("old", 9.9)
    assert not r.patient("old", 10.0)  # ten seconds after its last refusal: forgotten
    for k, key in enumerate("wxyz"):
        r.refused(key, 20.0 + k)
    assert len(r) == 3 and not r.patient("w", 24.0) and r.patient("z", 24.0)
    never = Refusals(patience=0)
    assert never.refused("a", 0.0) == 0 and not never.patient("a", 0.0) and len(never) == 0


# -- fleet admission -------------------------------------------------------------------


class Fleet:
    def __init__(self, **admission: Any) -> None:
        self.ledger = InFlight()
        self.replicas = ReplicaSet(self.ledger, random.Random(0))
        self.replica = Replica("r0", "http://127.0.0.1:9", MODEL, "n0")
        self.replicas.add(self.replica)
        load = EngineLoad(
            running=0,
            waiting=0,
            kv_usage=0.1,
            preemptions_total=0,
            generation_tokens_total=0,
            kv_capacity_tokens=CACHE * 16,
            kv_block_size=16,
            scraped_at=clock.monotonic() + 3600,  # fresh for the whole test
        )
        view = ReplicaView("r0", "", MODEL, "n0", load=load)
        snap = FleetSnapshot({"r0": view}, clock.monotonic())
        self.replicas.snapshot = lambda: snap
        cfg = {"mode": "reserve", "queue_timeout_s": 5.0, "turns": "queue", **admission}
        self.admission = FleetAdmission(
            AdmissionConfig.model_validate(cfg), self.replicas, Metrics()
        )
        self.ledger.on_release = lambda rid: self.admission.queue.wake()
        # 12 requests of 13 blocks in flight: 156 of 159, no room for another.
        self.holds: list[Hold] = [self.ledger.hold("r0", 13) for _ in range(12)]

    async def admit(self, prompt: str, priority: int = 1) -> int:
        raw = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 190}).encode()
        ctx = RequestCtx(
            request_id=prompt,
            route="completions",
            started=clock.monotonic(),
            timeouts=Timeouts(),
            req=parse("completions", raw),
            priority=priority,
            reserve_tokens=NEED,
        )
        try:
            await self.admission.admit(ctx)
        except ApiError as e:
            return e.status
        hold = self.ledger.hold("r0", 13)  # it runs
        if ctx.admission is not None:  # the adaptive controller counts it, as dispatch binds
            ctx.admission.bind("r0", hold)
        self.holds.append(hold)
        return 200


async def test_refused_twice_a_request_waits_its_turn_and_a_fresh_one_does_not_overtake() -> None:
    fleet = Fleet()  # priority 1 is shed at once (lowest_priority_to_queue 0)
    assert await fleet.admit("patient") == 429
    assert await fleet.admit("patient") == 429
    waiting = asyncio.ensure_future(fleet.admit("patient"))  # the third time it waits
    await asyncio.sleep(0)
    assert not waiting.done() and fleet.admission.queue.depth(MODEL) == 1
    # A request ends, and a closed-loop client sends its next one at once, in the same
    # turn of the loop: the room it freed goes to the request that was refused first.
    fleet.holds.pop(0).release()
    assert await fleet.admit("incumbent's next") == 429
    assert await asyncio.wait_for(waiting, 5) == 200
    assert fleet.admission.queue.depth(MODEL) == 0
    # Served, it starts afresh: refused again, it is refused twice before it waits.
    assert await fleet.admit("patient") == 429


async def test_without_patience_the_incumbent_keeps_the_room() -> None:
    """What `queue_after_refusals: 0` (and Seawall before) does: the refused client never
    gets in while the incumbent resends at once."""
    fleet = Fleet(queue_after_refusals=0)
    for _ in range(3):
        assert await fleet.admit("patient") == 429
    fleet.holds.pop(0).release()
    assert await fleet.admit("incumbent's next") == 200
    assert await fleet.admit("patient") == 429


async def test_a_patient_request_waits_no_longer_than_the_queue_timeout() -> None:
    fleet = Fleet(queue_timeout_s=0.3)
    for _ in range(2):
        assert await fleet.admit("patient") == 429
    started = clock.monotonic()
    assert await fleet.admit("patient") == 429  # nothing ended: a queue timeout
    assert clock.monotonic() - started >= 0.3
    assert fleet.admission.queue.depth(MODEL) == 0


async def test_a_tier_that_queues_still_queues_at_its_first_refusal() -> None:
    fleet = Fleet()
    waiting = asyncio.ensure_future(fleet.admit("first", priority=0))
    await asyncio.sleep(0)
    assert fleet.admission.queue.depth(MODEL) == 1
    fleet.holds.pop(0).release()
    assert await asyncio.wait_for(waiting, 5) == 200


# -- turns held, not connections (`turns: hold`, the default) ---------------------------


def test_a_turn_is_owed_until_it_lapses_or_is_taken_and_blocks_only_its_tier_and_worse() -> None:
    t = Turns(max_entries=2)
    assert not t.owed_ahead("m", 5, 0.0) and len(t) == 0
    t.grant("a", "m", 1, until=2.0, now=0.0)
    assert t.holds("a", 1.0) and not t.holds("b", 1.0)
    assert t.owed_ahead("m", 1, 1.0) and t.owed_ahead("m", 2, 1.0)
    assert not t.owed_ahead("m", 0, 1.0)  # a better tier is never held back
    assert not t.owed_ahead("other", 1, 1.0)
    t.grant("a", "m", 1, until=4.0, now=3.0)  # refused again: renewed, still one turn
    assert len(t) == 1 and t.holds("a", 3.0)
    t.take("a")
    assert not t.holds("a", 3.0) and not t.owed_ahead("m", 1, 3.0)
    t.grant("b", "m", 1, until=5.0, now=3.0)
    assert not t.holds("b", 5.0) and not t.owed_ahead("m", 1, 5.0)  # lapsed: gave up
    for key, until in (("x", 10.0), ("y", 11.0), ("z", 12.0)):
        t.grant(key, "m", 1, until, now=6.0)
    assert len(t) == 2 and not t.holds("x", 6.0)  # bounded: the oldest went first


async def test_held_the_room_waits_for_the_request_refused_twice_and_it_starts_at_once() -> None:
    fleet = Fleet(turns="hold")  # priority 1 is shed at once (lowest_priority_to_queue 0)
    assert await fleet.admit("patient") == 429
    assert await fleet.admit("patient") == 429  # refused twice: owed a turn
    # Nothing has ended: it is refused again, at once, rather than waiting in the gateway.
    assert await fleet.admit("patient") == 429
    assert fleet.admission.queue.depth(MODEL) == 0
    # A request ends, and a closed-loop client sends its next one at once: the room it
    # freed is held for the request that was refused first.
    fleet.holds.pop(0).release()
    assert await fleet.admit("incumbent's next") == 429
    assert await fleet.admit("another fresh one") == 429
    started = clock.monotonic()
    assert await fleet.admit("patient") == 200  # it comes back and starts at once
    assert clock.monotonic() - started < 0.1
    # Its turn is used: a fresh request may take the next room.
    fleet.holds.pop(0).release()
    assert await fleet.admit("incumbent's next") == 200


async def test_the_room_held_for_a_turn_is_what_it_needs_and_fresh_requests_fit_beside_it() -> None:
    """Holding all the room while any turn was owed snowballed: fresh requests refused
    beside room enough for them were refused twice and owed turns themselves, and in the
    mixed chats of bench_admission the engines ran 6-8 of the 12 clients' requests for
    seconds with their caches 30-60% full."""
    fleet = Fleet(turns="hold")
    assert await fleet.admit("patient") == 429
    assert await fleet.admit("patient") == 429  # owed a turn
    fleet.holds.pop(0).release()
    fleet.holds.pop(0).release()  # room for two: one held for "patient", one free
    assert await fleet.admit("fresh") == 200
    assert await fleet.admit("another fresh one") == 429  # only its room is left
    assert await fleet.admit("patient") == 200


async def test_adaptive_admission_lets_a_fresh_request_in_beside_the_room_held_for_a_turn() -> None:
    """The same rule through the adaptive controller (the default mode), which counts the
    requests it admitted (their tickets bound to the attempt's hold), not the ledger's
    holds. At a cold start each reserves prompt + max_tokens (190 tokens: 12 blocks), so
    13 fill the 159-block cache."""
    fleet = Fleet(mode="adaptive", turns="hold")
    for hold in fleet.holds:  # the ledger's own holds, which this controller does not read
        hold.release()
    fleet.holds.clear()
    for i in range(13):
        assert await fleet.admit(f"running {i}") == 200
    assert await fleet.admit("patient") == 429
    assert await fleet.admit("patient") == 429  # owed a turn
    fleet.holds.pop(0).release()
    assert await fleet.admit("fresh") == 429  # one request's room: held for "patient"
    fleet.holds.pop(0).release()  # room for two: one held for "patient", one free
    assert await fleet.admit("another fresh one") == 200
    assert await fleet.admit("a third") == 429  # only the held room is left
    assert await fleet.admit("patient") == 200


def test_adaptive_admission_judges_a_fresh_request_with_the_turns_owed_as_one_demand() -> None:
    """The adaptive controller's side of the same rule: the needs add up (tokens, expected
    lengths; spreads as variances), so the room found beside the turns is theirs too."""
    from seawall.gateway.admission_control import Combined

    a, b = Demand(100, 1000, 40.0, 30.0), Demand(50, 500, 20.0, 40.0)
    c = combined([Combined(1100, a), Combined(550, b)])
    assert int(c) == 1650
    assert _demand_of(c) == Demand(150, 1500, 60.0, 50.0)


def test_the_oldest_turn_goes_first_once_it_is_overdue() -> None:
    t = Turns()
    for i, key in enumerate(("old", "mid", "new")):
        t.grant(key, "m", 1, until=10.0 + i, now=float(i))
    assert t.first_overdue("m", 1, 3.0, overdue_s=5.0) is None  # nobody waited that long
    t.grant("old", "m", 1, until=20.0, now=8.0)  # refused again: keeps its place
    assert t.first_overdue("m", 1, 8.0, overdue_s=5.0) == "old"
    assert t.first_overdue("m", 0, 8.0, overdue_s=5.0) is None  # a better tier: not held
    t.take("old")
    assert t.first_overdue("m", 1, 8.0, overdue_s=5.0) == "mid"
    assert t.first_overdue("m", 1, 11.5, overdue_s=5.0) == "new"  # "mid" lapsed at 11


async def test_a_client_outrun_by_luckier_ones_gets_in_once_its_turn_is_overdue(
    monkeypatch: Any,
) -> None:
    """The room that frees goes to whichever owed client comes back first, so one that
    polls at unlucky moments could lose every time (the integration test starved one of
    nine clients under CPU load). Owed for longer than `queue_timeout_s` (what a request
    may wait in the gateway), its turn comes first."""
    fleet = Fleet(turns="hold", queue_timeout_s=5.0, turn_grace_s=30.0)
    now = [clock.monotonic()]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    for _ in range(2):
        assert await fleet.admit("unlucky") == 429
    for _ in range(2):
        assert await fleet.admit("lucky") == 429
    fleet.holds.pop(0).release()
    assert await fleet.admit("lucky") == 200  # back first: it takes the room
    for _ in range(2):
        assert await fleet.admit("lucky again") == 429  # owed too
    now[0] += 6.0  # "unlucky" has now waited longer than queue_timeout_s
    assert await fleet.admit("unlucky") == 429  # no room yet: refused, keeps its place
    fleet.holds.pop(0).release()
    assert await fleet.admit("lucky again") == 429  # back first, but not the oldest
    assert await fleet.admit("unlucky") == 200


async def test_a_turn_whose_client_gave_up_holds_the_room_only_until_it_lapses(
    monkeypatch: Any,
) -> None:
    fleet = Fleet(turns="hold", turn_grace_s=0.5)
    now = [clock.monotonic()]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    for _ in range(2):
        assert await fleet.admit("gone") == 429
    fleet.holds.pop(0).release()
    assert await fleet.admit("fresh") == 429  # held for "gone"
    # Its Retry-After (held at most queue_timeout_s, 5 s) and the grace pass unseen.
    now[0] += 5.4
    assert await fleet.admit("fresh") == 429
    now[0] += 0.2
    assert await fleet.admit("fresh") == 200
