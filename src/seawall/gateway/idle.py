"""The inter-token and total timeouts of a stream that has started, checked lazily.

Re-arming a timer on every chunk (asyncio.timeout's `reschedule`) cost 8-12% of the
gateway's CPU on the relay path. Instead a chunk only records when it arrived, and one
timer per idle period checks, when it fires, whether the stream really was idle: if a
chunk came meanwhile, it re-arms for the rest of the idle window. Expiry cancels the
relaying task exactly as asyncio.timeout does, and `expired()` turns that cancellation
back into a timeout of the right kind (a client disconnect stays a cancellation).
"""

from __future__ import annotations

import asyncio

from seawall import clock
from seawall.policy.deadline import TimeoutKind, Wait, idle_check


class IdleDeadline:
    __slots__ = ("_cancelling", "_deadline", "_handle", "_itl_s", "_loop", "_task", "fired", "last")

    def __init__(self, itl_s: float, deadline: float, last: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._itl_s = itl_s
        self._deadline = deadline  # monotonic
        self.last = last  # monotonic time of the last chunk: the only per-chunk write
        self.fired: TimeoutKind | None = None
        self._handle = self._loop.call_later(0.0, self._check)

    def _check(self) -> None:
        verdict = idle_check(clock.monotonic(), self.last, self._deadline, self._itl_s)
        if isinstance(verdict, Wait):
            self._handle = self._loop.call_later(verdict.seconds, self._check)
            return
        self.fired = verdict
        self._task.cancel()

    def expired(self) -> TimeoutKind | None:
        """After a CancelledError: the kind of timeout that caused it, or None when the
        cancellation came from elsewhere (the client left) and must propagate."""
        if self.fired is not None and self._task.uncancel() <= self._cancelling:
            return self.fired
        return None

    def close(self) -> None:
        self._handle.cancel()
