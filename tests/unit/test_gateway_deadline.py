"""The three timeouts' arithmetic, with time passed in."""

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.deadline import Wait, first_token_wait, idle_check

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


def test_inter_token_idle_check() -> None:
    # Streaming since t=0, last chunk at t=10, idle timeout 5 s, deadline t=100.
    assert idle_check(now=12.0, last_chunk_at=10.0, deadline=100.0, itl_s=5.0) == Wait(3.0, "itl")
    assert idle_check(now=15.0, last_chunk_at=10.0, deadline=100.0, itl_s=5.0) == "itl"
    # Near the deadline the wait is cut short and named total.
    assert idle_check(now=98.0, last_chunk_at=97.0, deadline=100.0, itl_s=5.0) == Wait(2.0, "total")


def test_the_total_deadline_wins_a_tie() -> None:
    assert idle_check(now=100.0, last_chunk_at=95.0, deadline=100.0, itl_s=5.0) == "total"
    assert idle_check(now=101.0, last_chunk_at=100.5, deadline=100.0, itl_s=5.0) == "total"
    assert first_token_wait(now=101.0, deadline=100.0, ttft_s=5.0, stream=True).seconds == 0.0


@given(
    now=secs,
    span=secs,
    itl=st.floats(min_value=0.001, max_value=1e4),
    ttft=secs,
    idle=st.floats(min_value=0, max_value=1e4),
)
def test_a_wait_never_outlives_the_deadline(
    now: float, span: float, itl: float, ttft: float, idle: float
) -> None:
    deadline = now + span
    remaining = max(0.0, deadline - now)
    for w in (
        first_token_wait(now, deadline, ttft, stream=True),
        first_token_wait(now, deadline, ttft, stream=False),
        idle_check(now, now - idle, deadline, itl),
    ):
        if not isinstance(w, Wait):
            assert w == "total" or (w == "itl" and idle >= itl)
            continue
        assert 0.0 <= w.seconds <= remaining
        # Only the total timeout may wait all the way to the deadline.
        if w.kind != "total":
            assert w.seconds < remaining
