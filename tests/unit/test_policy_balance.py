"""Power of two choices and the replica cost formula."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.balance import draw_two, pick, replica_cost


def test_empty_gives_none_and_one_gives_that_one() -> None:
    rng = random.Random(1)
    assert pick([], lambda c: 0.0, rng) is None
    assert pick(["only"], lambda c: 0.0, rng) == "only"


@given(
    names=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=20, unique=True),
    seed=st.integers(0, 2**32),
)
def test_never_returns_a_candidate_it_was_not_given(names: list[str], seed: int) -> None:
    excluded = "excluded-replica"
    candidates = [n for n in names if n != excluded]
    choice = pick(candidates, len, random.Random(seed))
    assert (choice is None) == (not candidates)
    assert choice is None or choice in candidates


@given(n=st.integers(2, 12), seed=st.integers(0, 2**32))
def test_cheap_replica_wins_whenever_it_is_drawn(n: int, seed: int) -> None:
    # Replica 0 is idle, the rest are heavily loaded: any draw containing 0 returns 0,
    # and the two draws are distinct, so the expensive pair never beats it.
    cost = {0: replica_cost(0, 1.0, 0.1)} | {i: replica_cost(50, 1.0, 0.9) for i in range(1, n)}
    drawn = draw_two(n, random.Random(seed))  # the pair `pick` draws from the same seed
    choice = pick(list(range(n)), cost.__getitem__, random.Random(seed))
    assert len(set(drawn)) == 2 and all(0 <= i < n for i in drawn)
    if 0 in drawn:
        assert choice == 0
    else:
        assert choice in drawn


def test_every_ordered_pair_is_drawn_about_equally_often() -> None:
    rng = random.Random(3)
    counts = Counter(draw_two(4, rng) for _ in range(24_000))
    assert set(counts) == {(i, j) for i in range(4) for j in range(4) if i != j}
    # Expected 2000 each; 5 standard deviations is about 215.
    assert all(1785 <= c <= 2215 for c in counts.values()), counts


def test_two_candidates_the_cheaper_always_wins() -> None:
    rng = random.Random(7)
    assert all(
        pick(["busy", "idle"], {"busy": 5.0, "idle": 1.0}.__getitem__, rng) == "idle"
        for _ in range(200)
    )


def test_equal_costs_spread_roughly_uniformly() -> None:
    rng = random.Random(12345)
    counts = Counter(pick(list(range(5)), lambda _: 1.0, rng) for _ in range(10_000))
    assert set(counts) == set(range(5))
    # Expected 2000 each; 5 standard deviations is about 200.
    assert all(1800 <= c <= 2200 for c in counts.values()), counts


def test_cost_rises_with_load_and_kv_and_falls_with_score() -> None:
    assert replica_cost(0, 1.0, None) == 1.0
    assert replica_cost(3, 1.0, None) == 4.0
    assert replica_cost(0, 0.5, None) == 2.0
    assert replica_cost(0, 1.0, 0.5) == 2.0
    assert replica_cost(0, 1.0, 0.9) == 1 / (1 - 0.9)
    # Floors: a full cache costs 20x, a zero (or NaN) score costs 100x.
    assert replica_cost(0, 1.0, 1.0) == 20.0
    assert replica_cost(0, 0.0, None) == 100.0
    assert replica_cost(0, float("nan"), None) == 100.0
    assert replica_cost(0, 1.0, float("nan")) == 1.0


@given(
    inflight=st.integers(0, 1000),
    score=st.floats(0.0, 1.0),
    kv=st.none() | st.floats(0.0, 1.0),
    extra=st.integers(0, 10),
    worse_score=st.floats(0.0, 1.0),
    more_kv=st.floats(0.0, 1.0),
)
def test_cost_is_monotone(
    inflight: int, score: float, kv: float | None, extra: int, worse_score: float, more_kv: float
) -> None:
    base = replica_cost(inflight, score, kv)
    assert base > 0
    assert replica_cost(inflight + extra, score, kv) >= base
    assert replica_cost(inflight, min(score, worse_score), kv) >= base
    if kv is not None:
        assert replica_cost(inflight, score, max(kv, more_kv)) >= base
