"""Lifecycle without dropped streams, under `seawall up` (local supervisor, in-process
gateway): draining one replica, and a surge-first rolling restart of every replica under
steady streaming load.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading

import httpx
import pytest

from seawall.loadgen import LoadReport, run_load
from tests.support.fleet import MODEL, wait_until
from tests.support.procs import seawall_argv
from tests.support.up import AUTH, TOKEN, Up, sim_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def steady_load(
    api: str, seconds: float, stop: threading.Event
) -> tuple[threading.Thread, list[LoadReport]]:
    out: list[LoadReport] = []

    def go() -> None:
        async def main() -> LoadReport:
            flag = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                flag.set()

            watcher = asyncio.create_task(watch())
            try:
                return await run_load(
                    api,
                    MODEL,
                    concurrency=6,
                    duration_s=seconds,
                    max_requests=5000,
                    max_tokens=60,
                    stop=flag,
                )
            finally:
                watcher.cancel()

        out.append(asyncio.run(main()))

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_drained_replica_finishes_its_streams_then_exits(up: Up) -> None:
    # A long stream pinned to whichever replica it lands on.
    result: dict[str, bytes] = {}

    def long_stream() -> None:
        result["body"] = httpx.post(
            up.api + "/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
            },
        ).content

    t = threading.Thread(target=long_stream)
    t.start()
    wait_until(
        lambda: any(r["inflight"] for r in up.state()["replicas"]), 10, what="the stream in flight"
    )
    busy = next(r for r in up.state()["replicas"] if r["inflight"])
    r = httpx.post(
        up.admin + f"/admin/replicas/{busy['id']}/stop?timeout_s=30&grace_s=5",
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200
    report = r.json()
    assert report == {"replica": busy["id"], "streams_cut": 0, "exited": True}
    t.join(timeout=60)
    assert result["body"].endswith(b"data: [DONE]\n\n") and b'"error"' not in result["body"]
    assert busy["id"] not in [x["id"] for x in up.state()["replicas"]]
    # Its process is gone: nothing listens on its port any more.
    with pytest.raises(httpx.ConnectError):
        httpx.get(busy["url"] + "/health", timeout=2)


def test_rolling_restart_of_every_replica_drops_no_stream(up: Up) -> None:
    before = up.routable()
    stop = threading.Event()
    thread, reports = steady_load(up.api, 120, stop)
    try:
        wait_until(
            lambda: any(r["inflight"] for r in up.state()["replicas"]), 10, what="steady load"
        )
        out = subprocess.run(
            seawall_argv(
                "rollout", "--admin", up.admin, "--admin-token", TOKEN, "--json", "--timeout", "120"
            ),
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
    finally:
        stop.set()
        thread.join(timeout=60)
    load = reports[0]
    assert report["state"] == "done"
    assert sorted(old for old, _ in report["replaced"]) == before
    assert report["streams_dropped"] == 0 and report["requests_failed"] == 0
    assert report["ready_min_during"] >= report["ready_before"] == 3
    # What the client saw, independently of the gateway's own accounting:
    assert load.ok > 0 and load.dropped == 0 and load.failed == 0, load.line()
    after = up.routable()
    assert len(after) == 3 and not set(after) & set(before)


def test_rollout_stops_at_a_replica_that_fails_warm_up(up: Up) -> None:
    before = up.routable()
    # Braces are doubled: the command is a template ({port}, {model}, ...).
    broken = " ".join(sim_command("--fault", '\'{{"kind": "errors", "rate": 1.0}}\''))
    out = subprocess.run(
        seawall_argv(
            "rollout",
            "--admin",
            up.admin,
            "--admin-token",
            TOKEN,
            "--json",
            "--command",
            broken,
            "--timeout",
            "60",
        ),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["state"] == "failed" and "warm-up" in report["failure"]
    assert report["replaced"] == []
    assert up.routable() == before  # the old replicas keep serving
    r = httpx.post(
        up.api + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 200
