"""Typed outcomes: how one upstream attempt ended, how a relayed stream ended, and the
pure mapping from a failed request to the error its client receives.

Each outcome carries what the request path must know about it, in one table row: may
another replica be tried, does the retry spend the fleet-wide budget, does it count
against the replica's health, and what the client is told. The values are the label
values of `seawall_upstream_attempts_total{outcome}` and `seawall_stream_errors_total
{reason}`, so the metrics and the code cannot drift apart.

Must not: do I/O or read the clock. `client_error` is a function of its arguments only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from seawall.errors import ApiError, rate_limited, unavailable


class Attempt(StrEnum):
    """How one attempt on one replica ended (before the first token, or its whole body)."""

    ok = "ok"
    connect_error = "connect_error"  # refused, unreachable, TLS failed: no request sent
    reset = "reset"  # the connection broke before the first token
    http_5xx = "http_5xx"
    http_429 = "http_429"  # 429 or 503: the engine's own admission said back off
    http_4xx = "http_4xx"  # the request itself is at fault
    redirect = "redirect"  # a misconfigured replica URL
    error_event = "error_event"  # an SSE error event before the first token
    aborted = "aborted"  # finish_reason "abort" before the first token (engine stopping)
    ttft_timeout = "ttft_timeout"
    total_timeout = "total_timeout"
    cancelled = "cancelled"  # the client left, or the gateway cut it
    hedge_lost = "hedge_lost"  # the other copy of a hedged request won


@dataclass(frozen=True, slots=True)
class AttemptRule:
    retryable: bool  # another replica may be tried
    spends_budget: bool  # a retry after it withdraws from the fleet-wide budget
    replica_fault: bool  # counts against the replica's health (its error EWMA)


_A = AttemptRule
ATTEMPT_RULES: dict[Attempt, AttemptRule] = {
    Attempt.ok: _A(retryable=False, spends_budget=False, replica_fault=False),
    # Nothing reached the engine: a retry elsewhere is the request's first execution,
    # not an amplification, so it costs no budget (still bounded by max_attempts and
    # by the replicas not yet tried).
    Attempt.connect_error: _A(retryable=True, spends_budget=False, replica_fault=True),
    Attempt.reset: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.http_5xx: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.http_429: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.http_4xx: _A(retryable=False, spends_budget=False, replica_fault=False),
    Attempt.redirect: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.error_event: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.aborted: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.ttft_timeout: _A(retryable=True, spends_budget=True, replica_fault=True),
    Attempt.total_timeout: _A(retryable=False, spends_budget=False, replica_fault=True),
    Attempt.cancelled: _A(retryable=False, spends_budget=False, replica_fault=False),
    Attempt.hedge_lost: _A(retryable=False, spends_budget=False, replica_fault=False),
}


class StreamEnd(StrEnum):
    """How a stream ended after its first token reached the client."""

    done = "done"
    itl_timeout = "itl_timeout"
    total_timeout = "total_timeout"
    upstream_reset = "upstream_reset"
    upstream_closed = "upstream_closed"
    upstream_aborted = "upstream_aborted"
    gateway_draining = "gateway_draining"  # the gateway's drain deadline came first


@dataclass(frozen=True, slots=True)
class StreamRule:
    status: int  # of the error event the client receives
    message: str
    migratable: bool  # another replica can continue the answer (tiers that opt in)
    replica_fault: bool


_S = StreamRule
STREAM_RULES: dict[StreamEnd, StreamRule] = {
    StreamEnd.done: _S(200, "", migratable=False, replica_fault=False),
    StreamEnd.itl_timeout: _S(
        504,
        "The upstream replica stopped sending tokens (inter-token timeout).",
        migratable=True,
        replica_fault=True,
    ),
    StreamEnd.total_timeout: _S(
        504, "The request reached its total deadline.", migratable=False, replica_fault=False
    ),
    StreamEnd.upstream_reset: _S(
        502, "The upstream replica failed mid-stream.", migratable=True, replica_fault=True
    ),
    StreamEnd.upstream_closed: _S(
        502,
        "The upstream replica closed the stream before it finished.",
        migratable=True,
        replica_fault=True,
    ),
    StreamEnd.upstream_aborted: _S(
        502,
        "The upstream replica aborted the request (it is shutting down).",
        migratable=True,
        replica_fault=True,
    ),
    StreamEnd.gateway_draining: _S(
        503,
        "The gateway is shutting down and its drain deadline has passed; retry the request.",
        migratable=False,
        replica_fault=False,
    ),
}


def stream_error(end: StreamEnd) -> ApiError:
    """The error event that ends a stream the client has already started reading."""
    rule = STREAM_RULES[end]
    return ApiError(rule.status, rule.message, code=end.value)


@dataclass(frozen=True, slots=True)
class Failure:
    """The last failed attempt of a request, as `client_error` needs it."""

    outcome: Attempt
    message: str
    status: int | None = None  # the engine's HTTP status, when it answered
    body: bytes | None = None  # the engine's error body, relayed as written
    content_type: str = "application/json"
    retry_after_s: float | None = None


def client_error(
    model: str,
    attempts: int,
    last: Failure | None,
    backoff_s: list[float],
    *,
    tried_any: bool,
    budget_exhausted: bool,
    eject_s: float,
) -> ApiError:
    """The error a client receives when no attempt produced a first token.

    `backoff_s` holds the Retry-After of every replica that asked to back off;
    `tried_any` is False when no replica could even be chosen after the last failure.
    """
    if last is None:
        return unavailable(
            f"No replica of `{model}` is available right now.",
            retry_after_s=1.0,
            code="no_replica",
        )
    if last.outcome is Attempt.http_429 or (backoff_s and not tried_any):
        return rate_limited(
            "Every replica serving this model asked the gateway to back off; "
            "retry after the indicated time.",
            min(backoff_s) if backoff_s else 1.0,
            code="engine_busy",
        )
    if last.outcome is Attempt.http_4xx and last.status is not None:
        return pass_through(last.status, last.body or b"", last.content_type)
    timed_out = last.outcome in (Attempt.ttft_timeout, Attempt.total_timeout)
    if budget_exhausted:
        # The status keeps the failure's kind; the message names both causes.
        status = 504 if timed_out else (last.status or 502)
        return ApiError(
            status if status >= 500 else 502,
            f"The upstream attempt failed ({last.message}) and the fleet-wide retry budget "
            "is spent, so no other replica was tried.",
            code="retry_budget_exhausted",
        )
    if timed_out:
        kind = "time to first token" if last.outcome is Attempt.ttft_timeout else "total"
        return ApiError(
            504,
            f"Upstream timed out ({kind} timeout) after {attempts} attempt(s).",
            code=last.outcome.value,
        )
    if last.outcome is Attempt.http_5xx and last.status is not None and last.body:
        return pass_through(last.status, last.body, last.content_type)
    if last.outcome is Attempt.connect_error:
        return unavailable(
            f"No replica of `{model}` accepted the connection.",
            retry_after_s=eject_s,
            code="no_replica",
        )
    return ApiError(502, f"Upstream failed: {last.message}", code=last.outcome.value)


def pass_through(status: int, raw: bytes, content_type: str) -> ApiError:
    """An upstream error relayed as the engine wrote it (already OpenAI-shaped)."""
    return ApiError(status, raw[:200].decode(errors="replace"), raw=raw, content_type=content_type)
