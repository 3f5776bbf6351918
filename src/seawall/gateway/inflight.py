"""The in-flight ledger: what this gateway has in flight, per replica and in total.

One object owns the counts that routing, admission, draining and the fleet monitor read:
per replica the requests sent to it (streamed or not), the streams among them and the KV
blocks they reserve, and gateway-wide the requests being handled at all (queued ones
included). Every count is changed through a claim that is released exactly once: a
`Hold` for one attempt on one replica, a `Ticket` for one client request. A second
release is a no-op, so a cancelled attempt, a lost hedge and a migrated stream each give
back exactly what they took, whatever path they leave by.

Waiting for a count to reach zero (a replica's drain, the gateway's drain) is an event,
not a polling loop: the release that brings a count to zero wakes its waiters.

Must not: decide anything (admission and routing read the counts), do I/O, or read the
clock except to turn a deadline into a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from seawall import clock


@dataclass(slots=True, eq=False)
class Counts:
    """One replica's work in flight through this gateway."""

    requests: int = 0  # attempts open on the replica, streamed or not
    sequences: int = 0  # the engine sequences they run (`n` per prompt: `inflight_max`)
    streams: int = 0  # of those, streaming responses being relayed
    kv_blocks: int = 0  # KV blocks they may grow to (admission's reservations)


class Hold:
    """One attempt's claim on one replica. Release it exactly once (later calls do nothing)."""

    __slots__ = (
        "_ledger", "_released", "counts", "kv_blocks", "replica_id", "sequences", "streaming"
    )  # fmt: skip

    def __init__(
        self, ledger: InFlight, replica_id: str, counts: Counts, kv_blocks: int, sequences: int
    ) -> None:
        self._ledger = ledger
        self.replica_id = replica_id
        self.counts = counts
        self.kv_blocks = kv_blocks
        self.sequences = sequences
        self.streaming = False
        self._released = False
        counts.requests += 1
        counts.sequences += sequences
        counts.kv_blocks += kv_blocks

    def stream(self) -> None:
        """The attempt's response is now being relayed as a stream."""
        if not self.streaming and not self._released:
            self.streaming = True
            self.counts.streams += 1

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        counts = self.counts
        counts.requests -= 1
        counts.sequences -= self.sequences
        counts.kv_blocks -= self.kv_blocks
        if self.streaming:
            counts.streams -= 1
        self._ledger._released(self.replica_id, counts)

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@dataclass(slots=True, eq=False)
class Ticket:
    """One client request inside the gateway, from arrival to its last byte."""

    _ledger: InFlight
    task: asyncio.Task[object] | None
    cut_reason: str | None = None  # set when the gateway cuts it (drain deadline)
    _done: bool = False

    def cut(self, reason: str) -> None:
        """End the request now: its handler turns this cancellation into a clean end."""
        if self._done or self.cut_reason is not None:
            return
        self.cut_reason = reason
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._ledger._ticket_done(self)


_GATEWAY = ""  # the waiters' key for the gateway-wide count


@dataclass(eq=False)
class InFlight:
    """The ledger. `on_release(replica_id)` is called after every released hold (the
    admission queue is woken by it: a released slot is room for the next request)."""

    on_release: Callable[[str], None] | None = None
    _counts: dict[str, Counts] = field(default_factory=dict)
    _tickets: set[Ticket] = field(default_factory=set)
    _waiters: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)

    # -- per replica --------------------------------------------------------------------

    def counts(self, replica_id: str) -> Counts:
        """The live counts of `replica_id` (created at zero on first use)."""
        counts = self._counts.get(replica_id)
        if counts is None:
            counts = self._counts[replica_id] = Counts()
        return counts

    def hold(self, replica_id: str, kv_blocks: int = 0, sequences: int = 1) -> Hold:
        return Hold(self, replica_id, self.counts(replica_id), kv_blocks, sequences)

    def forget(self, replica_id: str) -> None:
        """A replica left the fleet. Holds still open on it release into the old counts."""
        self._counts.pop(replica_id, None)

    # -- the gateway as a whole --------------------------------------------------------

    def enter(self) -> Ticket:
        ticket = Ticket(self, asyncio.current_task())
        self._tickets.add(ticket)
        return ticket

    @property
    def total(self) -> int:
        """Client requests inside the gateway now (queued, in flight, streaming)."""
        return len(self._tickets)

    def cut_all(self, reason: str) -> int:
        """Cut every request still inside the gateway; returns how many were cut."""
        tickets = list(self._tickets)
        for t in tickets:
            t.cut(reason)
        return len(tickets)

    # -- waiting for zero --------------------------------------------------------------

    async def wait_zero(self, replica_id: str | None, deadline: float) -> int:
        """Until `replica_id` (None: the whole gateway) has nothing in flight, or the
        monotonic `deadline`; returns how many requests are still in flight then."""
        key = _GATEWAY if replica_id is None else replica_id
        while (left := self._left(key)) > 0:
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                return left
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                return self._left(key)
            finally:
                waiters = self._waiters.get(key)
                if waiters and fut in waiters:
                    waiters.remove(fut)
        return 0

    def _left(self, key: str) -> int:
        if key == _GATEWAY:
            return len(self._tickets)
        counts = self._counts.get(key)
        return counts.requests if counts is not None else 0

    def _wake(self, key: str) -> None:
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    def _released(self, replica_id: str, counts: Counts) -> None:
        if counts.requests == 0 and replica_id in self._waiters:
            self._wake(replica_id)
        if self.on_release is not None:
            self.on_release(replica_id)

    def _ticket_done(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        if not self._tickets and _GATEWAY in self._waiters:
            self._wake(_GATEWAY)
