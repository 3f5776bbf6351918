"""Deadline arithmetic for the three timeouts: time to first token, inter-token idle, total.

Pure: `now` is an argument. The request path asks two questions: how long may I wait for
the next thing, and if that wait runs out, which timeout was it? Each timeout kind is
its own error (and its own metric label), so the answer must name the kind: a wait that
is cut short by the total deadline is a `total` timeout, not a `ttft` or `itl` one.
"""

from __future__ import annotations

from typing import Literal

from seawall.values import frozen

TimeoutKind = Literal["ttft", "itl", "total"]


@frozen
class Wait:
    seconds: float  # >= 0
    kind: TimeoutKind  # which timeout fires if nothing arrives within `seconds`


def first_token_wait(
    now: float, deadline: float, ttft_s: float, stream: bool, attempt_started: float | None = None
) -> Wait:
    """Wait for an attempt's first token (streaming) or whole body (non-streaming).

    The TTFT clock restarts for each attempt (a retry deserves a full TTFT window), but
    never past the request's total deadline. A non-streaming response has no first token
    the gateway can see, so only the total deadline applies to it.
    """
    remaining = max(0.0, deadline - now)
    if not stream:
        return Wait(remaining, "total")
    start = now if attempt_started is None else attempt_started
    ttft_left = max(0.0, start + ttft_s - now)
    if ttft_left < remaining:
        return Wait(ttft_left, "ttft")
    return Wait(remaining, "total")


def idle_check(
    now: float, last_chunk_at: float, deadline: float, itl_s: float
) -> Wait | TimeoutKind:
    """For a stream that has started: the timeout that has expired by `now`, or how long
    until one could. The total deadline wins a tie, so a wait cut short by it is
    reported as `total`, never as `itl`."""
    if now >= deadline:
        return "total"
    if now - last_chunk_at >= itl_s:
        return "itl"
    idle_left = last_chunk_at + itl_s - now
    total_left = deadline - now
    if idle_left < total_left:
        return Wait(idle_left, "itl")
    return Wait(total_left, "total")
