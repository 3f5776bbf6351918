"""Stuck-replica detection: work is in flight and nothing is moving.

Why a progress watchdog when there are health checks. The commonest serving failure
that health checks miss is a hang: the HTTP server still answers /health (it runs on
its own thread or event loop) while the engine loop is wedged (a deadlocked NCCL
collective, a CUDA kernel that never returns, a scheduler bug). Every request sent there
waits until its timeout. Only progress tells: tokens should be coming out while there is
work to do.

Why two views. The engine's own metrics can lie in exactly the situations that matter:
a wedged engine may stop updating its gauges, or report `running == 0` because the
requests are stuck before the scheduler counts them. So the watchdog combines:

- the engine view (scraped): `running` requests and the `generation_tokens_total` counter;
- the gateway view (its own bookkeeping): streams in flight to this replica and the
  count of chunks relayed from it.

Work is in flight when the engine reports running > 0 OR the gateway has streams open.
Progress is the generation-token counter advancing OR a chunk being relayed. The replica
is stuck when work has been in flight without progress for `window_s`. In particular a
hang where the engine's running gauge reads 0 while the gateway holds open streams is
detected through the gateway view, and the reason says so.

Details: a counter that goes down is a restarted process and counts as progress (and a
new baseline). An engine observation older than `window_s` is not evidence of work in
flight: a scrape that stopped arriving is the scraper's and the prober's problem, and
restarting a replica because its last scrape said "busy" would be a guess. The stuck
clock starts at the first observation that shows work in flight, not at the last idle
one.

Must not: read the clock (`now` is monotonic seconds from the caller), act on the
verdict (the fleet controller turns it into the `stuck` event), or scrape anything.
"""

from __future__ import annotations


class ProgressWatchdog:
    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._running: float | None = None
        self._engine_seen_at: float | None = None
        self._tokens_total: float | None = None
        self._streams = 0
        self._chunks_total: int | None = None
        # Start of the current stretch of "work in flight, no progress"; None when idle.
        self._no_progress_since: float | None = None

    def _engine_busy(self, now: float) -> bool:
        return (
            self._running is not None
            and self._running > 0
            and self._engine_seen_at is not None
            and now - self._engine_seen_at <= self.window_s
        )

    def _busy(self, now: float) -> bool:
        return self._streams > 0 or self._engine_busy(now)

    def _update(self, progressed: bool, now: float) -> None:
        if not self._busy(now):
            self._no_progress_since = None
        elif progressed or self._no_progress_since is None:
            self._no_progress_since = now

    def observe_engine(
        self, running: float | None, generation_tokens_total: float | None, now: float
    ) -> None:
        """One scrape of the engine; None for a metric the engine does not export."""
        if (
            self._engine_seen_at is not None
            and now - self._engine_seen_at > self.window_s
            and self._streams == 0
        ):
            # Scrapes stopped for longer than the window: no evidence spans the gap, so
            # the stretch without progress starts again rather than across it.
            self._no_progress_since = None
        progressed = False
        if generation_tokens_total is not None:
            previous = self._tokens_total
            progressed = previous is not None and generation_tokens_total != previous
            self._tokens_total = generation_tokens_total
        self._running = running
        self._engine_seen_at = now
        self._update(progressed, now)

    def observe_gateway(
        self, streams_in_flight: int, chunks_relayed_total: int, now: float
    ) -> None:
        """The gateway's own count of open streams to this replica and chunks relayed."""
        previous = self._chunks_total
        progressed = previous is not None and chunks_relayed_total != previous
        self._chunks_total = chunks_relayed_total
        self._streams = streams_in_flight
        self._update(progressed, now)

    def stuck(self, now: float) -> str | None:
        """None, or why the replica is stuck, naming the view that shows the work."""
        if not self._busy(now):
            return None
        since = self._no_progress_since
        if since is None or now - since < self.window_s:
            return None
        quiet_s = now - since
        tokens = (
            "generation_tokens_total flat"
            if self._tokens_total is not None
            else "engine exports no token counter"
        )
        if self._engine_busy(now):
            return (
                f"engine reports {self._running:g} running, {tokens} and no chunk relayed "
                f"for {quiet_s:.0f}s"
            )
        running = "no running gauge" if self._running is None else f"{self._running:g} running"
        return (
            f"gateway has {self._streams} streams in flight with no chunk relayed and "
            f"{tokens} for {quiet_s:.0f}s (engine reports {running})"
        )
