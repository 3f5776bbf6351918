"""A token bucket with the clock passed in: the one rate primitive every limiter builds on.

Owns: the arithmetic of a bucket that refills continuously at `refill_per_s` up to
`capacity`. Rate limits (requests/min, prompt tokens/min), the retry budget's reserve and
anything else that says "so much per second, with this much burst" use it.

Must not: read the clock, sleep, or lock. `now` is monotonic seconds supplied by the
caller, so a test can step time exactly and a shell can share one `now` across several
buckets for one request. Refill is lazy (computed on each call from the time elapsed since
`updated_at`) so an idle bucket costs nothing.

Why `charge` may drive the bucket negative: a token-per-minute limit can only be checked
against an estimate (the prompt is counted up front, the completion length is unknown).
When the real usage arrives after the response, the caller charges the difference; a
tenant who overran their estimate then waits for the debt to refill before the next
request is granted, instead of the overrun being forgotten.

A clock that steps backwards (it should not, it is monotonic, but callers may pass `now`
values from different sources) refills nothing and never moves `updated_at` backwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    refill_per_s: float
    tokens: float
    updated_at: float  # monotonic seconds of the last refill

    @classmethod
    def full(cls, capacity: float, refill_per_s: float, now: float) -> TokenBucket:
        """A bucket holding `capacity` tokens at `now`."""
        if capacity < 0 or refill_per_s < 0:
            raise ValueError("capacity and refill_per_s must be >= 0")
        return cls(capacity=capacity, refill_per_s=refill_per_s, tokens=capacity, updated_at=now)

    def _refilled(self, now: float) -> float:
        elapsed_s = max(0.0, now - self.updated_at)
        if self.tokens >= self.capacity:
            # Already full (refund caps, but a caller may construct one over capacity).
            return self.tokens
        return min(self.capacity, self.tokens + elapsed_s * self.refill_per_s)

    def _advance(self, now: float) -> None:
        self.tokens = self._refilled(now)
        self.updated_at = max(self.updated_at, now)

    def level(self, now: float) -> float:
        """Tokens available at `now` (negative while a debt from `charge` is refilling)."""
        return self._refilled(now)

    def try_take(self, amount: float, now: float) -> float:
        """Take `amount` tokens if present.

        Returns 0.0 when granted (the tokens are removed). Otherwise nothing is removed and
        the result is the seconds until `amount` would be available at the current refill
        rate: `math.inf` when it never will (amount over capacity, or no refill).
        """
        if amount > self.capacity:
            return math.inf
        self._advance(now)
        if self.tokens >= amount:
            self.tokens -= amount
            return 0.0
        if self.refill_per_s <= 0:
            return math.inf
        return (amount - self.tokens) / self.refill_per_s

    def charge(self, amount: float, now: float) -> None:
        """Remove `amount` unconditionally; the level may go negative (usage reconciled late)."""
        self._advance(now)
        self.tokens -= amount

    def refund(self, amount: float, now: float) -> None:
        """Give back `amount` (e.g. a request rejected after it was counted), capped at capacity."""
        self._advance(now)
        self.tokens = min(self.capacity, self.tokens + amount)
