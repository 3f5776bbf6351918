"""Preemption-storm detection from an engine's cumulative preemption counter.

Why it matters. When a vLLM-style engine runs out of KV cache it preempts running
requests (evicts their cache, recomputes or swaps later). A few preemptions are normal
under load. A storm (preemptions sustained at a high rate) means the replica spends
its time recomputing evicted work: throughput collapses while the queue keeps growing,
and every latency SLO is missed even though the replica looks busy and healthy. The
fleet controller turns a storm into the `storm` event (the replica is degraded, so
routing sends it less) and the end of one into `storm_cleared`.

Why hysteresis, twice over. A detector that flips on every noisy scrape would flap the
replica between ready and degraded, and each flip moves traffic. So:

- in time: the rate must stay above `rate_threshold_per_s` for `sustain_s` to enter a
  storm, and stay at or below `clear_rate_per_s` for `clear_s` to leave it;
- in level: `clear_rate_per_s` defaults to half the entry threshold, so a rate hovering
  just around the threshold does not end a storm that it would not start.

The rate is measured over each interval between two observations (counter delta over
time delta). A rate between the two thresholds breaks an entering or clearing streak.

Counter resets: the engine restarted and its counter began again. The interval that
spans the reset has no meaningful rate, so it is skipped: the new value becomes the
baseline and the current state and streaks are kept.

Must not: read the clock or scrape; `now` is monotonic seconds from the caller.
"""

from __future__ import annotations

from enum import StrEnum


class StormState(StrEnum):
    calm = "calm"
    storm = "storm"


class StormDetector:
    def __init__(
        self,
        rate_threshold_per_s: float,
        sustain_s: float,
        clear_s: float,
        clear_rate_per_s: float | None = None,
    ) -> None:
        if rate_threshold_per_s < 0 or sustain_s < 0 or clear_s < 0:
            raise ValueError("storm thresholds must be >= 0")
        self.rate_threshold_per_s = rate_threshold_per_s
        self.clear_rate_per_s = (
            rate_threshold_per_s / 2 if clear_rate_per_s is None else clear_rate_per_s
        )
        if self.clear_rate_per_s > rate_threshold_per_s:
            raise ValueError("clear_rate_per_s must not exceed rate_threshold_per_s")
        self.sustain_s = sustain_s
        self.clear_s = clear_s
        self.state = StormState.calm
        self.last_rate_per_s: float | None = None  # for the metric; None until two samples
        self._total: float | None = None
        self._at: float | None = None
        self._streak_since: float | None = None  # entering (calm) or clearing (storm)

    def _streak_start(self, interval_start: float) -> float:
        # A streak starts at the beginning of the first interval that qualified.
        if self._streak_since is None:
            self._streak_since = interval_start
        return self._streak_since

    def observe(self, preemptions_total: float, now: float) -> StormState:
        """Feed one scrape of the cumulative counter; returns the state after it."""
        previous_total, previous_at = self._total, self._at
        if previous_at is not None and now <= previous_at:
            return self.state  # same or older sample: nothing to measure
        self._total, self._at = preemptions_total, now
        if previous_total is None or previous_at is None:
            return self.state
        if preemptions_total < previous_total:
            self.last_rate_per_s = None  # counter reset: new baseline, no rate
            return self.state

        rate = (preemptions_total - previous_total) / (now - previous_at)
        self.last_rate_per_s = rate
        if self.state is StormState.calm:
            if rate > self.rate_threshold_per_s:
                since = self._streak_start(previous_at)
                if now - since >= self.sustain_s:
                    self.state, self._streak_since = StormState.storm, None
            else:
                self._streak_since = None
        elif rate <= self.clear_rate_per_s:
            since = self._streak_start(previous_at)
            if now - since >= self.clear_s:
                self.state, self._streak_since = StormState.calm, None
        else:
            self._streak_since = None
        return self.state
