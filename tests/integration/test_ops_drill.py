"""`seawall drill` as an operator runs it: a subprocess against real sims and a real gateway."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from seawall.auth import hash_key
from tests.support.fleet import running, start_gateway, start_sim, wait_until
from tests.support.procs import Proc, free_port, seawall_argv

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "sk-sw-admin-token-for-drill-tests-0000000000000000"


def admin_gateway(artifacts: Path, sims: list[Proc]) -> tuple[Proc, str]:
    port = free_port()
    cfg = {
        "admin": {"enabled": True, "port": port, "token_hash": hash_key(ADMIN_TOKEN)},
        # Short timeouts so a hung replica costs its streams seconds, not minutes, and the
        # drill's bounded window sees the whole story.
        "timeouts": {"ttft_s": 2.0, "itl_s": 2.0, "total_s": 30.0},
        "fleet": {
            "liveness_interval_s": 0.25,
            "scrape_interval_s": 0.25,
            "deep_probe_interval_s": 0.5,
            "deep_probe_idle_interval_s": 0.5,
            "deep_probe_timeout_s": 0.5,
            "watchdog_window_s": 1.0,
        },
    }
    gw = start_gateway(artifacts, sims, cfg)
    return gw, f"http://127.0.0.1:{port}"


def drill(admin: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        seawall_argv("drill", *args, "--admin", admin, "--admin-token", ADMIN_TOKEN),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def all_routable(admin: str) -> bool:
    out = subprocess.run(
        seawall_argv("status", "--admin", admin, "--admin-token", ADMIN_TOKEN, "--json"),
        capture_output=True,
        text=True,
        timeout=20,
    )
    return out.returncode == 0 and all(r["routable"] for r in json.loads(out.stdout)["replicas"])


def report_of(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def test_hang_drill_reports_detection_and_bounded_failures(artifacts: Path) -> None:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    gw, admin = admin_gateway(artifacts, [a, b])
    with running(gw, a, b):
        wait_until(lambda: all_routable(admin), 10, interval=0.2, what="both routable")
        out = drill(admin, "hang", "--duration", "8", "--concurrency", "4", "--json")
        report = report_of(out)
        (artifacts / "hang-report.json").write_text(out.stdout)
        target = report["target"]  # the replica that carried streams at injection
        assert target in ("r0", "r1") and report["fault"]["kind"] == "hang"
        # /health kept answering 200: the hang is invisible to a liveness probe ...
        assert report["health_during_fault"] == 200
        # ... and still the fleet took the replica out within a few probe intervals.
        assert report["detection_s"] is not None and 0 <= report["detection_s"] < 4.0
        assert report["detected_as"].startswith(target)
        assert report["baseline"]["requests"] > 0 and report["baseline"]["failed"] == 0
        # Retries before the first token hide the hang from most users: at most the
        # streams that were on r0 at the moment (one per load worker) can be hurt.
        assert report["requests_failed"] + report["streams_dropped"] <= 4
        assert report["during"]["ok"] > 0
        assert report["cleared"] is True
        wait_until(lambda: all_routable(admin), 15, interval=0.2, what="back after clear")


def test_crash_drill_drops_exactly_the_streams_on_the_crashed_replica(artifacts: Path) -> None:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    gw, admin = admin_gateway(artifacts, [a, b])
    with running(gw, a, b):
        wait_until(lambda: all_routable(admin), 10, interval=0.2, what="both routable")
        out = drill(
            admin,
            "crash-mid-stream",
            "--duration",
            "6",
            "--concurrency",
            "4",
            "--max-tokens",
            "64",
            "--json",
        )
        report = report_of(out)
        (artifacts / "crash-report.json").write_text(out.stdout)
        crashed, survivor = (a, b) if report["target"] == "r0" else (b, a)
        assert not crashed.alive() and survivor.alive()  # the crash was real, and only one
        assert report["baseline"]["dropped"] == 0
        inflight = report["target_inflight_at_fault"]
        assert inflight is not None and inflight >= 1
        # A crash mid-stream drops exactly the streams on the replica when it died. The
        # in-flight count is the watcher's last sample before /health went silent, so one
        # stream may have ended, or begun, between that sample and the crash.
        assert max(1, inflight - 1) <= report["streams_dropped"] <= inflight + 1
        assert report["detection_s"] is not None and report["detection_s"] < 3.0
        assert report["retry_amplification"] >= 1.0
        assert report["cleared"] is False
        assert any("process is gone" in n for n in report["notes"])

        again = drill(admin, "crash-mid-stream", "--target", report["target"], "--duration", "3")
        assert again.returncode == 2 and report["target"] in again.stderr  # gone: not faked


def test_rolling_restart_says_the_rollout_endpoint_is_missing(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw, admin = admin_gateway(artifacts, [sim])
    with running(gw, sim):
        out = drill(admin, "rolling-restart", "--duration", "5")
        assert out.returncode == 3, out.stderr
        assert "rollout endpoint" in out.stderr and "not available" in out.stderr
        assert out.stdout == ""  # no table of made-up figures
