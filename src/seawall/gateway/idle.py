"""The timeouts of one request on the request path: its wait for a first token (`Expiry`)
and, once its stream has started, the inter-token and total deadlines (`IdleDeadline`),
all kept on one coarse timer wheel per event loop (`Wheel`).

Why a wheel. A timer handle per deadline is what `asyncio.timeout` and `call_later` give,
and on uvloop each one is a libuv timer that is started, stopped and closed; with two or
three per request those handles were 25 us of the gateway's CPU per request (cProfile,
2-token streams), more than everything admission does. Nearly every deadline is cleared
long before it is due (a first token comes in milliseconds against a 30 s budget), so
the wheel makes setting and clearing one a set insertion and removal, and runs one loop
timer for the earliest deadline still set. The price is resolution: a deadline fires up
to `TICK_S` late.

Re-arming a timer on every chunk (asyncio.timeout's `reschedule`) cost 8-12% of the
gateway's CPU on the relay path. Instead a chunk only records when it arrived, and one
deadline per idle period checks, when it fires, whether the stream really was idle: if
a chunk came meanwhile, it is set again for the rest of the idle window. Expiry cancels
the relaying task exactly as asyncio.timeout does, and `expired()` turns that
cancellation back into a timeout of the right kind (a client disconnect stays a
cancellation).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref
from collections.abc import Callable
from typing import Any

from seawall import clock
from seawall.policy.deadline import TimeoutKind, Wait, idle_check

# Deadlines fire at most this late (and never early).
TICK_S = 0.01


class Entry:
    """One deadline on the wheel: `fire()` is called once it is due, unless cleared first.

    A request's deadlines are entries themselves (subclasses defining `fire`), not
    holders of a bound method of their owner: that was a reference cycle per deadline,
    left to the cycle collector, whose pauses stop every stream (`Callback` wraps any
    other callable)."""

    __slots__ = ("bucket",)

    def __init__(self) -> None:
        self.bucket: int | None = None  # the wheel's bucket while set

    def fire(self) -> None:
        raise NotImplementedError


class Callback(Entry):
    """An entry that calls `fn`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__()
        self.fn = fn

    def fire(self) -> None:
        self.fn()


_WHEELS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Wheel] = weakref.WeakKeyDictionary()
_last: Wheel | None = None  # the wheel asked for last (it keeps its loop alive until replaced)


class Wheel:
    """Deadlines bucketed by `TICK_S`; one loop timer, at the earliest bucket still set."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, now: Callable[[], float] = clock.monotonic
    ) -> None:
        self._loop = loop
        self._now = now  # tests pass their own time
        self._buckets: dict[int, set[Entry]] = {}
        self._heap: list[int] = []  # bucket numbers, some of them emptied since
        self._timer: asyncio.TimerHandle | None = None
        self._timer_bucket: int | None = None

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> Wheel:
        global _last
        wheel = _last
        if wheel is not None and wheel._loop is loop:
            return wheel  # a process runs one loop: no weak-reference lookup per request
        wheel = _WHEELS.get(loop)
        if wheel is None:
            wheel = _WHEELS[loop] = Wheel(loop)
        _last = wheel
        return wheel

    def set(self, entry: Entry, when: float) -> None:
        """Fire `entry` at the monotonic `when` (rounded up to the next tick)."""
        if entry.bucket is not None:
            self.clear(entry)
        b = math.ceil(when / TICK_S)
        bucket = self._buckets.get(b)
        if bucket is None:
            bucket = self._buckets[b] = set()
            heapq.heappush(self._heap, b)
        bucket.add(entry)
        entry.bucket = b
        if self._timer_bucket is None or b < self._timer_bucket:
            self._arm(b)

    def clear(self, entry: Entry) -> None:
        b = entry.bucket
        if b is None:
            return
        entry.bucket = None
        bucket = self._buckets.get(b)
        if bucket is not None:
            bucket.discard(entry)
            if not bucket:
                del self._buckets[b]  # its heap entry is dropped when the heap reaches it

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    @property
    def next_tick(self) -> float | None:
        """When the loop timer is set to fire (None: nothing set)."""
        return None if self._timer_bucket is None else self._timer_bucket * TICK_S

    def _arm(self, b: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_bucket = b
        delay = b * TICK_S - self._now()
        self._timer = self._loop.call_later(max(delay, 0.0), self._tick)

    def _tick(self) -> None:
        self._timer = self._timer_bucket = None
        now = self._now()
        heap, buckets = self._heap, self._buckets
        due: list[Entry] = []
        while heap and heap[0] * TICK_S <= now:
            bucket = buckets.pop(heapq.heappop(heap), None)
            if bucket:
                due.extend(bucket)
        while heap and heap[0] not in buckets:
            heapq.heappop(heap)  # emptied before it was due
        if heap:
            self._arm(heap[0])
        for entry in due:
            entry.bucket = None
            entry.fire()  # may set it again (an idle deadline with chunks since)


class _Cancels(Entry):
    """An entry that cancels the task that set it and, after a CancelledError, tells that
    cancellation from any other, as `asyncio.timeout` does. It holds the task only while
    it may still cancel it or undo the cancellation: kept longer, it was a cycle for the
    collector whenever the task failed (the task, its exception, the traceback, the frame
    that holds this entry, the task)."""

    __slots__ = ("_cancelled", "_cancelling", "_task", "_wheel")

    def __init__(self) -> None:
        super().__init__()
        task = asyncio.current_task()
        assert task is not None
        self._task: asyncio.Task[Any] | None = task
        self._cancelling = task.cancelling()
        self._cancelled = False
        self._wheel = Wheel.of(task.get_loop())

    def _cancel(self) -> None:
        if self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def _undo(self) -> bool:
        """True, with the cancellation undone, when this entry's was the only one."""
        task, self._task = self._task, None
        return self._cancelled and task is not None and task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._wheel.clear(self)
        if not self._cancelled:
            self._task = None  # nothing to undo


