"""The dispatcher's rules (retry, budget, hedge, error mapping, in-flight claims) against a
scripted upstream: layer tests that need no process and run in milliseconds.

The `ScriptedUpstream` stands in for replicas here, through the `Upstream` seam the
production pool implements; the same rules are exercised against real `seawall sim`
processes in tests/integration/test_gateway*.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import orjson
import pytest

from seawall import clock
from seawall.config import RetryConfig, Timeouts
from seawall.errors import ApiError
from seawall.gateway.context import RequestCtx
from seawall.gateway.dispatch import Dispatcher
from seawall.gateway.inflight import InFlight
from seawall.gateway.outcomes import Attempt, Failure
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.gateway.upstream import AttemptFailed, Opened
from seawall.metrics import Metrics
from seawall.policy.hedge import HedgePolicy
from seawall.policy.retry_budget import RetryBudget
from seawall.protocol.openai import ParsedRequest, parse
from seawall.protocol.sse import SSEBuffer

Script = Callable[[], Awaitable[Opened]]


class _Conn:
    """The part of an upstream stream the dispatcher touches (it only releases)."""

    headers: dict[str, str] = {}
    complete = True
    stopped = paused = False
    released = 0

    def release(self) -> None:
        self.released += 1

    def close(self) -> None:
        self.released += 1


class ScriptedUpstream:
    """Per replica, a queue of behaviours: an `Attempt` outcome to fail with, "ok", or
    an `asyncio.Event` to wait on before answering ok. With `by_call`, behaviours are
    taken in call order instead, whichever replica the dispatcher chose."""

    def __init__(self, scripts: dict[str, list[object]], by_call: list[object] | None = None):
        self.scripts = scripts
        self.by_call = by_call
        self.calls: list[str] = []

    async def open(
        self,
        replica: Replica,
        path: str,
        req: ParsedRequest,
        body: bytes,
        request_id: str,
        timeout_s: float,
        timeout_outcome: Attempt,
        trace: Mapping[str, str] | None = None,
        commit: object = None,  # the relay's; these scripted streams never reach a client
    ) -> Opened:
        self.calls.append(replica.id)
        step = self.by_call.pop(0) if self.by_call is not None else self.scripts[replica.id].pop(0)
        if isinstance(step, asyncio.Event):
            await step.wait()
            step = "ok"
        if isinstance(step, Attempt):
            status = {Attempt.http_5xx: 500, Attempt.http_4xx: 400, Attempt.http_429: 429}
            raise AttemptFailed(
                Failure(
                    step,
                    f"scripted {step.value}",
                    status=status.get(step),
                    body=b'{"error": {"message": "engine says no"}}',
                    retry_after_s=3.0 if step is Attempt.http_429 else None,
                )
            )
        now = clock.monotonic()
        return Opened(replica, _Conn(), [], SSEBuffer(), b"{}", now, now)  # type: ignore[arg-type]

    def close(self) -> None:
        pass


def setup(
    scripts: dict[str, list[object]],
    *,
    budget: RetryBudget | None = None,
    hedge: HedgePolicy | None = None,
    max_attempts: int = 3,
    by_call: list[object] | None = None,
) -> tuple[Dispatcher, ScriptedUpstream, InFlight, Metrics]:
    ledger = InFlight()
    replicas = ReplicaSet(ledger)
    for rid in scripts:
        replicas.add(Replica(rid, f"http://127.0.0.1:1/{rid}", "m", rid))
    upstream = ScriptedUpstream(scripts, by_call)
    metrics = Metrics(process=False)
    d = Dispatcher(
        replicas=replicas,
        ledger=ledger,
        upstream=upstream,
        budget=budget or RetryBudget(ratio=0.1, min_per_s=0.0, now=clock.monotonic()),
        retry=RetryConfig(max_attempts=max_attempts),
        metrics=metrics,
        hedge=hedge,
        fleet_load=lambda: 0.0,
    )
    return d, upstream, ledger, metrics


def ctx(stream: bool = False) -> RequestCtx:
    c = RequestCtx("req-1", "completions", clock.monotonic(), Timeouts())
    c.req = parse("completions", orjson.dumps({"model": "m", "prompt": "hi", "stream": stream}))
    return c


def attempts(metrics: Metrics, outcome: Attempt) -> float:
    total = 0.0
    for fam in metrics.upstream_attempts.collect():
        for s in fam.samples:
            if s.name.endswith("_total") and s.labels["outcome"] == outcome.value:
                total += s.value
    return total


async def test_a_refused_connection_is_retried_without_spending_the_budget() -> None:
    empty = RetryBudget(ratio=0.1, min_per_s=0.0, now=clock.monotonic())
    # The first two attempts are refused, wherever they go; the third answers.
    refused = [Attempt.connect_error, Attempt.connect_error, "ok"]
    d, up, ledger, m = setup({"a": [], "b": [], "c": []}, budget=empty, by_call=refused)
    opened = await d.open(ctx(), b"{}")
    assert len(up.calls) == len(set(up.calls)) == 3 and opened.replica.id == up.calls[2]
    assert attempts(m, Attempt.connect_error) == 2
    # The refused replicas left routing at once, before any monitor probe.
    now = clock.monotonic()
    for rid in up.calls[:2]:
        assert d.replicas.get(rid).ejected_until > now  # type: ignore[union-attr]
    opened.close()
    assert all(ledger.counts(r).requests == 0 for r in "abc")


async def test_a_real_retry_spends_the_budget_and_an_empty_budget_says_so() -> None:
    empty = RetryBudget(ratio=0.1, min_per_s=0.0, now=clock.monotonic())
    d, up, _, _ = setup({"a": [Attempt.http_5xx], "b": [Attempt.http_5xx]}, budget=empty)
    with pytest.raises(ApiError) as e:
        await d.open(ctx(), b"{}")
    assert len(up.calls) == 1  # the other replica was there, but the budget was not
    assert e.value.code == "retry_budget_exhausted" and "retry budget" in e.value.message
    assert e.value.status == 500  # the failure's own kind, not a blame on connections


async def test_the_request_at_fault_is_not_retried_and_the_engine_error_is_relayed() -> None:
    d, up, _, _ = setup({"a": [Attempt.http_4xx], "b": ["ok"]})
    d.replicas.get("b").ejected_until = clock.monotonic() + 60  # type: ignore[union-attr]
    with pytest.raises(ApiError) as e:
        await d.open(ctx(), b"{}")
    assert up.calls == ["a"] and e.value.status == 400
    assert e.value.json_bytes() == b'{"error": {"message": "engine says no"}}'
    assert d.replicas.get("a").error_ewma == 0.0  # type: ignore[union-attr]


async def test_attempts_stop_at_max_attempts_with_the_last_failure() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=clock.monotonic())
    d, up, _, _ = setup({k: [Attempt.ttft_timeout] for k in "abcd"}, budget=budget, max_attempts=3)
    with pytest.raises(ApiError) as e:
        await d.open(ctx(), b"{}")
    assert len(up.calls) == 3 and e.value.status == 504
    assert "after 3 attempt(s)" in e.value.message


async def test_every_replica_backing_off_is_a_429_with_the_shortest_retry_after() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=clock.monotonic())
    d, _, _, _ = setup({"a": [Attempt.http_429], "b": [Attempt.http_429]}, budget=budget)
    with pytest.raises(ApiError) as e:
        await d.open(ctx(), b"{}")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "3"


async def test_a_losing_hedge_is_counted_once_and_its_claim_released() -> None:
    never = asyncio.Event()
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=clock.monotonic())
    d, up, ledger, m = setup(
        {"a": [never], "b": [never]},
        budget=budget,
        hedge=HedgePolicy(delay_s=0.001, max_prompt_tokens=512, max_fleet_load=0.5),
    )
    # Whichever replica is chosen first waits forever; the other answers at once.
    first = asyncio.ensure_future(d.open(ctx(stream=True), b"{}"))
    while len(up.calls) < 1:
        await asyncio.sleep(0)
    loser = up.calls[0]
    winner = "b" if loser == "a" else "a"
    up.scripts[winner] = ["ok"]
    opened = await first
    assert opened.replica.id == winner
    await asyncio.sleep(0)  # the loser's cancellation runs
    assert attempts(m, Attempt.hedge_lost) == 1 and attempts(m, Attempt.cancelled) == 0
    assert ledger.counts(loser).requests == 0
    opened.close()
    assert ledger.counts(winner).requests == 0
