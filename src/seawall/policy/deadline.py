"""Deadline arithmetic for the three timeouts: time to first token, inter-token idle, total.

Pure: `now` is an argument. The request path asks two questions: how long may I wait for
the next thing, and if that wait runs out, which timeout was it? Each timeout kind is
its own error (and its own metric label), so the answer must name the kind: a wait that
is cut short by the total deadline is a `total` timeout, not a `ttft` or `itl` one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TimeoutKind = Literal["ttft", "itl", "total"]


@dataclass(frozen=True, slots=True)
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


def next_chunk_wait(now: float, deadline: float, itl_s: float) -> Wait:
    """Wait for the next chunk of a stream that has started."""
    remaining = max(0.0, deadline - now)
    if itl_s < remaining:
        return Wait(itl_s, "itl")
    return Wait(remaining, "total")


def expired_kind(now: float, deadline: float, waited_kind: TimeoutKind) -> TimeoutKind:
    """The kind to report when a wait ran out at `now`: the total deadline wins ties."""
    return "total" if now >= deadline else waited_kind
