"""`seawall up` as a user runs it: a real process tree (sims, gateway, traffic) on loopback."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from seawall.actuate.local import DEFAULT_COMMAND
from tests.support.procs import Proc, seawall_argv, spawn

pytestmark = pytest.mark.integration


def pids_mentioned(output: str) -> set[int]:
    pids = {int(p) for p in re.findall(r"pid=(\d+)", output)}
    summary = re.search(r"^  pids: ([\d ]+)$", output, re.M)
    assert summary, output[-3000:]
    return pids | {int(p) for p in summary.group(1).split()}


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes containing `text` (e.g. the run's log dir)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv and "pytest" not in argv:
            found.append(argv)
    return found


def fresh(path: Path) -> Path:
    """An empty log dir: a reused one keeps its restart ledger, and with it any cordon
    that earlier runs' restarts earned."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def assert_nothing_left(proc: Proc, log_dir: Path, replicas: int = 3) -> str:
    output = proc.log()
    pids = pids_mentioned(output)
    assert proc.pid not in pids and len(pids) >= replicas
    assert [p for p in pids if running(p)] == []
    ports = re.findall(r"url=http://127\.0\.0\.1:(\d+)", output)
    for port in ports:
        assert processes_mentioning(f"--port {port}") == []
    assert processes_mentioning(str(log_dir)) == []
    return output


def tallies(output: str) -> tuple[dict[str, int], dict[str, int]]:
    """The summary's two counts: the client's (`traffic:`) and the gateway's."""
    client = re.search(
        r"^  traffic: requests \d+: ok (\d+), failed (\d+), dropped (\d+)(?:, cut (\d+))?",
        output,
        re.M,
    )
    gateway = re.search(r"^  gateway: answered ok (\d+), failed (\d+), dropped (\d+)", output, re.M)
    assert client and gateway, output[-3000:]
    keys = ("ok", "failed", "dropped", "cut")
    return (
        {k: int(v or 0) for k, v in zip(keys, client.groups(), strict=True)},
        {k: int(v) for k, v in zip(keys, gateway.groups(), strict=False)},
    )


def agree(client: dict[str, int], gateway: dict[str, int]) -> bool:
    """The same failures and drops; the same successes, but for a request the client cut
    at the stop just as the gateway finished it (then the gateway's is one more)."""
    return (
        client["failed"] == gateway["failed"]
        and client["dropped"] == gateway["dropped"]
        and client["ok"] <= gateway["ok"] <= client["ok"] + client["cut"]
    )


