"""The admission queue: requests waiting for room on a saturated fleet, per model, the
most important tier first.

Why a priority queue woken by release, not a polling loop. When every replica is
saturated, a slot frees when a request ends. If waiters poll, whoever happens to look
first takes it: a fresh request of a lower tier arriving at that moment beats a gold
request that has waited seconds (issue 11: an unlimited tier's 150 streams starved a
gold request into a queue timeout). Here a release wakes the waiters best tier first,
and no request, waiting or fresh, takes room while a request of a strictly better tier
is waiting. Within a tier the first waiter that fits goes: room is per request (its KV
reservation), and a large request at the head must not hold back small ones that fit.
A full queue makes room for a better tier by shedding its worst waiter.

A waiter also re-checks on its own every `RECHECK_S`: some conditions end with time,
not with an event (an engine's Retry-After back-off, a stale scrape).

Must not: decide whether a request may queue (`policy.admission.on_fleet_saturated`
does) or what room means (the caller passes `room`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from seawall import clock

RECHECK_S = 0.25


class Displaced(Exception):
    """A waiter shed to make room for a request of a better tier."""


@dataclass(eq=False)
class _Waiter:
    priority: int
    seq: int
    fut: asyncio.Future[None]
    displaced: bool = False

    def __lt__(self, other: _Waiter) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class AdmissionQueue:
    def __init__(self, on_depth: Callable[[str, int], None] | None = None) -> None:
        self._heaps: dict[str, list[_Waiter]] = {}
        self._seq = itertools.count()
        self._on_depth = on_depth  # (model, depth) after every change (a gauge)

    def depth(self, model: str) -> int:
        return len(self._heaps.get(model, ()))

    def depths(self) -> dict[str, int]:
        return {m: len(h) for m, h in self._heaps.items() if h}

    def better_waiting(self, model: str, priority: int) -> bool:
        """A request of a strictly better tier is waiting: this one must not take room."""
        heap = self._heaps.get(model)
        return heap is not None and bool(heap) and heap[0].priority < priority

    def waiting_at_or_above(self, model: str, priority: int) -> bool:
        """A request of this tier or a better one is waiting: a fresh one of this tier
        that may not queue must not take room ahead of it (policy.admission.Refusals)."""
        heap = self._heaps.get(model)
        return heap is not None and bool(heap) and heap[0].priority <= priority

    def displace_worse(self, model: str, priority: int) -> bool:
        """Shed the worst waiter if it is of a strictly worse tier than `priority`."""
        heap = self._heaps.get(model)
        if not heap:
            return False
        worst = max(heap)
        if worst.priority <= priority:
            return False
        worst.displaced = True
        heap.remove(worst)
        heapq.heapify(heap)
        if not worst.fut.done():
            worst.fut.set_exception(Displaced())
        self._changed(model)
        return True

    async def wait(
        self, model: str, priority: int, room: Callable[[], bool], deadline: float
    ) -> bool:
        """Queue until `room()` holds with no better tier waiting (True), or until the
        monotonic `deadline` (False). Raises `Displaced` if a better tier took its place."""
        heap = self._heaps.setdefault(model, [])
        me = _Waiter(priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(heap, me)
        self._changed(model)
        try:
            while True:
                if heap[0].priority >= priority and room():
                    return True
                remaining = deadline - clock.monotonic()
                if remaining <= 0:
                    return False
                try:
                    async with asyncio.timeout(min(remaining, RECHECK_S)):
                        await me.fut
                except TimeoutError:
                    pass
                if me.displaced:
                    raise Displaced()
                if me.fut.done():
                    me.fut = asyncio.get_running_loop().create_future()
        finally:
            if not me.displaced:
                heap.remove(me)
                heapq.heapify(heap)
                self._changed(model)
                self.wake(model)  # a worse tier may go now, or room is left over

    def wake(self, model: str | None = None) -> None:
        """Room may have appeared (a slot was released, the fleet view changed): every
        waiter re-checks, best tier first (they resume in this order). `model=None`:
        every model's waiters."""
        if model is None:
            heaps = list(self._heaps.values())
        else:
            heap = self._heaps.get(model)
            heaps = [heap] if heap else []
        for heap in heaps:
            for waiter in sorted(heap):
                if not waiter.fut.done():
                    waiter.fut.set_result(None)

    def _changed(self, model: str) -> None:
        if self._on_depth is not None:
            self._on_depth(model, self.depth(model))
