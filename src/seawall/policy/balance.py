"""Replica choice: power of two choices over a cost function.

Why two random choices and not "least loaded". The load the gateway sees is always a
little stale (a scrape is seconds old, in-flight counts race between concurrent
requests). Sending every request to the single least-loaded replica makes all of them
pile onto the same one until the next update: herding. Picking uniformly at random
ignores load entirely. Drawing two distinct replicas at random and taking the cheaper
one gets almost all of the benefit of least-loaded (the maximum load drops from
O(log n / log log n) to O(log log n)) while staying robust to stale data, because two
concurrent requests rarely draw the same pair.

Owns: the draw and the comparison, and the cost formula for a replica. Must not: decide
which replicas are eligible (the caller filters out unroutable, saturated and already
tried replicas before calling), read the clock, or keep state. The random source is an
argument so tests are seeded and reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# A replica's score is in (0, 1]; the floor keeps a near-zero score from dividing by
# zero while still making such a replica about 100x as expensive as a healthy one.
MIN_SCORE = 0.01
# The free-KV factor is capped: a full cache makes a replica 20x as expensive, not
# infinitely so, because admission (not balance) decides when a replica takes no work.
MIN_KV_FREE = 0.05


def pick(candidates: Sequence[T], cost: Callable[[T], float], rng: random.Random) -> T | None:
    """Draw two distinct candidates at random and return the cheaper one.

    One candidate is returned as is; an empty sequence gives None. On equal cost the
    first drawn wins, so ties are broken at random, not by position.
    """
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        return candidates[0]
    i, j = draw_two(n, rng)
    first, second = candidates[i], candidates[j]
    return second if cost(second) < cost(first) else first


def draw_two(n: int, rng: random.Random) -> tuple[int, int]:
    """Two distinct indices below `n` (n >= 2), uniformly, in random order: the second is
    drawn from the n - 1 others. Two `rng.random()` calls; `rng.sample` took four times
    as long, once per request."""
    i = int(rng.random() * n)
    j = int(rng.random() * (n - 1))
    return i, j + (j >= i)


def replica_cost(inflight: int, score: float, kv_usage: float | None) -> float:
    """Expected cost of sending one more request to a replica; lower is better.

        cost = (inflight + 1) / max(score, 0.01) * kv_factor
        kv_factor = 1 / max(1 - kv_usage, 0.05)     (1 when kv_usage is unknown)

    `inflight + 1` is the load the replica would carry with this request: counting the
    new request makes an idle replica with a poor score still cost more than an idle
    healthy one. Dividing by the health score sends proportionally less work to a
    degraded replica. The KV factor follows the queueing intuition 1 / (1 - utilisation):
    a replica with little free KV cache will queue or preempt the new request, and the
    cost climbs steeply as the cache fills (2x at half full, 10x at 90 %, capped at 20x).
    A kv_usage outside [0, 1] (a misreporting engine) is clamped; NaN counts as unknown.
    """
    # Written so that a NaN score also falls to the floor.
    base = (max(inflight, 0) + 1) / (score if score > MIN_SCORE else MIN_SCORE)
    if kv_usage is None or math.isnan(kv_usage):
        return base
    kv = min(max(kv_usage, 0.0), 1.0)
    return base / max(1.0 - kv, MIN_KV_FREE)
