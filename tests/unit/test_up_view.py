"""What a person sees from `seawall up`: the live table, the plain line, the summary."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from seawall.actuate.local import ReplicaEvent, ReplicaStatus
from seawall.up.figures import GatewayFigures, ReplicaLoad, TrafficFigures
from seawall.up.runner import describe
from seawall.up.view import UpSnapshot, plain_line, render, summary


def status(rid: str, state: str, pid: int | None, restarts: int = 0) -> ReplicaStatus:
    return ReplicaStatus(
        replica_id=rid,
        url=f"http://127.0.0.1:{9000 + int(rid[1:])}",
        port=9000 + int(rid[1:]),
        model="sim-model",
        node="local",
        pid=pid,
        state=state,  # type: ignore[arg-type]
        restarts=restarts,
        uptime_s=75.0 if pid else 0.0,
        reason="exited with code 1; crash 1, next start in 1s" if state == "backoff" else "",
    )


SNAP = UpSnapshot(
    elapsed_s=42.0,
    replicas=(status("r0", "running", 101), status("r1", "backoff", None, restarts=2)),
    gateway=status("r9", "running", 109),
    gateway_url="http://127.0.0.1:8080",
    gateway_figures=GatewayFigures(
        requests_ok=90,
        requests_failed=1,
        requests_dropped=1,
        client_left=0,
        ttft_p50_s=0.018,
        retries=3,
        migrations_ok=2,
    ),
    traffic=TrafficFigures(
        requests=95,
        ok=93,
        failed=1,
        dropped=1,
        cut=0,
        ttft_p50_s=0.019,
        ttft_p99_s=0.04,
        tokens=2000,
        tokens_per_s=251.4,
    ),
    traffic_target="http://127.0.0.1:8080",
    events=("5s r1 exited (exited with code 1)",),
    routing={"r0": "ready", "r1": "dead (not routed)"},
    loads={"r0": ReplicaLoad(4, 0.34, 0.97), "r1": ReplicaLoad(0, None, None)},
    status_url="http://127.0.0.1:8081/status",
    crashes=("crash of r1 with 3 request(s) in flight (3 streaming): 3 migrated, ...",),
)


def rendered(snap: UpSnapshot) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(render(snap))
    return console.export_text()


def test_the_live_table_shows_each_replica_and_the_traffic() -> None:
    text = rendered(SNAP)
    assert "1/2 replicas running" in text and "42s" in text
    r0 = next(line for line in text.splitlines() if "r0" in line)
    assert all(cell in r0 for cell in ("9000", "running", "101", "1m15s"))
    r1 = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("r1"))
    assert "backoff" in r1 and " 2 " in r1 and "exited with code 1" in r1
    assert "ready" in r0 and "dead (not routed)" in r1  # the gateway's view, beside ours
    assert "answered ok 90, failed 1, dropped 1" in text and "retries 3, migrations 2" in text
    assert "ok 93, failed 1, dropped 1" in text and "251 tokens/s" in text
    assert "r1 exited" in text
    assert "status   http://127.0.0.1:8081/status" in text


def test_the_live_table_shows_each_replicas_load() -> None:
    text = rendered(SNAP)
    header = next(line for line in text.splitlines() if "replica" in line and "port" in line)
    assert all(column in header for column in ("in flight", "KV", "score"))
    r0 = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("r0"))
    assert " 4 " in r0 and "34%" in r0 and "0.97" in r0
    r1 = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("r1"))
    assert " 0 " in r1 and r1.count(" - ") >= 2  # not scraped, not judged yet
    assert "inflight=4 kv=34% score=0.97" in plain_line(SNAP)


def test_one_ttft_is_shown_the_clients_when_there_is_traffic() -> None:
    """Two TTFT figures disagreed (gateway 18 ms from histogram buckets, client 15 ms from
    its samples). With traffic of its own, `up` shows the client's, labelled; without,
    the gateway's estimate, labelled as one."""
    for text in (rendered(SNAP), plain_line(SNAP), "\n".join(summary(SNAP, [1], []))):
        assert text.count("TTFT") == 1 and "(client: sent to first token)" in text
        assert "18ms" not in text
    alone = replace(SNAP, traffic=None)
    for text in (rendered(alone), plain_line(alone)):
        assert text.count("TTFT") == 1
        assert "TTFT p50 ~18ms (gateway histogram estimate)" in text


def test_without_a_gateway_the_view_says_why() -> None:
    snap = UpSnapshot(
        elapsed_s=1.0,
        replicas=(status("r0", "starting", 5),),
        gateway_note="(gateway not yet available)",
    )
    assert "(gateway not yet available)" in rendered(snap)
    assert "gateway (gateway not yet available)" in plain_line(snap)


def test_the_plain_line_has_every_replica_and_the_figures() -> None:
    line = plain_line(SNAP)
    assert "\n" not in line
    assert "r0 running pid=101 port=9000 restarts=0 routing=ready" in line
    assert "r1 backoff pid=- port=9001 restarts=2" in line
    assert "TTFT p50 19ms p99 40ms" in line
    assert "answered ok 90, failed 1, dropped 1" in line


def test_the_summary_lists_pids_and_any_process_left_behind() -> None:
    clean = summary(SNAP, pids=[101, 102], left_behind=[])
    assert "  pids: 101 102" in clean and clean[-1] == "  all processes stopped"
    assert "r1 (restarts 2)" in clean[1]
    assert "  crash of r1 with 3 request(s) in flight (3 streaming): 3 migrated, ..." in clean
    dirty = summary(SNAP, pids=[101, 102], left_behind=[102])
    assert dirty[-1] == "  STILL RUNNING (not stopped): 102"


def test_a_restart_asked_for_during_a_backoff_is_not_shown() -> None:
    """`restart_refused (already restarting ...)` read like a problem; it is the
    supervisor doing what was asked. Real events are still shown."""
    s = status("r1", "backoff", None, restarts=1)
    assert describe(ReplicaEvent("restart_refused", s, "already restarting (asked: x)")) is None
    assert describe(ReplicaEvent("exited", s, "exited with code 1")) == (
        "r1 exited (exited with code 1)"
    )
