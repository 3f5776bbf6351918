"""Per-tier request limits, checked before anything reaches an engine.

Why at the gateway. An engine asked for a 100k-token prompt or a 32k-token completion
will try: it allocates KV cache for it, preempts other tenants' requests to make room,
and may run for minutes. One tenant's oversized request then becomes everyone's latency
problem. The gateway knows the tenant's tier and the prompt's token count, so it can
refuse (or trim) the request up front with a 400 that names the limit and the number,
which is the only error a client can act on.

Owns: the tier limits record, the per-request size check, and the shape of the per-tier
rate buckets. `max_concurrent`, `prompt_tokens_per_min` and `requests_per_min` are
enforced by the gateway's concurrency and rate layers (with `TokenBucket`); they live
here so that one record describes a tier. `priority` orders tiers for admission: 0 is the
most important, larger numbers are shed first (see `admission`).

`max_tokens` handling: a request without `max_tokens` gets the tier's
`max_tokens_default`. A request over `max_tokens_max` is rejected (mode "reject", the
OpenAI behaviour and the default) or clamped to the limit (mode "clamp", for clients
that always send a huge value). Limits set to None are unlimited.

Must not: count tokens (the protocol layer does), read the clock, or know tenants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from seawall.policy.token_bucket import TokenBucket
from seawall.values import frozen


@dataclass(frozen=True, slots=True)
class TierLimits:
    max_prompt_tokens: int | None = None
    max_tokens_max: int | None = None
    max_tokens_default: int = 1024
    max_tokens_mode: Literal["reject", "clamp"] = "reject"
    max_concurrent: int | None = None
    prompt_tokens_per_min: int | None = None
    requests_per_min: int | None = None
    priority: int = 0  # 0 = most important; larger numbers are shed first

    def __post_init__(self) -> None:
        if self.max_tokens_default < 1:
            raise ValueError("max_tokens_default must be >= 1")
        if self.max_tokens_max is not None and self.max_tokens_default > self.max_tokens_max:
            raise ValueError("max_tokens_default must not exceed max_tokens_max")
        if self.max_tokens_mode not in ("reject", "clamp"):
            raise ValueError("max_tokens_mode must be 'reject' or 'clamp'")


@frozen
class Accept:
    """Forward the request with this `max_tokens` (the default filled in, or clamped)."""

    max_tokens: int


@frozen
class Reject:
    """Refuse with an OpenAI-style error: `status`, `message`, `param`, `code`."""

    message: str
    param: str | None
    status: int = 400
    code: str | None = None


def check_request(
    prompt_tokens: int,
    requested_max_tokens: int | None,
    limits: TierLimits,
    prompt_param: str = "messages",
) -> Accept | Reject:
    """Check one request's size against its tier; `prompt_param` names the prompt field
    in the error ("messages" for chat, "prompt" for completions)."""
    if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
        return Reject(
            message=(
                f"prompt has {prompt_tokens} tokens, over this tier's limit of "
                f"{limits.max_prompt_tokens} (max_prompt_tokens)"
            ),
            param=prompt_param,
            code="prompt_too_long",
        )
    if requested_max_tokens is None:
        return Accept(max_tokens=limits.max_tokens_default)
    if requested_max_tokens < 1:
        return Reject(
            message=f"max_tokens must be at least 1, got {requested_max_tokens}",
            param="max_tokens",
        )
    if limits.max_tokens_max is not None and requested_max_tokens > limits.max_tokens_max:
        if limits.max_tokens_mode == "clamp":
            return Accept(max_tokens=limits.max_tokens_max)
        return Reject(
            message=(
                f"max_tokens is {requested_max_tokens}, over this tier's limit of "
                f"{limits.max_tokens_max} (max_tokens_max)"
            ),
            param="max_tokens",
            code="max_tokens_too_large",
        )
    return Accept(max_tokens=requested_max_tokens)


def per_minute_bucket(limit_per_min: int | None, now: float) -> TokenBucket | None:
    """A bucket for a per-minute limit: a full minute's burst, refilled evenly; None = no limit.

    The burst is the whole minute's allowance so that a client that was idle can send its
    minute's worth at once, which is what "N per minute" promises.
    """
    if limit_per_min is None:
        return None
    return TokenBucket.full(capacity=limit_per_min, refill_per_s=limit_per_min / 60.0, now=now)
