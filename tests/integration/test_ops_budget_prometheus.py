"""`seawall budget --from-prometheus` against a real Prometheus server on loopback.

The server loads a TSDB built with `promtool tsdb create-blocks-from openmetrics` from
series whose rates are known exactly (linear counters, constant gauges), so the
measured inputs can be checked to the digit.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from seawall import metrics as m
from tests.support.procs import free_port, require_binary, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

STEP_S = 15
HISTORY_S = 2 * 3600


def _openmetrics(end_s: int) -> str:
    times = range(end_s - HISTORY_S, end_s + 1, STEP_S)
    start = end_s - HISTORY_S
    lines = [f"# TYPE {m.INFLIGHT} gauge"]
    for replica in ("r1", "r2", "r3"):
        lines += [f'{m.INFLIGHT}{{replica="{replica}"}} 6 {t}' for t in times]
    restarts = m.RESTARTS[: -len("_total")]
    lines.append(f"# TYPE {restarts} counter")
    # 6 crashes and 3 rollouts an hour across the fleet.
    for reason, per_h in (("crash", 6), ("rollout", 3)):
        lines += [
            f'{m.RESTARTS}{{node="n1",reason="{reason}"}} {per_h * (t - start) / 3600} {t}'
            for t in times
        ]
    lines.append(f"# TYPE {m.E2E} histogram")
    # chat: 1 request/s of 10 s; agent: 0.1 request/s of 100 s.
    for model, per_s, stream_s in (("chat", 1.0, 10.0), ("agent", 0.1, 100.0)):
        for t in times:
            n = per_s * (t - start)
            lines.append(f'{m.E2E}_bucket{{le="+Inf",model="{model}"}} {n} {t}')
            lines.append(f'{m.E2E}_count{{model="{model}"}} {n} {t}')
            lines.append(f'{m.E2E}_sum{{model="{model}"}} {n * stream_s} {t}')
    # OpenMetrics wants each series' samples together and families contiguous.
    return "\n".join(_grouped(lines)) + "\n# EOF\n"


def _grouped(lines: list[str]) -> list[str]:
    out: list[str] = []
    series: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("#"):
            out += [s for group in series.values() for s in group]
            series = {}
            out.append(line)
        else:
            series.setdefault(line.rsplit(" ", 2)[0], []).append(line)
    out += [s for group in series.values() for s in group]
    return out


def _budget_against(
    tmp_path: Path, artifacts: Path, series: str, *budget_args: str
) -> subprocess.CompletedProcess[str]:
    """Load `series` (OpenMetrics) into a fresh TSDB, serve it with a real Prometheus on
    loopback, and run `seawall budget --json --from-prometheus` against it."""
    promtool = require_binary("promtool")
    prometheus = require_binary("prometheus")
    source = tmp_path / "series.om"
    source.write_text(series)
    data = tmp_path / "data"
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1m\n")
    port = free_port()
    proc = spawn(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        artifacts / "prometheus.log",
        port=port,
    )
    try:
        wait_http(f"{proc.url}/-/ready", timeout=60, proc=proc)
        return subprocess.run(
            seawall_argv("budget", "--json", "--from-prometheus", proc.url, *budget_args),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        proc.stop()


def _end_s() -> int:
    return int(time.time()) // 60 * 60 - 600  # whole minutes, safely in the past


def test_budget_reads_measured_inputs_from_prometheus(tmp_path: Path, artifacts: Path) -> None:
    end_s = _end_s()
    result = _budget_against(
        tmp_path,
        artifacts,
        _openmetrics(end_s),
        "--prom-range",
        "1h",
        "--prom-at",
        str(end_s),
        "--window-days",
        "1",
        "--restart-s",
        "60",
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    inputs = doc["inputs"]
    assert set(doc["measured"]) == {
        "replicas",
        "streams_per_replica",
        "crashes_per_replica",
        "rollouts_per_replica",
        "workloads",
    }
    assert inputs["replicas"] == 3
    assert inputs["streams_per_replica"] == pytest.approx(6.0)
    # 6 crashes/h fleet-wide = 144 a day over 3 replicas; rollouts 72 / 3.
    assert inputs["crashes_per_replica"] == pytest.approx(48.0)
    assert inputs["rollouts_per_replica"] == pytest.approx(24.0)
    mix = {w["name"]: (w["share"], w["stream_s"]) for w in inputs["workloads"]}
    assert mix["chat"] == pytest.approx((1 / 1.1, 10.0))
    assert mix["agent"] == pytest.approx((0.1 / 1.1, 100.0))
    # And the model then uses them: 48 crashes x 6 streams x 3 replicas.
    assert doc["crash_failures"] == pytest.approx(3 * 48 * 6)


# --- pools (issue 16) ------------------------------------------------------------------
#
# A day of pool history, written as the gateway exports it (the exact names and labels
# in `seawall.metrics`, the move counters from 0 as `Metrics.seed` creates them), so that
# the PromQL is checked against a real Prometheus over hours no test can wait for. The
# gateway's own export of these families is checked live in test_gateway_pools.py.

EAST = ("r1", "r2", "r3", "r4")
WEST = ("r5", "r6")
NODES = {"r1": "n1", "r2": "n1", "r3": "n2", "r4": "n2", "r5": "n3", "r6": "n3"}
DOWN_FROM_S, DOWN_TO_S = 600, 960  # east has no routable replica then, every hour


Value = float | Callable[[int], float]  # a constant, or the value at time t


def _labels(**labels: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def _pool_openmetrics(end_s: int) -> str:
    start = end_s - HISTORY_S
    times = range(start, end_s + 1, STEP_S)
    lines: list[str] = []

    def gauge(name: str, rows: Sequence[tuple[dict[str, str], Value]]) -> None:
        lines.append(f"# TYPE {name} gauge")
        for labels, value in rows:
            for t in times:
                v = value(t) if callable(value) else value
                lines.append(f"{name}{{{_labels(**labels)}}} {v} {t}")

    def counter(name: str, rows: Sequence[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# TYPE {name[: -len('_total')]} counter")
        for labels, per_h in rows:
            lines.extend(
                f"{name}{{{_labels(**labels)}}} {per_h * (t - start) / 3600} {t}" for t in times
            )

    def east_up(t: int) -> bool:
        return not DOWN_FROM_S <= (t - start) % 3600 < DOWN_TO_S

    gauge(m.REPLICA_POOL, [({"replica": r, "pool": "east"}, 1) for r in EAST])
    lines += [
        f"{m.REPLICA_POOL}{{{_labels(replica=r, pool='west')}}} 1 {t}" for r in WEST for t in times
    ]
    gauge(
        m.POOL_INFO,
        [
            ({"pool": "east", "priority": "0", "mode": "active"}, 1),
            ({"pool": "west", "priority": "1", "mode": "passive"}, 1),
        ],
    )
    gauge(m.INFLIGHT, [({"replica": r}, 6 if r in EAST else 0) for r in (*EAST, *WEST)])
    # Two states per replica, as the fleet monitor exports them (1 for the current one).
    gauge(
        m.REPLICA_STATE,
        [
            ({"replica": r, "node": NODES[r], "state": state}, value)
            for r in (*EAST, *WEST)
            for state, value in (("ready", 1), ("dead", 0))
        ],
    )
    # East: 6 crashes an hour (n1 4, n2 2) and 2 rollouts; west: 1 crash an hour.
    counter(
        m.RESTARTS,
        [
            ({"node": "n1", "reason": "crash"}, 4),
            ({"node": "n2", "reason": "crash"}, 2),
            ({"node": "n1", "reason": "rollout"}, 2),
            ({"node": "n3", "reason": "crash"}, 1),
            ({"node": "n3", "reason": "rollout"}, 0),
        ],
    )
    # One east loss an hour fails both models over (so twice the counts, one loss);
    # west never fails over but its series exist, seeded at zero.
    counter(
        m.POOL_FAILOVERS,
        [
            ({"model": model, "from_pool": "east", "to_pool": "west"}, 1)
            for model in ("chat", "agent")
        ]
        + [({"model": "chat", "from_pool": "west", "to_pool": "east"}, 0)],
    )
    counter(
        m.POOL_FAILBACKS,
        [
            ({"model": model, "from_pool": "west", "to_pool": "east"}, 1)
            for model in ("chat", "agent")
        ],
    )
    gauge(
        m.POOL_ROUTABLE,
        [
            ({"pool": "east", "model": model}, lambda t: 2 if east_up(t) else 0)
            for model in ("chat", "agent")
        ]
        + [({"pool": "west", "model": model}, 1) for model in ("chat", "agent")],
    )
    gauge(
        m.POOL_SERVING,
        [
            ({"pool": pool, "model": model}, 1 if pool == "east" else 0)
            for pool in ("east", "west")
            for model in ("chat", "agent")
        ],
    )
    lines.append(f"# TYPE {m.E2E} histogram")
    for model, per_s, stream_s in (("chat", 1.0, 10.0), ("agent", 0.1, 100.0)):
        for t in times:
            n = per_s * (t - start)
            lines.append(f'{m.E2E}_bucket{{le="+Inf",model="{model}"}} {n} {t}')
            lines.append(f'{m.E2E}_count{{model="{model}"}} {n} {t}')
            lines.append(f'{m.E2E}_sum{{model="{model}"}} {n * stream_s} {t}')
    return "\n".join(_grouped(lines)) + "\n# EOF\n"


def test_budget_reads_pool_figures_from_prometheus(tmp_path: Path, artifacts: Path) -> None:
    end_s = _end_s()
    fleet = tmp_path / "fleet.yaml"
    # What Prometheus cannot know: east's nodes. Its measured values win over the file.
    fleet.write_text(
        "pools:\n"
        "  - {name: east, replicas: 9, replicas_per_node: 2, node_losses: 1,"
        " node_recovery_s: 300}\n"
    )
    result = _budget_against(
        tmp_path,
        artifacts,
        _pool_openmetrics(end_s),
        "--fleet",
        str(fleet),
        "--prom-range",
        "1h",
        "--prom-at",
        str(end_s),
        "--window-days",
        "1",
        "--restart-s",
        "60",
        "--max-streams-per-replica",
        "10",
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    pools = {p["name"]: p for p in doc["inputs"]["pools"]}
    east, west = pools["east"], pools["west"]
    assert (east["replicas"], west["replicas"]) == (4, 2)
    assert (east["priority"], east["passive"]) == (0, False)
    assert (west["priority"], west["passive"]) == (1, True)
    assert east["streams_per_replica"] == pytest.approx(6.0)
    assert west["streams_per_replica"] == pytest.approx(0.0)
    # Restarts reach pools through nodes: east 6 crashes/h = 144 a day over 4
    # replicas, 2 rollouts/h = 48 over 4; west 1 crash/h = 24 over 2.
    assert east["crashes_per_replica"] == pytest.approx(36.0)
    assert east["rollouts_per_replica"] == pytest.approx(12.0)
    assert west["crashes_per_replica"] == pytest.approx(12.0)
    assert west["rollouts_per_replica"] == pytest.approx(0.0)
    # One loss an hour (not two: both models fail over at once), 24 a day; down 360 s
    # of every hour, so each loss lasts 360 s (to the 15 s subquery step).
    assert east["pool_losses"] == pytest.approx(24.0)
    assert east["pool_recovery_s"] == pytest.approx(360.0, rel=0.01)
    assert west["pool_losses"] == 0
    # From the file: what Prometheus does not measure.
    assert (east["replicas_per_node"], east["node_losses"]) == (2, 1)
    assert "east.replicas" in doc["measured"] and "east.pool_losses" in doc["measured"]
    assert "east.replicas_per_node" not in doc["measured"]
    assert doc["observed"]["east"] == {
        "failbacks": pytest.approx(24.0),
        "routable_now": 4,
        "serving": ["agent", "chat"],
    }
    assert doc["observed"]["west"]["serving"] == []
    # And the model uses them: every east loss cuts its 24 streams.
    assert doc["pool_failures"] == pytest.approx(24 * 24)
    # West, passive, has 2 x 10 spare streams for east's 24 (both measured workloads
    # may fail over): 20/24 of the traffic after the 2 s detection finds a place.
    region = next(x for x in doc["losses"] if x["pool"] == "east" and x["kind"] == "pool")
    assert region["spare_elsewhere"] == pytest.approx(20.0)
    rps = 24 / (1 / 1.1 * 10 + 0.1 / 1.1 * 100)
    recovery_s = east["pool_recovery_s"]
    assert region["refused"] == pytest.approx(24 * rps * (2 + (recovery_s - 2) * 4 / 24))


def test_budget_without_pool_series_stays_flat(tmp_path: Path, artifacts: Path) -> None:
    # The flat series only: no pools appear, and the figures are the flat model's.
    end_s = _end_s()
    result = _budget_against(
        tmp_path, artifacts, _openmetrics(end_s), "--prom-range", "1h", "--prom-at", str(end_s)
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert "pools" not in doc["inputs"] and "losses" not in doc