@pytest.mark.slow
def test_the_demo_runs_shows_the_fleet_survives_a_crash_and_cleans_up(artifacts: Path) -> None:
    log_dir = fresh(artifacts / "fleet")
    proc = spawn(
        seawall_argv(
            "up", "--demo", "--demo-seconds", "14", "--demo-crash-at", "1",
            "--log-dir", str(log_dir),
        ),
        artifacts / "up.log",
    )  # fmt: skip
    try:
        # The status page runs with the demo, at the address it prints, with its token.
        for _ in range(600):
            found = re.search(
                r"status page (http://127\.0\.0\.1:\d+/status)#token=(\S+)", proc.log()
            )
            if found or not proc.alive():
                break
            time.sleep(0.1)
        assert found, proc.log()[-4000:]
        status_url, token = found.groups()
        with urllib.request.urlopen(status_url, timeout=5) as page:
            assert page.status == 200 and b"Admin token" in page.read()
        state = urllib.request.Request(
            status_url.replace("/status", "/admin/state"),
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(state, timeout=5) as resp:
            assert len(json.loads(resp.read())["replicas"]) == 3
        assert proc.wait(timeout=90) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    output = assert_nothing_left(proc, log_dir)
    assert re.search(
        r"replicas 3/3 running: r0 running pid=\d+ port=\d+ restarts=0 routing=\S+ inflight=\d+",
        output,
    )
    assert re.search(
        r"gateway running http://127\.0\.0\.1:\d+ pid \d+ restarts 0 \(in-process\)", output
    )
    crashed = re.search(r"demo: crashed (r\d) on purpose with (\d+) request\(s\) in flight", output)
    assert crashed, output[-3000:]
    victim = crashed.group(1)
    assert f"event: {victim} exited" in output and f"{victim} (restarts 1)" in output
    # What the gateway saved: every stream in flight on the crashed replica went on
    # elsewhere (the demo's tier migrates), none was cut.
    report = re.search(
        rf"^  crash of {victim} with (\d+) request\(s\) in flight \((\d+) streaming\): "
        r"(\d+) migrated, (\d+) retried, 0 failed \(a plain proxy would have cut \1\)$",
        output,
        re.M,
    )
    assert report, output[-3000:]
    in_flight, streaming, migrated, retried = map(int, report.groups())
    assert streaming >= 1 and migrated == streaming and migrated + retried == in_flight
    # One truthful count: the gateway's tally and the client's agree.
    client, gateway = tallies(output)
    assert client["ok"] > 0 and agree(client, gateway), (client, gateway)
    assert "tokens/s" in output and "restart_refused" not in output
    assert "all processes stopped" in output


@pytest.mark.slow
def test_a_stream_cut_by_a_crash_is_dropped_in_both_counts(artifacts: Path) -> None:
    """The gateway's tally once called a stream cut mid-way ok (its status was 200)
    while the client counted it dropped. Without migration, a crash drops the streams in
    flight on the replica; both counts must say so, with the same numbers."""
    log_dir = fresh(artifacts / "fleet")
    config = artifacts / "fleet.yaml"
    command = (
        '["' + '", "'.join([*DEFAULT_COMMAND, "--enable-faults", "--step-base-ms", "20"]) + '"]'
    )
    config.write_text(
        f"fleet: {{replicas: 2, model: tiny, command: {command}}}\n"
        "traffic: {concurrency: 4, max_tokens: 150}\n"
    )
    proc = spawn(
        seawall_argv("up", "--config", str(config), "--seconds", "60", "--log-dir", str(log_dir)),
        artifacts / "up.log",
    )
    try:
        for _ in range(600):
            if (
                re.search(r"r0 running pid=\d+ [^;|]* inflight=[1-9]", proc.log())
                or not proc.alive()
            ):
                break
            time.sleep(0.1)
        match = re.search(r"r0 starting pid=\d+ url=(\S+)", proc.log())
        assert match and proc.alive(), proc.log()[-4000:]
        body = json.dumps({"kind": "crash"}).encode()
        request = urllib.request.Request(f"{match.group(1)}/sim/fault", data=body, method="POST")
        with contextlib.suppress(OSError):  # the process may die before it answers
            urllib.request.urlopen(request, timeout=5).close()
        for _ in range(100):
            if "event: r0 exited" in proc.log():
                break
            time.sleep(0.1)
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    client, gateway = tallies(assert_nothing_left(proc, log_dir, replicas=2))
    assert client["dropped"] >= 1 and agree(client, gateway), (client, gateway)


def test_sigterm_stops_a_configured_fleet_cleanly(artifacts: Path) -> None:
    log_dir = fresh(artifacts / "fleet")
    config = artifacts / "fleet.yaml"
    config.write_text(
        "fleet: {replicas: 3, model: tiny}\n"
        "gateway: {drain: {timeout_s: 5}}\n"
        "gateway_mode: process\n"
        "traffic: {concurrency: 2, max_tokens: 64}\n"
    )
    proc = spawn(
        seawall_argv("up", "--config", str(config), "--seconds", "120", "--log-dir", str(log_dir)),
        artifacts / "up.log",
    )
    try:
        for _ in range(600):  # up to 60 s for the fleet to come up under a loaded CI
            if "traffic requests" in proc.log() or not proc.alive():
                break
            time.sleep(0.1)
        assert "traffic requests" in proc.log(), proc.log()[-4000:]
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    output = assert_nothing_left(proc, log_dir)
    assert "gateway running" in output and "(in-process)" not in output
    assert "seawall up: stopping (signal)" in output
    assert "all processes stopped" in output


def test_replicas_do_not_outlive_a_killed_seawall_up(artifacts: Path) -> None:
    """Even SIGKILL, which allows no cleanup, must not leave engines behind."""
    log_dir = fresh(artifacts / "fleet")
    config = artifacts / "fleet.yaml"
    config.write_text("fleet: {replicas: 2, model: tiny}\ngateway_mode: process\n")
    proc = spawn(
        seawall_argv("up", "--config", str(config), "--seconds", "120", "--log-dir", str(log_dir)),
        artifacts / "up.log",
    )
    try:
        for _ in range(600):
            if "replicas 2/2 running" in proc.log() or not proc.alive():
                break
            time.sleep(0.1)
        output = proc.log()
        assert "replicas 2/2 running" in output, output[-4000:]
        children = {int(p) for p in re.findall(r"pid=(\d+)", output)}
        assert len(children) == 3 and all(running(p) for p in children)
        proc.signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.stop()
    for _ in range(100):  # the kernel signals them at once; they need a moment to exit
        if not any(running(p) for p in children):
            break
        time.sleep(0.1)
    assert [p for p in children if running(p)] == []


def test_the_in_process_gateway_restarts_a_replica_whose_health_fails(artifacts: Path) -> None:
    """The gateway's fleet monitor decides (health failing), the local supervisor acts."""
    log_dir = fresh(artifacts / "fleet")
    config = artifacts / "fleet.yaml"
    command = '["' + '", "'.join([*DEFAULT_COMMAND, "--enable-faults"]) + '"]'
    config.write_text(f"fleet: {{replicas: 1, model: tiny, command: {command}}}\n")
    proc = spawn(
        seawall_argv("up", "--config", str(config), "--seconds", "60", "--log-dir", str(log_dir)),
        artifacts / "up.log",
    )
    try:
        for _ in range(300):
            if "replicas 1/1 running" in proc.log() or not proc.alive():
                break
            time.sleep(0.1)
        match = re.search(r"r0 starting pid=\d+ url=(\S+)", proc.log())
        assert match and "replicas 1/1 running" in proc.log(), proc.log()[-4000:]
        # /health answers 503 from now on; the process itself stays up for a minute.
        body = json.dumps({"kind": "engine_dead", "grace_s": 60}).encode()
        request = urllib.request.Request(f"{match.group(1)}/sim/fault", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200
        for _ in range(300):
            if "r0 (restarts 1)" in proc.log() or re.search(r"r0 .*restarts=1", proc.log()):
                break
            time.sleep(0.1)
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    output = assert_nothing_left(proc, log_dir, replicas=1)
    assert re.search(r"event: r0 starting pid=\d+ url=\S+ \(restarted: health", output), output
    assert "r0 (restarts 1)" in output


def test_without_a_gateway_traffic_goes_to_each_replica_directly(artifacts: Path) -> None:
    config = artifacts / "fleet.yaml"
    config.write_text(
        "fleet: {replicas: 2, model: tiny}\ngateway: null\ntraffic: {concurrency: 2}\n"
    )
    proc = spawn(
        seawall_argv(
            "up",
            "--config",
            str(config),
            "--seconds",
            "5",
            "--log-dir",
            str(fresh(artifacts / "fleet")),
        ),
        artifacts / "up.log",
    )
    try:
        assert proc.wait(timeout=60) == 0, proc.log()[-4000:]
    finally:
        proc.stop()
    output = assert_nothing_left(proc, artifacts / "fleet", replicas=2)
    assert "gateway: (no gateway: gateway is null in the config)" in output
    target = re.search(r"traffic started → (\S+), (\S+)$", output, re.M)
    assert target, output[-3000:]
    traffic = re.search(r"^  traffic: requests \d+: ok (\d+), failed 0", output, re.M)
    assert traffic and int(traffic.group(1)) > 0, output[-3000:]


def test_a_busy_gateway_port_is_a_clear_error_and_nothing_is_left(artifacts: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = spawn(
            seawall_argv(
                "up", "--demo", "--demo-seconds", "30", "--gateway-port", str(port),
                "--log-dir", str(fresh(artifacts / "fleet")),
            ),
            artifacts / "up.log",
        )  # fmt: skip
        try:
            assert proc.wait(timeout=60) == 1, proc.log()[-4000:]
        finally:
            proc.stop()
    output = proc.log()
    assert "seawall up: could not start the fleet:" in output
    assert "all processes stopped" in output
    assert [p for p in pids_mentioned(output) if running(p)] == []
