"""Per-request state: `RequestCtx` (who, what, how far, how it ended) and `StreamState`
(what the relay tracks of one stream across migrations).

Plain data, written by the layers in the order `stack.py` gives and read by the access
log and the metrics at the end. Must not hold behaviour beyond derived properties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from seawall.config import DEFAULT_TIER, Timeouts
from seawall.gateway.frontdoor import safe_request_id
from seawall.policy.pools import TierPools
from seawall.protocol.openai import ParsedRequest, Route

_ANY_POOL = TierPools()

if TYPE_CHECKING:
    from seawall.gateway.inflight import Hold, Ticket
    from seawall.gateway.pools import Reach
    from seawall.gateway.telemetry import RequestSpan, TraceContext
    from seawall.gateway.upstream import Opened
    from seawall.state.limits import Lease


class AdmissionHandle(Protocol):
    """Adaptive admission's per-request handle: told which replica an attempt claimed."""

    def bind(self, replica_id: str, hold: Hold) -> None: ...


@dataclass(slots=True)
class StreamState:
    """The relay's view of one stream. Migration keeps it: the continuation is presented
    as the same stream (first id and created, one role chunk, one combined usage)."""

    strip_usage: bool = False  # include_usage was added upstream by us, not asked for
    track_text: bool = False  # keep the delivered text (migration needs it)
    migrate: bool = False  # the tier opted into mid-stream migration
    # Delivered so far (when tracked), a part per chunk: `+=` on an attribute copies the
    # whole string every chunk (quadratic in the stream's length); joined on migration.
    text_parts: list[str] = field(default_factory=list)
    migrations: int = 0
    tokens_before_migration: int = 0  # delivered when the latest continuation began
    upstream_tokens: int = 0  # delivered from the current upstream (tokens, not chunks)
    prompt_tokens: int | None = None  # the prompt's count as the first replica reported it
    strip: frozenset[str] = frozenset()  # chunk keys we asked the upstream for, not the client
    aborted: bool = False  # the engine ended the stream with finish_reason "abort"
    stream_id: str | None = None  # the first upstream's id and created
    created: int | None = None
    opened: Opened | None = None  # the upstream being relayed now
    events: int = 0  # SSE events relayed after the head (a completion-length count)
    last: bytes = b""  # the stream's final bytes, held to go out with its end (relay.py)
    head_sent: bool = False  # the response's head went out from the socket callback (relay.py)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def completion_tokens(self) -> int:
        """Tokens delivered so far (when tracked), across migrations."""
        return self.tokens_before_migration + self.upstream_tokens


@dataclass(slots=True)
class RequestCtx:
    request_id: str
    route: Route
    started: float  # monotonic
    timeouts: Timeouts
    req: ParsedRequest | None = None
    model_known: bool = False  # the fleet served the request's model when it arrived
    tenant: str = "default"
    tier: str = DEFAULT_TIER
    priority: int = 0  # the tier's: 0 is served first under contention
    pools: TierPools = _ANY_POOL  # the tier's use of pools (gateway/pools.py)
    pool_refused: str | None = None  # the pool that had nothing and would not pass it on
    # Fleet admission's last look at the replicas, for the dispatcher's first choice (the
    # same request, the same instant: no second pass over every replica's saturation).
    reach: Reach | None = None
    status: int = 0
    replica: str = ""
    attempts: int = 0
    ttft_s: float | None = None
    queued_s: float = 0.0  # time spent in the admission queue
    error: str = ""
    error_code: str = ""  # of the error answered (an ApiError's code), for logs and traces
    stage: str = "parsing"  # for cancellations: where the client left
    ticket: Ticket | None = None
    lease: Lease | None = None  # the tenant's rate/concurrency claim, released at the end
    reconcile: bool = False  # settle the prompt-token charge with the engine's usage
    usage: dict[str, Any] | None = None  # the engine's usage, when read
    prompt_tokens: int = 0  # counted at the door (0 when no limit needed the count)
    reserve_tokens: int = 0  # KV tokens this request may grow to (prompt + max_tokens)
    sequences: int = 1  # engine sequences it runs: prompts x `n` (or `best_of`)
    admission: AdmissionHandle | None = None  # adaptive admission's (admission_control.py)
    stream: StreamState = field(default_factory=StreamState)
    policy: object = None  # the tenancy policy it authenticated under (tenancy.Policy)
    trace: TraceContext | None = None  # the client's W3C trace context, forwarded upstream
    span: RequestSpan | None = None  # when tracing is on (telemetry.py)

    @property
    def deadline(self) -> float:
        return self.started + self.timeouts.total_s

    @property
    def model(self) -> str:
        return self.req.model if self.req else ""


def new_request_id(incoming: str | None) -> str:
    """The client's X-Request-Id when it is safe to forward and log, otherwise a new one
    (`frontdoor.safe_request_id`: non-ASCII ids cannot be sent on as an HTTP header and
    would be forwarded as raw bytes that engines reject; a key pasted there is logged).

    A new one is 16 hex digits, vLLM's own: the engine honours the X-Request-Id it is
    sent, so its ids (`cmpl-…`, `chatcmpl-…`) keep vLLM's shape through the gateway."""
    return safe_request_id(incoming) or os.urandom(8).hex()