class IdleDeadline(_Cancels):
    __slots__ = ("_deadline", "_itl_s", "fired", "last")

    def __init__(self, itl_s: float, deadline: float, last: float) -> None:
        super().__init__()
        self._itl_s = itl_s
        self._deadline = deadline  # monotonic
        self.last = last  # monotonic time of the last chunk: the only per-chunk write
        self.fired: TimeoutKind | None = None
        # Set for the first moment a timeout could expire (now, when one already has: the
        # task is never cancelled from here, only from the wheel, as a timer would).
        now = clock.monotonic()
        verdict = idle_check(now, last, deadline, itl_s)
        self._wheel.set(self, now + verdict.seconds if isinstance(verdict, Wait) else now)

    def fire(self) -> None:
        now = clock.monotonic()
        verdict = idle_check(now, self.last, self._deadline, self._itl_s)
        if isinstance(verdict, Wait):
            self._wheel.set(self, now + verdict.seconds)
            return
        self.fired = verdict
        self._cancel()

    def expired(self) -> TimeoutKind | None:
        """After a CancelledError: the kind of timeout that caused it, or None when the
        cancellation came from elsewhere (the client left) and must propagate."""
        return self.fired if self.fired is not None and self._undo() else None

    def within(self, seconds: float) -> None:
        """Bring the total deadline forward to at most `seconds` from now."""
        deadline = clock.monotonic() + seconds
        if deadline < self._deadline:
            self._deadline = deadline
            self._wheel.set(self, deadline)


class Expiry(_Cancels):
    """Cancel the current task after `seconds` unless closed first; after a CancelledError,
    `expired()` says whether this expiry caused it (and undoes the cancellation), as
    `asyncio.timeout` does, so a client that left at the same moment stays a
    cancellation. Use: `e = Expiry(s)`, then `try: ... except CancelledError: if
    e.expired(): <timed out>; raise` and `finally: e.close()`."""

    __slots__ = ("fired",)

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.fired = False
        self._wheel.set(self, clock.monotonic() + seconds)

    def fire(self) -> None:
        self.fired = True
        self._cancel()

    def expired(self) -> bool:
        return self.fired and self._undo()

    def disarm(self) -> bool:
        """Close it from a callback, at the moment the wait it bounds has ended: True when
        the task may go on uninterrupted, False when it is already being cancelled (by
        this expiry, in the same turn of the loop, or by anything else)."""
        task = self._task
        self.close()
        return task is not None and task.cancelling() == self._cancelling
