"""The three timeouts' arithmetic, with time passed in."""

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.deadline import expired_kind, first_token_wait, next_chunk_wait

secs = st.floats(min_value=0, max_value=1e5, allow_nan=False)


def test_stream_waits_for_ttft_when_the_deadline_is_further() -> None:
    w = first_token_wait(now=100.0, deadline=700.0, ttft_s=30.0, stream=True)
    assert (w.seconds, w.kind) == (30.0, "ttft")


def test_total_deadline_cuts_a_ttft_wait_short_and_is_named_total() -> None:
    w = first_token_wait(now=100.0, deadline=110.0, ttft_s=30.0, stream=True)
    assert (w.seconds, w.kind) == (10.0, "total")


def test_retry_gets_a_fresh_ttft_window_but_not_past_the_deadline() -> None:
    # First attempt timed out at t=130; the retry starts at t=130.
    w = first_token_wait(now=130.0, deadline=150.0, ttft_s=30.0, stream=True, attempt_started=130.0)
    assert (w.seconds, w.kind) == (20.0, "total")
    w = first_token_wait(now=130.0, deadline=700.0, ttft_s=30.0, stream=True, attempt_started=130.0)
    assert (w.seconds, w.kind) == (30.0, "ttft")


def test_non_streaming_has_only_the_total_deadline() -> None:
    w = first_token_wait(now=0.0, deadline=600.0, ttft_s=1.0, stream=False)
    assert (w.seconds, w.kind) == (600.0, "total")


def test_inter_token_wait() -> None:
    assert next_chunk_wait(now=10.0, deadline=100.0, itl_s=5.0).kind == "itl"
    w = next_chunk_wait(now=98.0, deadline=100.0, itl_s=5.0)
    assert (w.seconds, w.kind) == (2.0, "total")


def test_past_the_deadline_every_wait_is_zero_and_total() -> None:
    assert next_chunk_wait(now=101.0, deadline=100.0, itl_s=5.0).seconds == 0.0
    assert first_token_wait(now=101.0, deadline=100.0, ttft_s=5.0, stream=True).seconds == 0.0
    assert expired_kind(100.0, 100.0, "itl") == "total"
    assert expired_kind(99.0, 100.0, "itl") == "itl"


@given(now=secs, span=secs, itl=st.floats(min_value=0.001, max_value=1e4), ttft=secs)
def test_a_wait_never_outlives_the_deadline(
    now: float, span: float, itl: float, ttft: float
) -> None:
    deadline = now + span
    for w in (
        next_chunk_wait(now, deadline, itl),
        first_token_wait(now, deadline, ttft, stream=True),
        first_token_wait(now, deadline, ttft, stream=False),
    ):
        remaining = max(0.0, deadline - now)
        assert 0.0 <= w.seconds <= remaining
        # Only the total timeout may wait all the way to the deadline.
        if w.kind != "total":
            assert w.seconds < remaining
