"""A timeout for one call to a shared store that judges the store, not this process.

Owns: `StoreTimeout`, `asyncio.timeout(delay)` with two differences, both for when this
process's own event loop was blocked (a long GC pause, a CPU taken by another process on
a loaded machine) rather than the store being slow:

- expiry waits one turn of the loop before it cancels, so that a reply that arrived
  together with the timer is read rather than thrown away;
- a timer that fires late, by more than `LATE_S`, has measured the loop's stall, not the
  store: the call gets `delay` again, counted from then, once.

With plain timeouts every call in flight during a stall longer than the timeout failed
at once (their replies were in the socket buffers), three failures made a streak, and
a gateway decided its tenants' limits alone for two seconds while Redis was healthy.
A store that is really slow still fails the call after `delay` (the timer is on time);
a stalled loop delays a call by at most the stall plus `delay` twice.

Must not: outlive its block (the timer is cancelled on exit), or turn a cancellation of
the caller into a TimeoutError (only the cancellation it made itself).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

LATE_S = 0.02  # a timer this late means the loop was blocked (jitter is ~1 ms)


def client_backstop_s(delay: float) -> float:
    """The timeout to give a store client's own connect (and close) when its calls are
    bounded by `StoreTimeout(delay)`: longer than a call can take after a grace, so that
    the client's plain timer never expires first on a connection already made."""
    return max(1.0, 2 * delay)


class StoreTimeout:
    """`async with StoreTimeout(delay): await store_call()`; raises TimeoutError."""

    __slots__ = ("_cancelling", "_due", "_expired", "_grace", "_handle", "_loop", "_task", "delay")

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def __aenter__(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "StoreTimeout is used inside a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._grace = True
        self._due = loop.time() + self.delay
        self._handle: asyncio.Handle = loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        if self._grace and now - self._due > LATE_S:
            # The loop was blocked past the deadline: the call had less than `delay`.
            self._grace = False
            self._due = now + self.delay
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        # After the callbacks already queued: a reply that came with the timer is read.
        self._handle = self._loop.call_soon(self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._handle.cancel()
        # As asyncio.timeout: uncancel what it cancelled; the CancelledError is its own
        # only if no other cancellation is pending.
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError(f"no reply within {self.delay} s") from exc
