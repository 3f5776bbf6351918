"""Before the first token: choose a replica, attempt, retry elsewhere, hedge.

Per request: choose a replica (serving the model, routable, not saturated, not yet
tried; power of two choices), claim it in the in-flight ledger, and attempt. A failure
before the first token is retried on a replica not yet tried while the outcome's rule
allows it (`outcomes.ATTEMPT_RULES`), the request's attempts and deadline last, and the
fleet-wide retry budget pays for it: a retry after a refused connection is free (the
engine did no work), every other one withdraws a token. A hedge (opt-in, short prompts
on a quiet fleet) races a delayed second copy under the same budget; the first token
wins and the loser is cancelled, which closes its connection so its engine aborts.

Must not: touch the client's response (the proxy and the relay do), or know about
tenants (admission ran before).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson

from seawall import clock
from seawall.config import RetryConfig
from seawall.errors import ApiError, unavailable
from seawall.gateway import aliases
from seawall.gateway.bulkhead import Bulkheads
from seawall.gateway.context import RequestCtx
from seawall.gateway.inflight import InFlight
from seawall.gateway.migrate import counting_request
from seawall.gateway.outcomes import ATTEMPT_RULES, Attempt, Failure, client_error
from seawall.gateway.pools import PoolRouter, one_pool_reach
from seawall.gateway.replicas import Replica, ReplicaSet, blocks_for
from seawall.gateway.upstream import AttemptFailed, CommitFor, Opened, Upstream
from seawall.metrics import Metrics
from seawall.policy.admission import slot_free
from seawall.policy.deadline import first_token_wait
from seawall.policy.hedge import HedgePolicy
from seawall.policy.retry_budget import RetryBudget


def encode_body(obj: dict[str, Any]) -> bytes:
    """The request object as sent upstream; a client's object too deep to re-encode is
    the client's error (orjson reads 1,024 levels but writes 254)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        raise ApiError(
            400, "The request body is nested too deeply to be forwarded.", code="too_deep"
        ) from None


