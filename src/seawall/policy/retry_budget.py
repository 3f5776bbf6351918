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
a quiet gateway can still retry a transient failure. Earned tokens are capped at
`max_balance` so that a long healthy stretch cannot bank a huge allowance that would
all be spent at once when trouble starts.

The bound, over any run from construction to `now` (property-tested):

    withdrawals <= ratio * deposits + min_per_s * reserve_window_s + min_per_s * elapsed_s

Floating-point note: ten deposits of 0.1 sum to 0.9999999999999999, not 1.0, so a
withdrawal is granted when the level is within `_EPSILON` of one token. Each withdrawal
may therefore exceed the bound by at most `_EPSILON`, which the test allows for.

Must not: read the clock, do I/O, or know what a request is. Thread-unsafe by design: the
gateway owns one instance on its event loop.
"""

from __future__ import annotations

from seawall.policy.token_bucket import TokenBucket

_EPSILON = 1e-9
_WITHDRAWAL = 1.0


class RetryBudget:
    def __init__(
        self,
        ratio: float = 0.1,
        min_per_s: float = 1.0,
        reserve_window_s: float = 10.0,
        max_balance: float = 100.0,
        now: float = 0.0,
    ) -> None:
        if ratio < 0 or min_per_s < 0 or reserve_window_s < 0 or max_balance < 0:
            raise ValueError("retry budget parameters must be >= 0")
        self.ratio = ratio
        self.max_balance = max_balance
        self._earned = 0.0
        self._reserve = TokenBucket.full(
            capacity=min_per_s * reserve_window_s, refill_per_s=min_per_s, now=now
        )

    def deposit(self, now: float) -> None:
        """Record one successful request."""
        del now  # earned tokens do not age; `now` keeps the call shape uniform
        self._earned = min(self.max_balance, self._earned + self.ratio)

    def try_withdraw(self, now: float) -> bool:
        """Spend one token for a retry or hedge; False means the budget is exhausted.

        Earned tokens are spent first so that the time-based reserve stays available for
        the quiet periods it exists for; a shortfall is topped up from the reserve.
        """
        reserve_level = self._reserve.level(now)
        if self._earned + reserve_level < _WITHDRAWAL - _EPSILON:
            return False
        from_earned = min(self._earned, _WITHDRAWAL)
        from_reserve = _WITHDRAWAL - from_earned
        self._earned -= from_earned
        if from_reserve > 0:
            # Already checked to be (almost) available; charge so an epsilon shortfall
            # does not turn into a refusal.
            self._reserve.charge(from_reserve, now)
        return True

    def level(self, now: float) -> float:
        """Tokens available now (earned + reserve), for the retry-budget gauge."""
        return self._earned + max(0.0, self._reserve.level(now))
