"""`seawall drill` as an operator runs it: a subprocess against real sims and a real gateway."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from seawall.auth import hash_key
from tests.support.fleet import running, start_gateway, start_sim, wait_until
from tests.support.procs import Proc, free_port, seawall_argv
from tests.support.up import TOKEN as UP_TOKEN
from tests.support.up import Up

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "sk-sw-admin-token-for-drill-tests-0000000000000000"


def admin_gateway(
    artifacts: Path, sims: list[Proc], extra: dict[str, Any] | None = None
) -> tuple[Proc, str]:
    port = free_port()
    cfg: dict[str, Any] = {
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
        **(extra or {}),
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


def steady_ttft_p99_s(report: dict[str, Any]) -> float:
    """The steady load's TTFT p99 with each failed request counted as a first token that
    never came: the report's p99 is over the requests that got one, and the run that fails
    its slowest requests would otherwise look the fastest."""
    during = report["during"]
    if during["failed"] > 0.01 * during["requests"]:
        return math.inf
    return float(during["ttft_p99_s"])


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
        # A crash drops at most the streams on the replica when it died; those still
        # before their first token go to the other replica instead (a CI run caught the
        # crash just as two streams ended there: both in flight then were new, and both
        # were retried). The in-flight count is the watcher's last sample before /health
        # went silent, so one stream may have ended, or begun, between it and the crash.
        assert report["streams_dropped"] <= inflight + 1
        moved = report["retries"] + report["failed_before_first_token"]
        assert report["streams_dropped"] + moved >= max(1, inflight - 1), report
        assert report["detection_s"] is not None and report["detection_s"] < 3.0
        assert report["retry_amplification"] >= 1.0
        assert report["cleared"] is False
        assert any("process is gone" in n for n in report["notes"])

        again = drill(admin, "crash-mid-stream", "--target", report["target"], "--duration", "3")
        assert again.returncode == 2 and report["target"] in again.stderr  # gone: not faked


@pytest.mark.slow
def test_preemption_storm_drill_shows_admission_keeping_the_engines_from_preempting(
    artifacts: Path,
) -> None:
    """The storm drill on one small-KV fleet, through a gateway without admission and then
    one with it. Without, the engines preempt, the fleet reports it, and the steady load's
    first tokens wait behind recomputation; with it, the excess waits at the gateway's door,
    no engine preempts, and the steady load keeps its pace."""
    small_kv = ("--kv-blocks", "160", "--max-model-len", "2048")
    a, b = start_sim(artifacts, *small_kv, name="a"), start_sim(artifacts, *small_kv, name="b")
    reports: dict[bool, dict[str, Any]] = {}
    with running(a, b):
        for admission in (False, True):
            gw, admin = admin_gateway(artifacts, [a, b], {"admission": {"enabled": admission}})
            with running(gw):
                wait_until(partial(all_routable, admin), 10, interval=0.2, what="both routable")
                out = drill(
                    admin, "preemption-storm", "--duration", "8", "--concurrency", "2", "--json"
                )
                reports[admission] = report_of(out)
                (artifacts / f"storm-admission-{admission}.json").write_text(out.stdout)
    without, with_ = reports[False], reports[True]
    assert sum(without["preemptions"].values()) > 0
    assert without["detection_s"] is not None and "preempting" in without["detected_as"]
    assert sum(with_["preemptions"].values()) == 0, with_["preemptions"]
    assert with_["detection_s"] is None  # nothing to detect: no engine preempted
    # The steady load behind the storm: served at least as often, first tokens sooner.
    assert with_["during"]["ok"] >= without["during"]["ok"] > 0
    assert steady_ttft_p99_s(with_) < steady_ttft_p99_s(without)
    assert with_["requests_failed"] == with_["streams_dropped"] == 0


@pytest.mark.slow
def test_overload_drill_is_met_at_the_door_not_by_timeouts(artifacts: Path) -> None:
    """Eight times the steady load on engines that run two sequences each: the fleet
    reports the replicas saturated (their queues, scraped) within a second or so, and the
    gateway holds or refuses the excess: nothing times out, nothing is cut mid-stream.

    The time-to-first-token timeout is a production-like 30 s here: the burst's first
    wave lands in the engines' queues before two scrapes have shown them growing (the
    admission signal), and with the 2 s of the fault drills some of it would time out."""
    a = start_sim(artifacts, "--max-num-seqs", "2", name="a")
    b = start_sim(artifacts, "--max-num-seqs", "2", name="b")
    timeouts = {"ttft_s": 30.0, "itl_s": 10.0, "total_s": 60.0}
    gw, admin = admin_gateway(artifacts, [a, b], {"timeouts": timeouts})
    with running(gw, a, b):
        wait_until(lambda: all_routable(admin), 10, interval=0.2, what="both routable")
        out = drill(admin, "overload", "--duration", "8", "--concurrency", "3", "--json")
        report = report_of(out)
        (artifacts / "overload-report.json").write_text(out.stdout)
        assert report["detection_s"] is not None and report["detection_s"] < 3.0
        assert "saturated" in report["detected_as"]
        assert report["burst"]["ok"] > 0 and report["during"]["ok"] > 0
        assert report["streams_dropped"] == 0
        # The only refusals are admission's (429 with Retry-After); the only cuts are the
        # load generator's own deadline at the end of the drill.
        for error in report["errors"]:
            assert error.startswith(("HTTP 429", "cut at the load generator")), error
        assert sum(report["preemptions"].values()) == 0


async def test_rolling_restart_on_an_older_gateway_says_rollouts_are_missing(
    artifacts: Path,
) -> None:
    # A gateway from before rollouts: its admin API has no /admin/rollout at all.
    async def state(request: web.Request) -> web.Response:
        return web.json_response(
            {"api_url": "http://127.0.0.1:9", "replicas": [_REPLICA], "nodes": []}
        )

    app = web.Application()
    app.router.add_get("/admin/state", state)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        proc = await asyncio.create_subprocess_exec(
            *seawall_argv("drill", "rolling-restart", "--admin", f"http://127.0.0.1:{port}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        await runner.cleanup()
    assert proc.returncode == 3, stderr
    assert b"rollout endpoint" in stderr and b"not available" in stderr
    assert stdout == b""  # no table of made-up figures


_REPLICA = {"id": "r0", "url": "http://127.0.0.1:9", "model": "m", "routable": True}


def test_rolling_restart_without_an_actuator_exits_3_with_the_gateway_reason(
    artifacts: Path,
) -> None:
    sim = start_sim(artifacts)
    gw, admin = admin_gateway(artifacts, [sim])  # `seawall serve`: nothing can start replicas
    with running(gw, sim):
        out = drill(admin, "rolling-restart", "--duration", "3", "--concurrency", "2")
        assert out.returncode == 3, out.stderr
        assert "cannot roll out" in out.stderr and "local actuator" in out.stderr
        assert out.stdout == ""


@pytest.mark.slow
def test_rolling_restart_drill_under_seawall_up_drops_no_stream(up: Up) -> None:
    before = up.routable()
    out = subprocess.run(
        seawall_argv(
            "drill", "rolling-restart", "--admin", up.admin, "--admin-token", UP_TOKEN,
            "--duration", "30", "--concurrency", "4", "--json",
        ),
        capture_output=True,
        text=True,
        timeout=90,
    )  # fmt: skip
    report = report_of(out)
    (up.proc.log_path.parent / "rollout-drill-report.json").write_text(out.stdout)
    assert report["rollout"]["state"] == "done", report["rollout"]
    assert sorted(old for old, _ in report["rollout"]["replaced"]) == before
    assert report["rollout"]["streams_dropped"] == 0  # the gateway's own accounting
    # What the drill's own clients saw: nothing dropped, nothing failed.
    assert report["baseline"]["ok"] > 0 and report["during"]["ok"] > 0
    assert report["streams_dropped"] == 0 and report["requests_failed"] == 0, report["errors"]
    assert report["detection_s"] is None  # a rollout is announced, not detected
    after = up.routable()
    assert len(after) == 3 and not set(after) & set(before)


def test_pool_loss_drill_reports_the_failover_and_the_failback(artifacts: Path) -> None:
    """Issue 16: take the serving pool down under load. Clients see no failure before a
    first token (requests go on to the standby region at once), the model moves to the
    other pool, and back once the pool has returned and stayed healthy for the hold."""
    from tests.support.chop import ChoppingRelay
    from tests.support.fleet import MODEL

    east = [start_sim(artifacts, name=f"east{i}") for i in range(2)]
    west = start_sim(artifacts, name="west")
    with running(west), ChoppingRelay(west.port or 0, piece=None, delay_s=0.02) as wan:
        replicas = [
            {"id": f"e{i}", "url": s.url, "model": MODEL, "pool": "east"}
            for i, s in enumerate(east)
        ]
        replicas.append({"id": "w0", "url": wan.url, "model": MODEL, "pool": "west"})
        gw, admin = admin_gateway(
            artifacts,
            [],
            {
                "replicas": replicas,
                "pools": {"east": {}, "west": {"priority": 1, "mode": "passive"}},
                "failover": {"after_s": 1.0, "failback_after_s": 2.0},
            },
        )
        with running(gw, *east):
            wait_until(partial(all_routable, admin), 15, interval=0.2, what="all routable")
            out = drill(admin, "pool-loss", "--duration", "14", "--concurrency", "3", "--json")
            report = report_of(out)
            (artifacts / "pool-loss.json").write_text(out.stdout)
            human = drill(admin, "pool-loss", "--duration", "10", "--concurrency", "2")
    assert report["pool"] == "east" and report["cleared"] is True
    assert report["failover_s"] is not None and report["failover_s"] < 5.0
    assert report["failback_s"] is not None and report["failback_s"] >= 2.0
    assert report["failed_before_first_token"] == 0
    assert report["during"]["ok"] > 0  # served from the standby region meanwhile
    assert report["requests_failed"] == 0  # nothing that had not started streaming failed
    assert human.returncode == 0 and "time to fail over" in human.stderr + human.stdout