class Dispatcher:
    def __init__(
        self,
        *,
        replicas: ReplicaSet,
        ledger: InFlight,
        upstream: Upstream,
        budget: RetryBudget,
        retry: RetryConfig,
        metrics: Metrics,
        hedge: HedgePolicy | None = None,
        fleet_load: Callable[[], float] = lambda: 1.0,
        on_ttft: Callable[[float], None] | None = None,
        pools: PoolRouter | None = None,
        pool_retry_after_s: float = 10.0,
        bulkheads: Bulkheads | None = None,
    ) -> None:
        self.replicas = replicas
        # Which pools a request may use, in which order (gateway/pools.py); None: one pool.
        self.pools = pools
        self.pool_retry_after_s = pool_retry_after_s
        self.ledger = ledger
        self.upstream = upstream
        self.budget = budget
        self.retry = retry
        self.metrics = metrics
        self.hedge = hedge  # None: hedging off
        self.fleet_load = fleet_load
        self.on_ttft = on_ttft  # every first token's TTFT (the admin history samples it)
        self.bulkheads = bulkheads  # grammar-constrained requests' own replicas

    # -- the request's first token ------------------------------------------------------

    async def open(
        self, ctx: RequestCtx, body: bytes | dict[str, Any], commit: CommitFor | None = None
    ) -> Opened:
        """An upstream that produced the first token (or whole body), or raise the
        client's `ApiError`. `commit`: the relay's, to send the first token on from the
        upstream's socket callback (not for a hedge, whose copies race to it)."""
        tried: set[str] = set()
        last: Failure | None = None
        backoff: list[float] = []
        while True:
            now = clock.monotonic()
            replica = self.choose(ctx, now, tried)
            if replica is None:
                raise self._exhausted(ctx, last, backoff, tried_any=False)
            if last is not None:
                spends = ATTEMPT_RULES[last.outcome].spends_budget
                if spends and not self.budget.try_withdraw(now):
                    self.metrics.retry_budget_exhausted.inc()
                    raise self._exhausted(ctx, last, backoff, budget_exhausted=True)
                self.metrics.retries.labels(last.outcome.value).inc()
            tried.add(replica.id)
            ctx.attempts += 1
            try:
                if not tried - {replica.id} and self._hedge_ok(ctx):
                    return await self._hedged(ctx, replica, body, tried)
                return await self.attempt(ctx, replica, body, commit=commit)
            except AttemptFailed as f:
                last = f.failure
                if f.outcome is Attempt.http_429:
                    backoff.append(last.retry_after_s or 1.0)
                if (
                    not ATTEMPT_RULES[f.outcome].retryable
                    or ctx.attempts >= self.retry.max_attempts
                    or clock.monotonic() >= ctx.deadline
                ):
                    raise self._exhausted(ctx, last, backoff) from None

    def choose(
        self, ctx: RequestCtx, now: float, tried: set[str], free_only: bool = False
    ) -> Replica | None:
        reach, ctx.reach = ctx.reach, None  # admission's look, good for the first choice
        if reach is None or tried:
            need = ctx.reserve_tokens
            if self.pools is None:
                reach = one_pool_reach(self.replicas, ctx.model, now, tried, need)
            else:
                reach = self.pools.reach(ctx.model, ctx.pools, now, tried, need)
        if reach.refused_by is not None:
            ctx.pool_refused = reach.refused_by
        free, saturated = reach.free, reach.saturated
        # Within what the serving pools allow: grammar-constrained requests and plain
        # ones kept apart (bulkhead.py).
        bulkhead = self.bulkheads.current() if self.bulkheads is not None else None
        if bulkhead is not None and ctx.req is not None:
            constrained = bool(ctx.req.constraints)
            free, saturated = bulkhead.split(ctx.tier, constrained, free, saturated)
        if free_only:
            # Only a replica that would start it at once (a continuation that waited for
            # a slot would stall the client's stream: issue 13, bug 4).
            snap = self.replicas.snapshot()
            free = [
                r for r in free if slot_free(self.replicas.view(r, snap).load, r.counts.sequences)
            ]
            return self.replicas.choose(free)
        return self.replicas.choose(free or saturated)

    async def attempt(
        self,
        ctx: RequestCtx,
        replica: Replica,
        body: bytes | dict[str, Any],
        leg: _Leg | None = None,
        ttft_s: float | None = None,
        commit: CommitFor | None = None,
    ) -> Opened:
        """One attempt on `replica`, holding its in-flight claim until the returned
        `Opened` is closed (or at once, on failure). `body` as an object: the request is
        sent asking the replica's engine for per-chunk token counts (a stream that may
        migrate needs them). `leg`: one copy of a hedge. `ttft_s`: a first-token wait of
        its own (a continuation's). `commit`: see `open`; not under an alias, whose
        events the relay restamps."""
        req = ctx.req
        assert req is not None
        # A replica reached under an alias gets its own served name (and answers under
        # the public one); None: the names agree, nothing to rewrite.
        served = replica.model if replica.model != ctx.model else None
        if served is not None:
            multipart = req.spec.body == "multipart"  # an upload: its form field, not JSON
            body = req.with_model(served) if multipart else aliases.upstream_body(body, served)
        strip: frozenset[str] = frozenset()
        if isinstance(body, dict):
            engine = self.replicas.view(replica, self.replicas.snapshot()).engine
            counted, strip = counting_request(body, engine or replica.engine)
            body = encode_body(counted)
        # A remote pool has timeouts of its own (a WAN hop, another gateway's queue): its
        # first-token budget for this attempt, and once it answers, its inter-token gap
        # and total for the rest of the request.
        pool = self.pools.timeouts(replica.pool) if self.pools is not None else None
        timeouts = ctx.timeouts
        if pool is not None and pool.timeouts is not None:
            timeouts = pool.timeouts.apply(timeouts)
        first_token_s = timeouts.ttft_s if ttft_s is None else min(ttft_s, timeouts.ttft_s)
        if self.pools is not None and not self.pools.allows(replica.pool, clock.monotonic()):
            # The pool's breaker let another request take its one trial meanwhile.
            raise AttemptFailed(
                Failure(Attempt.connect_error, f"the circuit to pool {replica.pool} is open")
            )
        deadline = ctx.started + timeouts.total_s
        wait = first_token_wait(clock.monotonic(), deadline, first_token_s, req.stream)
        # With tracing on, the attempt's own span is the replica's parent; otherwise the
        # client's trace context goes on as it came (telemetry.py).
        span = (
            ctx.span.attempt(replica, served or ctx.model, ctx.stage == "streaming")
            if ctx.span is not None
            else None
        )
        trace = span.headers if span is not None else ctx.trace.headers if ctx.trace else None
        hold = self.ledger.hold(
            replica.id, blocks_for(ctx.reserve_tokens, replica.kv_block_size), ctx.sequences
        )
        if ctx.admission is not None:
            ctx.admission.bind(replica.id, hold)
        try:
            opened = await self.upstream.open(
                replica,
                req.spec.path,  # the client's path: vLLM serves each route under it
                req,
                body,
                ctx.request_id,
                max(wait.seconds, 0.001),
                Attempt.ttft_timeout if wait.kind == "ttft" else Attempt.total_timeout,
                trace,
                commit(strip) if commit is not None and served is None else None,
            )
        except AttemptFailed as f:
            hold.release()
            self._attempt_failed(replica, f.failure)
            if self.pools is not None and ATTEMPT_RULES[f.outcome].replica_fault:
                self.pools.record(replica.pool, False, clock.monotonic())
            if span is not None:
                span.end(f.outcome.value, failed=ATTEMPT_RULES[f.outcome].replica_fault)
            raise
        except BaseException:
            hold.release()
            outcome = Attempt.hedge_lost if leg is not None and leg.lost else Attempt.cancelled
            self.metrics.attempts_of(replica.id, outcome.value).inc()
            if span is not None:
                span.end(outcome.value, failed=False)
            raise
        opened.hold = hold
        opened.strip = strip
        ctx.timeouts = timeouts  # the relay's inter-token gap and deadline: this pool's
        if self.pools is not None:
            self.pools.record(replica.pool, True, clock.monotonic())
        if served is not None:
            aliases.restamp(opened, served, ctx.model)
        self._attempt_ok(ctx, opened)
        if span is not None:
            span.end(
                Attempt.ok.value, failed=False, ttft_s=opened.first_token_at - opened.opened_at
            )
        return opened

    def _attempt_ok(self, ctx: RequestCtx, opened: Opened) -> None:
        replica = opened.replica
        self.metrics.attempts_of(replica.id, Attempt.ok.value).inc()
        replica.observe_ttft(opened.first_token_at - opened.opened_at)

    def _attempt_failed(self, replica: Replica, f: Failure) -> None:
        now = clock.monotonic()
        self.metrics.attempts_of(replica.id, f.outcome.value).inc()
        if f.outcome in (Attempt.ttft_timeout, Attempt.total_timeout):
            self.metrics.timeouts.labels(f.outcome.value.removesuffix("_timeout")).inc()
        if f.outcome is Attempt.connect_error:
            # Out of routing at once: the next requests must not find it either.
            replica.ejected_until = now + self.retry.eject_s
        elif f.outcome is Attempt.http_429:
            replica.backoff_until = now + (f.retry_after_s or 1.0)
        if ATTEMPT_RULES[f.outcome].replica_fault:
            replica.observe_outcome(False)

    def first_token(self, ctx: RequestCtx, opened: Opened) -> None:
        """The request's first token reached us (or its whole body): record its TTFT."""
        ctx.replica = opened.replica.id
        ctx.ttft_s = ttft = opened.first_token_at - ctx.started
        self.metrics.ttft.labels(ctx.model).observe(ttft)
        if self.on_ttft is not None:
            self.on_ttft(ttft)
        if ctx.span is not None:
            ctx.span.first_token(ttft, opened.replica.id, opened.body is None)

    def _exhausted(
        self,
        ctx: RequestCtx,
        last: Failure | None,
        backoff: list[float],
        *,
        tried_any: bool = True,
        budget_exhausted: bool = False,
    ) -> ApiError:
        if last is not None:
            ctx.error = last.message
        if last is None and ctx.pool_refused is not None:
            return unavailable(
                f"Pool `{ctx.pool_refused}` has no replica of `{ctx.model}` that can take "
                "requests now, and this tier may not be sent to another pool.",
                retry_after_s=self.pool_retry_after_s,
                code="pool_unavailable",
            )
        return client_error(
            ctx.model,
            ctx.attempts,
            last,
            backoff,
            tried_any=tried_any,
            budget_exhausted=budget_exhausted,
            eject_s=self.retry.eject_s,
        )

    # -- hedging ------------------------------------------------------------------------

    def _hedge_ok(self, ctx: RequestCtx) -> bool:
        if self.hedge is None or ctx.req is None:
            return False
        # Bytes / 4 is a cheap upper-bound-ish estimate of prompt tokens; hedging only
        # needs to tell short prompts from long ones.
        return self.hedge.allows(len(ctx.req.raw) // 4, self.fleet_load())

    async def _hedged(
        self, ctx: RequestCtx, first: Replica, body: bytes | dict[str, Any], tried: set[str]
    ) -> Opened:
        """Race a delayed second copy against a slow first attempt; the first token wins."""
        assert self.hedge is not None
        legs = _Leg(), _Leg()
        primary = asyncio.ensure_future(self.attempt(ctx, first, body, legs[0]))
        secondary: asyncio.Future[Opened] | None = None
        try:
            done, _ = await asyncio.wait({primary}, timeout=self.hedge.delay_s)
            if not done:
                now = clock.monotonic()
                second = self.choose(ctx, now, tried)
                if second is not None and not self.budget.try_withdraw(now):
                    self.metrics.retry_budget_exhausted.inc()
                elif second is not None:
                    tried.add(second.id)
                    ctx.attempts += 1
                    self.metrics.hedges.labels("launched").inc()
                    secondary = asyncio.ensure_future(self.attempt(ctx, second, body, legs[1]))
            if secondary is None:
                await asyncio.wait({primary})
                return _outcome(primary)
            pending: set[asyncio.Future[Opened]] = {primary, secondary}
            while True:
                ended, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                won = next((t for t in ended if not t.cancelled() and t.exception() is None), None)
                if won is not None:
                    self.metrics.hedges.labels("won" if won is secondary else "lost").inc()
                    for loser in pending:
                        # Counted once, by the attempt itself, as `hedge_lost`.
                        legs[1 if loser is secondary else 0].lost = True
                        loser.cancel()
                    return won.result()
                if not pending:
                    return _outcome(ended.pop())  # both failed: the last one's failure
        finally:
            for task in (primary, secondary):
                if task is not None and not task.done():
                    task.cancel()  # the request was cancelled (client left, drain cut)


def _outcome(attempt: asyncio.Future[Opened]) -> Opened:
    """A finished attempt's answer, or its failure raised as a new exception: raising
    the task's own would put the awaiting frame, which holds the task, into that
    exception's traceback, a cycle (task, exception, frame, task) for the collector."""
    if attempt.cancelled() or attempt.exception() is None:
        return attempt.result()  # CancelledError is raised afresh
    failure = attempt.exception()
    assert failure is not None
    if isinstance(failure, AttemptFailed):
        raise AttemptFailed(failure.failure)
    raise failure  # a bug: its traceback matters more than the collector


class _Leg:
    """One copy of a hedged request; `lost` once the other copy's first token won."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        self.lost = False
