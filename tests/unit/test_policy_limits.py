"""Tier limits: what a client is told when a request is too big, and what is forwarded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.limits import Accept, Reject, TierLimits, check_request, per_minute_bucket

TIER = TierLimits(max_prompt_tokens=4096, max_tokens_max=2048, max_tokens_default=256)


def test_prompt_over_the_limit_names_the_limit_and_the_count() -> None:
    assert check_request(5000, 100, TIER) == Reject(
        message="prompt has 5000 tokens, over this tier's limit of 4096 (max_prompt_tokens)",
        param="messages",
        status=400,
        code="prompt_too_long",
    )
    on_completions = check_request(5000, 100, TIER, prompt_param="prompt")
    assert isinstance(on_completions, Reject) and on_completions.param == "prompt"
    assert check_request(4096, 100, TIER) == Accept(max_tokens=100)


def test_missing_max_tokens_gets_the_tier_default() -> None:
    assert check_request(10, None, TIER) == Accept(max_tokens=256)


def test_max_tokens_over_the_limit_rejects_or_clamps_by_mode() -> None:
    rejected = check_request(10, 8000, TIER)
    assert rejected == Reject(
        message="max_tokens is 8000, over this tier's limit of 2048 (max_tokens_max)",
        param="max_tokens",
        code="max_tokens_too_large",
    )
    clamping = TierLimits(max_tokens_max=2048, max_tokens_default=256, max_tokens_mode="clamp")
    assert check_request(10, 8000, clamping) == Accept(max_tokens=2048)
    assert check_request(10, 2048, TIER) == Accept(max_tokens=2048)


def test_nonpositive_max_tokens_is_a_client_error() -> None:
    r = check_request(10, 0, TIER)
    assert isinstance(r, Reject) and r.param == "max_tokens" and r.status == 400


def test_unlimited_tier_accepts_anything_positive() -> None:
    assert check_request(10**6, 10**6, TierLimits()) == Accept(max_tokens=10**6)


def test_inconsistent_limits_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="max_tokens_default"):
        TierLimits(max_tokens_max=100, max_tokens_default=200)


def test_per_minute_bucket_allows_a_minutes_burst_then_refills_evenly() -> None:
    assert per_minute_bucket(None, now=0.0) is None
    bucket = per_minute_bucket(60, now=0.0)
    assert bucket is not None
    assert all(bucket.try_take(1, now=0.0) == 0.0 for _ in range(60))
    assert bucket.try_take(1, now=0.0) == 1.0
    assert bucket.try_take(1, now=1.0) == 0.0


@given(
    prompt=st.integers(0, 10_000),
    requested=st.none() | st.integers(-5, 10_000),
    max_prompt=st.none() | st.integers(1, 8000),
    max_max=st.none() | st.integers(512, 8000),
    mode=st.sampled_from(["reject", "clamp"]),
)
def test_an_accepted_request_always_fits_the_tier(
    prompt: int, requested: int | None, max_prompt: int | None, max_max: int | None, mode: str
) -> None:
    limits = TierLimits(
        max_prompt_tokens=max_prompt,
        max_tokens_max=max_max,
        max_tokens_default=256,
        max_tokens_mode="clamp" if mode == "clamp" else "reject",
    )
    d = check_request(prompt, requested, limits)
    if isinstance(d, Accept):
        assert max_prompt is None or prompt <= max_prompt
        assert d.max_tokens >= 1
        assert max_max is None or d.max_tokens <= max_max
        if requested is not None:
            assert d.max_tokens <= requested
    else:
        assert d.status == 400
        assert str(prompt) in d.message or str(requested) in d.message
