"""The error-budget arithmetic, checked against a worked example done by hand.

The example (also in docs/budget.md): 4 replicas, 8 streams each, SLO 99.99% over 30
days, 2 crashes and 4 undrained rollouts per replica, 120 s restarts, a replica holds
at most 10 streams; 90% of requests are 10 s chats, 10% are 100 s agent runs.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.ops.budget import BudgetInputs, Workload, compute, what_ifs
from tests.support.procs import seawall_argv

EXAMPLE = BudgetInputs(
    replicas=4,
    streams_per_replica=8,
    slo=0.9999,
    window_days=30,
    crashes_per_replica=2,
    restart_s=120,
    workloads=(Workload("chat", 0.9, 10), Workload("agent", 0.1, 100)),
    rollouts_per_replica=4,
    rollouts_drained=False,
    max_streams_per_replica=10,
)


def test_worked_example_by_hand() -> None:
    r = compute(EXAMPLE)
    # mean stream = 0.9*10 + 0.1*100 = 19 s; 32 streams in flight -> 32/19 requests/s
    assert r.mean_stream_s == pytest.approx(19.0)
    assert r.requests_per_s == pytest.approx(32 / 19)
    # 30 days = 2,592,000 s
    assert r.requests == pytest.approx(32 / 19 * 2_592_000)  # 4,365,473.7
    assert r.error_budget == pytest.approx(0.0001 * 32 / 19 * 2_592_000)  # 436.5
    assert r.crash_failures == pytest.approx(4 * 2 * 8)  # 64
    assert r.rollout_failures == pytest.approx(4 * 4 * 8)  # 128
    # Down 4*(2+4)*120 = 2880 s; 3 survivors hold 30 < 32 streams: 1/16 refused.
    assert r.replica_minutes_lost == pytest.approx(48.0)
    assert r.capacity_lost_pct == pytest.approx(100 * 2880 / (4 * 2_592_000))
    assert r.overload_failures == pytest.approx(32 / 19 * 2880 / 16)  # 303.2
    assert r.failures == pytest.approx(64 + 128 + 32 / 19 * 180)  # 495.2
    assert not r.within_budget
    assert r.verdict.startswith("over budget (113.4%")


def test_long_streams_lose_more_than_their_share_of_requests() -> None:
    chat, agent = compute(EXAMPLE).workloads
    # Agents are 10% of requests but 0.1*100/19 = 52.6% of the streams in flight.
    assert agent.inflight_share == pytest.approx(10 / 19)
    assert agent.failures == pytest.approx(192 * 10 / 19 + (32 / 19 * 180) * 0.1)
    assert chat.meets_slo and not agent.meets_slo


def test_what_ifs_by_hand() -> None:
    alternatives = dict(what_ifs(EXAMPLE))
    halved = alternatives["halve the crash rate"]
    assert halved.crash_failures == pytest.approx(32)
    assert halved.overload_failures == pytest.approx(32 / 19 * (480 + 1920) / 16)
    drained = alternatives["drain rollouts"]
    assert drained.rollout_failures == 0
    # A drained rollout waits one mean stream (19 s) before its 120 s restart.
    assert drained.replica_minutes_lost == pytest.approx((960 + 16 * 139) / 60)
    spare = alternatives["add a spare replica"]
    # Same traffic over 5 replicas: crash losses do not change (5*2*6.4 = 64), but 4
    # survivors hold 40 >= 32 streams, so nothing is refused while one restarts.
    assert spare.crash_failures == pytest.approx(64)
    assert spare.overload_failures == 0
    assert all(r.within_budget for r in alternatives.values())


def test_a_single_replica_refuses_everything_while_it_restarts() -> None:
    one = BudgetInputs(1, 4, 0.999, 1, 1, 60, (Workload("all", 1, 4),), max_streams_per_replica=8)
    r = compute(one)
    assert r.overload_failures == pytest.approx(1.0 * 60)  # 1 request/s for 60 s


def test_shares_are_normalised() -> None:
    a = compute(EXAMPLE)
    b = compute(
        BudgetInputs(
            **{
                **_fields(EXAMPLE),
                "workloads": (Workload("chat", 9, 10), Workload("agent", 1, 100)),
            }
        )
    )
    assert b.failures == pytest.approx(a.failures)


@pytest.mark.parametrize(
    "change",
    [
        {"replicas": 0},
        {"slo": 1.0},
        {"workloads": ()},
        {"window_days": 0},
        {"restart_s": -1},
        {"max_streams_per_replica": 7},  # below the 8 streams each replica holds
    ],
)
def test_impossible_inputs_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        compute(BudgetInputs(**{**_fields(EXAMPLE), **change}))  # type: ignore[arg-type]


def test_cli_json_carries_the_verdict_and_what_ifs() -> None:
    out = subprocess.run(
        seawall_argv(
            "budget",
            "--json",
            "--replicas",
            "4",
            "--streams-per-replica",
            "8",
            "--slo",
            "0.9999",
            "--crashes",
            "2",
            "--rollouts",
            "4",
            "--workload",
            "chat:0.9:10",
            "--workload",
            "agent:0.1:100",
            "--max-streams-per-replica",
            "10",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    doc = json.loads(out)
    assert doc["within_budget"] is False
    assert doc["failures"] == pytest.approx(compute(EXAMPLE).failures)
    assert [w["scenario"] for w in doc["what_ifs"]] == [
        "halve the crash rate",
        "drain rollouts",
        "add a spare replica",
    ]


def test_cli_table_names_the_verdict() -> None:
    out = subprocess.run(
        seawall_argv("budget", "--crashes", "50", "--slo", "0.9999"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "verdict" in out and "over budget" in out
    assert "add a spare replica" in out


def _fields(i: BudgetInputs) -> dict[str, object]:
    return {name: getattr(i, name) for name in i.__dataclass_fields__}


def test_the_worked_example_in_the_docs_is_what_the_command_prints() -> None:
    from tests.support.procs import REPO

    doc = (REPO / "docs" / "budget.md").read_text()
    out = subprocess.run(
        seawall_argv(
            "budget",
            "--replicas",
            "4",
            "--streams-per-replica",
            "8",
            "--slo",
            "0.9999",
            "--crashes",
            "2",
            "--restart-s",
            "120",
            "--workload",
            "chat:0.9:10",
            "--workload",
            "agent:0.1:100",
            "--rollouts",
            "4",
            "--max-streams-per-replica",
            "10",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out in doc, "docs/budget.md: paste the new output of the worked example"


_inputs = st.builds(
    BudgetInputs,
    replicas=st.integers(1, 64),
    streams_per_replica=st.floats(0.5, 256),
    slo=st.floats(0.9, 0.99999),
    window_days=st.floats(1, 90),
    crashes_per_replica=st.floats(0, 50),
    restart_s=st.floats(1, 3600),
    workloads=st.lists(
        st.builds(Workload, st.just("w"), st.floats(0.01, 1), st.floats(0.1, 3600)),
        min_size=1,
        max_size=4,
    ).map(tuple),
    rollouts_per_replica=st.floats(0, 20),
    rollouts_drained=st.booleans(),
    max_streams_per_replica=st.one_of(st.none(), st.floats(1, 512)),
).filter(  # a fleet over its limit with every replica up is refused (tested above)
    lambda i: (
        i.max_streams_per_replica is None or i.max_streams_per_replica >= i.streams_per_replica
    )
)


@given(_inputs)
def test_workload_failures_add_up_to_the_total(i: BudgetInputs) -> None:
    r = compute(i)
    assert sum(w.failures for w in r.workloads) == pytest.approx(r.failures, rel=1e-9, abs=1e-9)
    assert sum(w.requests for w in r.workloads) == pytest.approx(r.requests, rel=1e-9)


@given(_inputs, st.floats(0.1, 10))
def test_more_crashes_never_cost_less(i: BudgetInputs, extra: float) -> None:
    worse = compute(replace(i, crashes_per_replica=i.crashes_per_replica + extra))
    assert worse.failures >= compute(i).failures


@given(_inputs)
def test_draining_never_kills_streams_and_a_spare_never_adds_refusals(i: BudgetInputs) -> None:
    alternatives = dict(what_ifs(i))
    assert alternatives["drain rollouts"].rollout_failures == 0
    spare = alternatives["add a spare replica"]
    assert spare.overload_failures <= compute(i).overload_failures + 1e-9
    assert spare.crash_failures == pytest.approx(compute(i).crash_failures)
