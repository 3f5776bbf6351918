"""The fleet-wide retry budget: how many retries and hedges the gateway may send.

Why a budget and not a retry count. "Retry each request up to 3 times" looks safe one
request at a time and is a disaster fleet-wide: when a replica (or the whole fleet) is
overloaded, every request fails, every request is retried three times, and the load on
the struggling fleet quadruples at exactly the moment it can least absorb it. The
retries themselves keep the fleet overloaded (a retry storm), and the outage outlives
its cause. A count bounds the amplification per request; it does nothing to bound it in
aggregate.

A budget bounds it in aggregate. Following Finagle and tower, every successful request
deposits `ratio` tokens (0.1 by default) and every retry or hedge withdraws one. In a
healthy fleet successes are plentiful and retries are rare, so the budget is always
there for the occasional failure. In an unhealthy fleet successes dry up, the budget
empties, and extra load from retries is capped at `ratio` (10 %) of the load that is
actually succeeding, however many requests are failing. Retries then fail fast (the
caller sees the original error) instead of piling on.

An idle or freshly started gateway has no successes to draw on, so a small reserve
refills at `min_per_s` regardless of traffic (capacity `min_per_s * reserve_window_s`):
a quiet gateway can still retry a transient failure.

Several gateway instances share one fleet's reserve: each holds `1/instances` of it
(capacity and refill, `share`), so that the bound below holds for the fleet, not once
per instance (three gateways with a whole reserve each had sent 0.61 hedges per request
where one sent 0.27). Earned tokens need no sharing: each instance earns from its own
successes, and the fleet's successes are their sum. A resize keeps the reserve's level,
clamped to the new capacity: a shrinking share spends nothing it no longer has, and a
growing one refills into its new room instead of being handed a burst. An instance that
joins a fleet starts with an empty reserve (`reserve_full=False`): until it knows how
many share the fleet it cannot know its share, and its refill soon gives it one.

Earned tokens age. As in Finagle's and tower's budgets, a deposit expires `ttl_s` after
the success that earned it (deposits are kept in `_SLOTS` time slots of `ttl_s / _SLOTS`
each, so a deposit lives between `ttl_s - ttl_s / _SLOTS` and `ttl_s`), and the earned
balance is capped at `max_balance`. Without ageing, a long healthy stretch banks the
whole cap, and when trouble starts that bank is spent at once on a fleet that is already
failing: the budget's point is to follow the *recent* success rate. Withdrawals take the
oldest earned tokens first (they would expire first).

The bound, over any run from construction to `now` (property-tested), for one instance
or for a fleet whose instances agree on how many they are:

    withdrawals <= ratio * deposits + min_per_s * reserve_window_s + min_per_s * elapsed_s

and, because deposits age, withdrawals within any `ttl_s` window are bounded by the
deposits of that window and the one before it (plus the reserve).

Floating-point note: ten deposits of 0.1 sum to 0.9999999999999999, not 1.0, so a
withdrawal is granted when the level is within `_EPSILON` of one token. Each withdrawal
may therefore exceed the bound by at most `_EPSILON`, which the test allows for.

Must not: read the clock, do I/O, or know what a request is. Thread-unsafe by design: the
gateway owns one instance on its event loop.
"""

from __future__ import annotations

import math
from collections import deque

from seawall.policy.token_bucket import TokenBucket

_EPSILON = 1e-9
_WITHDRAWAL = 1.0
_SLOTS = 10


class RetryBudget:
    def __init__(
        self,
        ratio: float = 0.1,
        min_per_s: float = 1.0,
        reserve_window_s: float = 10.0,
        max_balance: float = 100.0,
        now: float = 0.0,
        ttl_s: float = 10.0,
        reserve_full: bool = True,
    ) -> None:
        if ratio < 0 or min_per_s < 0 or reserve_window_s < 0 or max_balance < 0:
            raise ValueError("retry budget parameters must be >= 0")
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.ratio = ratio
        self.max_balance = max_balance
        self.ttl_s = ttl_s
        self._slot_s = ttl_s / _SLOTS
        # (slot index, earned tokens left from deposits in that slot), oldest first.
        self._earned: deque[list[float]] = deque()
        self._earned_sum: float | None = 0.0  # their total; None: to be summed again
        self._fleet_capacity = min_per_s * reserve_window_s
        self._fleet_refill_per_s = min_per_s
        self.instances = 1
        self._reserve = TokenBucket.full(
            capacity=self._fleet_capacity, refill_per_s=min_per_s, now=now
        )
        if not reserve_full:
            self._reserve.tokens = 0.0

    def share(self, instances: int, now: float) -> None:
        """This gateway is one of `instances` (at least one) sharing the fleet's reserve:
        its reserve becomes that share of it, its level kept within the new capacity."""
        n = max(int(instances), 1)
        if n == self.instances:
            return
        bucket = self._reserve
        level = bucket.level(now)  # refilled at the old rate up to now
        bucket.updated_at = max(bucket.updated_at, now)
        bucket.capacity = self._fleet_capacity / n
        bucket.refill_per_s = self._fleet_refill_per_s / n
        bucket.tokens = min(level, bucket.capacity)
        self.instances = n

    @property
    def reserve_capacity(self) -> float:
        return self._reserve.capacity

    def _expire(self, now: float) -> None:
        # Slot k holds deposits made in [k * slot_s, (k + 1) * slot_s); it expires at
        # k * slot_s + ttl_s.
        earned = self._earned
        while earned and earned[0][0] * self._slot_s + self.ttl_s <= now:
            earned.popleft()
            self._earned_sum = None

    def _earned_total(self) -> float:
        # Kept between changes: every successful request deposits, and asks for it.
        if self._earned_sum is None:
            self._earned_sum = sum(tokens for _, tokens in self._earned)
        return self._earned_sum

    def deposit(self, now: float) -> None:
        """Record one successful request."""
        self._expire(now)
        amount = min(self.ratio, self.max_balance - self._earned_total())
        if amount <= 0:
            return
        slot = float(math.floor(now / self._slot_s))
        earned = self._earned
        if earned and earned[-1][0] >= slot:
            earned[-1][1] += amount  # same slot (or a clock that stepped back)
        else:
            earned.append([slot, amount])
        if self._earned_sum is not None:
            self._earned_sum += amount

    def try_withdraw(self, now: float) -> bool:
        """Spend one token for a retry or hedge; False means the budget is exhausted.

        Earned tokens are spent first (oldest first) so that the time-based reserve stays
        available for the quiet periods it exists for; a shortfall is topped up from the
        reserve.
        """
        self._expire(now)
        reserve_level = self._reserve.level(now)
        if self._earned_total() + reserve_level < _WITHDRAWAL - _EPSILON:
            return False
        need = _WITHDRAWAL
        earned = self._earned
        self._earned_sum = None
        while earned and need > 0:
            take = min(earned[0][1], need)
            earned[0][1] -= take
            need -= take
            if earned[0][1] <= 0:
                earned.popleft()
        if need > 0:
            # Already checked to be (almost) available; charge so an epsilon shortfall
            # does not turn into a refusal.
            self._reserve.charge(need, now)
        return True

    def level(self, now: float) -> float:
        """Tokens available now (earned + reserve), for the retry-budget gauge."""
        self._expire(now)
        return self._earned_total() + max(0.0, self._reserve.level(now))
