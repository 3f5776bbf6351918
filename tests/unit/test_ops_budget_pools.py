"""The error-budget model over pools, checked against the worked example done by hand.

The example (also in docs/budget.md): region east is the flat example's fleet (4
replicas, 8 streams each, at most 10, 2 crashes and 4 undrained rollouts per replica,
120 s restarts), with 2 replicas per node, one node loss a window (600 s) and a quarter
of a region loss a window (3600 s). Region west is active with 2 replicas of 4 streams
(at most 10) and 2 crashes per replica. 90% of requests are 10 s chats that may go to
another pool, 10% are 100 s agent runs that stay in theirs. SLO 99.99% over 30 days.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.ops.budget import (
    BudgetInputs,
    FleetInputs,
    FleetResult,
    Loss,
    LossResult,
    Pool,
    Workload,
    compute,
    compute_fleet,
    fleet_what_ifs,
)
from tests.support.procs import REPO, seawall_argv

CHAT = Workload("chat", 0.9, 10)
AGENT = Workload("agent", 0.1, 100, overflow=False, failover=False)
EAST = Pool(
    "east",
    replicas=4,
    streams_per_replica=8,
    crashes_per_replica=2,
    restart_s=120,
    max_streams_per_replica=10,
    rollouts_per_replica=4,
    replicas_per_node=2,
    node_losses=1,
    node_recovery_s=600,
    pool_losses=0.25,
    pool_recovery_s=3600,
    detect_s=2,
)
WEST = Pool(
    "west",
    replicas=2,
    streams_per_replica=4,
    crashes_per_replica=2,
    restart_s=120,
    max_streams_per_replica=10,
    priority=1,
)
EXAMPLE = FleetInputs((EAST, WEST), slo=0.9999, window_days=30, workloads=(CHAT, AGENT))
WINDOW_S = 30 * 86_400

# By hand. East holds 32 streams, west 8; the mean stream is 0.9*10 + 0.1*100 = 19 s.
EAST_RPS = 32 / 19
# A region loss: east's chat (9/19 of its 32 streams) wants 288/19 streams; west has
# 2*(10-4) = 12 spare, so 12*19/288 = 19/24 of chat is placed. Chat fails for the 2 s
# before the gateway notices and 5/24 of the rest; agent runs fail for the whole hour.
POOL_CHAT_EACH = EAST_RPS * 0.9 * (2 + 3598 * 5 / 24)
POOL_AGENT_EACH = EAST_RPS * 0.1 * 3600
# A replica down: 3 survivors hold 30 of 32 streams, so 1/16 of arrivals find no room.
# Chat's share overflows to west (9/19*2 < 12); the agent runs' share is refused.
REPLICA_AGENT_EACH = EAST_RPS * 0.1 * (1 / 16) * 120  # = 24/19
# A node down (2 replicas): 2 survivors hold 20 of 32, so 3/8 find no room.
NODE_AGENT_EACH = EAST_RPS * 0.1 * (3 / 8) * 600  # = 720/19
CUT = 4 * 2 * 8 + 4 * 4 * 8 + 2 * 8 + 0.25 * 32 + 2 * 2 * 4  # 64+128+16+8+16 = 232
REFUSED = 8 * REPLICA_AGENT_EACH + 16 * REPLICA_AGENT_EACH + NODE_AGENT_EACH
REFUSED += 0.25 * (POOL_CHAT_EACH + POOL_AGENT_EACH)


def loss(r: FleetResult, pool: str, kind: Loss) -> LossResult:
    return next(x for x in r.losses if x.pool == pool and x.kind is kind)


def test_two_regions_by_hand() -> None:
    r = compute_fleet(EXAMPLE)
    assert r.mean_stream_s == pytest.approx(19)
    assert r.requests_per_s == pytest.approx(40 / 19)
    assert r.requests == pytest.approx(40 / 19 * WINDOW_S)  # 5,456,842
    assert r.error_budget == pytest.approx(1e-4 * 40 / 19 * WINDOW_S)  # 545.7
    assert r.crash_failures == pytest.approx(64 + 16)
    assert r.rollout_failures == pytest.approx(128)
    assert r.node_failures == pytest.approx(16)
    assert r.pool_failures == pytest.approx(8)
    assert r.overload_failures == pytest.approx(REFUSED)  # 504.6
    assert r.failures == pytest.approx(CUT + REFUSED)  # 736.6
    assert r.verdict.startswith("over budget (135.0%")
    # Down: 8*120 + 16*120 + 2*600 + 0.25*4*3600 in east, 4*120 in west = 8160 s.
    assert r.replica_minutes_lost == pytest.approx(8160 / 60)
    assert r.capacity_lost_pct == pytest.approx(100 * 8160 / (6 * WINDOW_S))


def test_each_loss_by_hand() -> None:
    r = compute_fleet(EXAMPLE)
    crash = loss(r, "east", Loss.crash)
    assert (crash.spare_here, crash.spare_elsewhere) == (6, 12)
    assert crash.refused == pytest.approx(8 * REPLICA_AGENT_EACH)
    # Of the requests the lost replica would have served (a quarter of east's), only
    # the agent runs' tenth of the sixteenth with no room is lost: 1 - 0.1/16*4.
    assert crash.absorbed == pytest.approx(1 - 0.1 / 16 * 4)
    node = loss(r, "east", Loss.node)
    assert (node.replicas_out, node.spare_here) == (2, 4)
    assert node.refused == pytest.approx(NODE_AGENT_EACH)
    region = loss(r, "east", Loss.pool)
    assert (region.replicas_out, region.spare_here) == (4, 0)
    assert region.cut == pytest.approx(8)
    assert region.refused == pytest.approx(0.25 * (POOL_CHAT_EACH + POOL_AGENT_EACH))
    # West's survivor holds 10 >= 8 streams: its crashes only cut the 4 in flight.
    west = loss(r, "west", Loss.crash)
    assert west.refused == 0 and west.cut == pytest.approx(16)


def test_availability_per_workload_by_hand() -> None:
    chat, agent = compute_fleet(EXAMPLE).workloads
    # Agent runs are 10/19 of the streams in flight: that share of every cut stream,
    # plus every refusal of theirs.
    agent_refused = 24 * REPLICA_AGENT_EACH + NODE_AGENT_EACH + 0.25 * POOL_AGENT_EACH
    assert agent.failures == pytest.approx(CUT * 10 / 19 + agent_refused)  # 341.9
    assert chat.failures == pytest.approx(CUT * 9 / 19 + 0.25 * POOL_CHAT_EACH)  # 394.7
    assert agent.availability == pytest.approx(1 - agent.failures / (0.1 * 40 / 19 * WINDOW_S))
    assert chat.meets_slo and not agent.meets_slo  # 99.99196% and 99.93735%


def test_what_ifs_by_hand() -> None:
    base = compute_fleet(EXAMPLE).failures
    alternatives = dict(fleet_what_ifs(EXAMPLE))
    assert list(alternatives) == [
        "halve the crash rate",
        "drain rollouts",
        "add a spare replica per pool",
        "add a standby region",
    ]
    # A standby the size of east (4 x 10 spare streams) takes all of east's chat when
    # east is lost: only the 2 s before the gateway notices are left of chat's refusals.
    standby = alternatives["add a standby region"]
    pool_chat_left = 0.25 * EAST_RPS * 0.9 * 2
    assert standby.failures == pytest.approx(base - 0.25 * POOL_CHAT_EACH + pool_chat_left)
    assert standby.inputs.pools[-1].passive
    assert standby.inputs.pools[-1].replicas == 4
    # One more replica per pool: east 5 x 6.4, west 3 x 8/3. A crash leaves 40 >= 32
    # streams of room; a node leaves 30, so 1/16 of 600 s of arrivals find none (agent
    # runs refused, chat to west); west now has 3*(10-8/3) = 22 spare, enough for all of
    # east's chat on a region loss.
    spare = alternatives["add a spare replica per pool"]
    cut = 64 + 128 + 2 * 6.4 + 8 + 16
    refused = EAST_RPS * 0.1 * (1 / 16) * 600 + 0.25 * (EAST_RPS * 0.9 * 2 + POOL_AGENT_EACH)
    assert spare.failures == pytest.approx(cut + refused)  # 387.5
    assert spare.within_budget and standby.within_budget
    assert not alternatives["drain rollouts"].within_budget


def test_a_standby_absorbs_a_region_loss_except_streams_in_flight_and_detection() -> None:
    one = Pool("east", 4, 8, 0, 120, max_streams_per_replica=10, pool_losses=1)
    one = replace(one, pool_recovery_s=600, detect_s=5)
    chat = (Workload("chat", 1, 10),)
    alone = compute_fleet(FleetInputs((one,), 0.999, 30, chat))
    # Alone, everything that arrives during the loss fails, plus the 32 streams cut.
    assert alone.failures == pytest.approx(32 + 3.2 * 600)
    standby = dict(fleet_what_ifs(FleetInputs((one,), 0.999, 30, chat)))["add a standby region"]
    assert standby.failures == pytest.approx(32 + 3.2 * 5)
    # A workload that may not fail over gets its 503s whatever the standby.
    pinned = (Workload("chat", 1, 10, failover=False),)
    assert compute_fleet(
        FleetInputs((one, replace(one, name="west", streams_per_replica=0)), 0.999, 30, pinned)
    ).failures == pytest.approx(alone.failures)


def test_a_node_holding_the_whole_pool_is_a_pool_loss() -> None:
    small = Pool("p", 2, 4, 0, 60, max_streams_per_replica=8, replicas_per_node=4)
    small = replace(small, node_losses=1, node_recovery_s=100, detect_s=0)
    r = compute_fleet(FleetInputs((small,), 0.999, 1, (Workload("w", 1, 4),)))
    node = loss(r, "p", Loss.node)
    assert node.replicas_out == 2 and node.spare_here == 0
    assert node.refused == pytest.approx(2.0 * 100)


def test_overflow_goes_to_the_other_pools_only_for_workloads_that_may() -> None:
    tight = Pool("a", 2, 8, 1, 100, max_streams_per_replica=8)  # a crash leaves no room
    roomy = Pool("b", 2, 0, 0, 100, max_streams_per_replica=8)  # active, idle
    standby = replace(roomy, passive=True)
    no_room = 4 * 0.5 * 100 * 2  # 16 streams of 4 s: 4 requests/s, half refused, twice
    for other, overflow, refused in (
        (roomy, True, 0.0),
        (roomy, False, no_room),
        # A passive pool takes traffic by failover only: a saturated pool is healthy.
        (standby, True, no_room),
    ):
        w = (Workload("w", 1, 4, overflow=overflow),)
        r = compute_fleet(FleetInputs((tight, other), 0.999, 1, w))
        assert loss(r, "a", Loss.crash).refused == pytest.approx(refused)


def test_impossible_pools_are_refused() -> None:
    for bad in (
        (EAST, replace(WEST, name="east")),
        (replace(EAST, node_recovery_s=0),),
        (replace(EAST, streams_per_replica=11),),
        (replace(EAST, replicas_per_node=0),),
        (replace(EAST, streams_per_replica=0), replace(WEST, streams_per_replica=0)),
    ):
        with pytest.raises(ValueError):
            compute_fleet(replace(EXAMPLE, pools=bad))


# --- the flat model is a one-pool fleet ---------------------------------------------

_flat = st.builds(
    BudgetInputs,
    replicas=st.integers(2, 64),
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
).filter(
    lambda i: (
        i.max_streams_per_replica is None or i.max_streams_per_replica >= i.streams_per_replica
    )
)


def as_pool(i: BudgetInputs) -> FleetInputs:
    pool = Pool(
        "all",
        i.replicas,
        i.streams_per_replica,
        i.crashes_per_replica,
        i.restart_s,
        max_streams_per_replica=i.max_streams_per_replica,
        rollouts_per_replica=i.rollouts_per_replica,
        rollouts_drained=i.rollouts_drained,
    )
    return FleetInputs((pool,), i.slo, i.window_days, i.workloads)


@given(_flat)
def test_one_pool_without_node_or_pool_losses_is_the_flat_model(i: BudgetInputs) -> None:
    flat, pooled = compute(i), compute_fleet(as_pool(i))
    for name in (
        "requests",
        "error_budget",
        "crash_failures",
        "rollout_failures",
        "overload_failures",
        "failures",
        "replica_minutes_lost",
        "capacity_lost_pct",
    ):
        assert getattr(pooled, name) == pytest.approx(getattr(flat, name), rel=1e-9, abs=1e-9)
    for a, b in zip(flat.workloads, pooled.workloads, strict=True):
        assert b.failures == pytest.approx(a.failures, rel=1e-9, abs=1e-9)


_pool = st.builds(
    Pool,
    name=st.just("p"),
    replicas=st.integers(1, 16),
    streams_per_replica=st.floats(0, 64),
    crashes_per_replica=st.floats(0, 10),
    restart_s=st.floats(1, 600),
    max_streams_per_replica=st.one_of(st.none(), st.floats(64, 128)),
    passive=st.booleans(),
    rollouts_per_replica=st.floats(0, 10),
    rollouts_drained=st.booleans(),
    replicas_per_node=st.integers(1, 8),
    node_losses=st.floats(0, 4),
    node_recovery_s=st.floats(1, 3600),
    pool_losses=st.floats(0, 2),
    pool_recovery_s=st.floats(1, 7200),
    detect_s=st.floats(0, 30),
)
# Workloads that leave for both reasons or for neither: see the spare-replica property.
_same_leaves = st.builds(
    lambda share, stream_s, leave: Workload("w", share, stream_s, leave, leave),
    st.floats(0.01, 1),
    st.floats(0.1, 600),
    st.booleans(),
)
_fleets = st.builds(
    FleetInputs,
    pools=st.lists(_pool, min_size=1, max_size=4).map(
        lambda ps: tuple(replace(p, name=f"p{k}") for k, p in enumerate(ps))
    ),
    slo=st.floats(0.9, 0.99999),
    window_days=st.floats(1, 90),
    workloads=st.lists(_same_leaves, min_size=1, max_size=3).map(tuple),
).filter(lambda f: sum(p.replicas * p.streams_per_replica for p in f.pools) > 0.01)


@given(_fleets)
def test_failures_add_up_across_workloads_and_losses(f: FleetInputs) -> None:
    r = compute_fleet(f)
    assert sum(w.failures for w in r.workloads) == pytest.approx(r.failures, rel=1e-9, abs=1e-9)
    assert all(0 <= x.absorbed <= 1 for x in r.losses)


@given(_fleets, st.floats(0.1, 5))
def test_more_pool_losses_never_cost_less(f: FleetInputs, extra: float) -> None:
    p = f.pools[0]
    worse = replace(f, pools=(replace(p, pool_losses=p.pool_losses + extra), *f.pools[1:]))
    assert compute_fleet(worse).failures >= compute_fleet(f).failures - 1e-9


@given(_fleets)
def test_a_standby_or_a_spare_never_costs_more(f: FleetInputs) -> None:
    # More room never refuses more. (A spare replica can keep one replica of a pool
    # routable where none was, and then a workload that may fail over but not
    # overflow is shed instead of failed over: hence workloads that leave for both
    # reasons or neither. Likewise a passive pool is entered only when a whole pool is
    # lost: a spare can keep a pool that lost a node serving on its own survivors, which
    # shed the overflow the standby would have taken had the whole pool gone. Hence the
    # spare's property only for fleets without a passive pool.)
    base = compute_fleet(f).failures
    passive = any(p.passive for p in f.pools)
    for name, r in fleet_what_ifs(f):
        if name == "add a standby region" or (
            name == "add a spare replica per pool" and not passive
        ):
            assert r.failures <= base + 1e-6 * max(1.0, base), name


# --- the command --------------------------------------------------------------------

DOC = REPO / "docs" / "budget.md"


def _doc_fleet_example() -> tuple[str, list[str]]:
    """The YAML file and the command of the pooled worked example in docs/budget.md."""
    text = DOC.read_text()
    yaml_text = re.search(r"```yaml\n(# two-regions\.yaml\n.*?)```", text, re.S)
    command = re.search(r"\$ (seawall budget --fleet two-regions\.yaml.*?)\n[A-Z]", text, re.S)
    assert yaml_text and command, "docs/budget.md: the two-regions example is missing"
    argv = command.group(1).replace("\\\n", " ").split()
    return yaml_text.group(1), argv[2:]


def test_the_pooled_worked_example_in_the_docs_is_what_the_command_prints(
    tmp_path: Path,
) -> None:
    yaml_text, args = _doc_fleet_example()
    (tmp_path / "two-regions.yaml").write_text(yaml_text)
    out = subprocess.run(
        seawall_argv("budget", *args),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert out in DOC.read_text(), "docs/budget.md: paste the new output of the pool example"
    assert "over budget (135.0%" in out


def test_the_docs_file_and_flags_give_the_example_fleet(tmp_path: Path) -> None:
    yaml_text, args = _doc_fleet_example()
    (tmp_path / "two-regions.yaml").write_text(yaml_text)
    doc = json.loads(
        subprocess.run(
            seawall_argv("budget", *args, "--json"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            cwd=tmp_path,
        ).stdout
    )
    assert doc["failures"] == pytest.approx(compute_fleet(EXAMPLE).failures)
    assert [w["scenario"] for w in doc["what_ifs"]] == [n for n, _ in fleet_what_ifs(EXAMPLE)]
    region = next(x for x in doc["losses"] if x["pool"] == "east" and x["kind"] == "pool")
    assert region["spare_elsewhere"] == pytest.approx(12)


def test_workload_flags_say_where_requests_may_go(tmp_path: Path) -> None:
    fleet = tmp_path / "f.yaml"
    fleet.write_text(
        "pools:\n"
        "  - {name: a, replicas: 2, streams_per_replica: 4, pool_losses: 1,"
        " pool_recovery_s: 100, detect_s: 0}\n"
        "  - {name: b, replicas: 2, streams_per_replica: 0, mode: passive}\n"
    )

    def failures(workload: str) -> float:
        out = subprocess.run(
            seawall_argv(
                "budget", "--fleet", str(fleet), "--crashes", "0", "--workload", workload, "--json"
            ),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return float(json.loads(out)["failures"])

    # 8 streams of 4 s: 2 requests/s. Lost for 100 s: 8 streams cut, and 200 requests
    # refused unless they may fail over to b (no stream limit: it takes them all).
    assert failures("w:1:4") == pytest.approx(8)
    assert failures("w:1:4:overflow") == pytest.approx(8 + 200)
    assert failures("w:1:4:failover") == pytest.approx(8)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("pools:\n  - {name: a, replicas: 2, colour: red}\n", "colour"),
        ("pools:\n  - {name: a}\n  - {name: a}\n", "unique"),
        ("pools:\n  - {name: a, mode: standby}\n", "mode"),
        ("pools: [\n", "f.yaml"),
    ],
)
def test_a_bad_fleet_file_is_refused_with_the_reason(
    tmp_path: Path, text: str, complaint: str
) -> None:
    fleet = tmp_path / "f.yaml"
    fleet.write_text(text)
    done = subprocess.run(
        seawall_argv("budget", "--fleet", str(fleet)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert complaint in done.stderr
