"""`seawall budget --from-prometheus` against a real Prometheus server on loopback.

The server loads a TSDB built with `promtool tsdb create-blocks-from openmetrics` from
series whose rates are known exactly (linear counters, constant gauges), so the
measured inputs can be checked to the digit.
"""

from __future__ import annotations

import json
import subprocess
import time
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


def test_budget_reads_measured_inputs_from_prometheus(tmp_path: Path, artifacts: Path) -> None:
    promtool = require_binary("promtool")
    prometheus = require_binary("prometheus")
    end_s = int(time.time()) // 60 * 60 - 600  # whole minutes, safely in the past
    source = tmp_path / "series.om"
    source.write_text(_openmetrics(end_s))
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
        result = subprocess.run(
            seawall_argv(
                "budget",
                "--json",
                "--from-prometheus",
                proc.url,
                "--prom-range",
                "1h",
                "--prom-at",
                str(end_s),
                "--window-days",
                "1",
                "--restart-s",
                "60",
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        proc.stop()
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
