"""The restart ledger keeps restarts and cordons across a monitor restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from seawall.actuate.base import Evidence
from seawall.state.ledger import RecordKind, RestartLedger, RestartRecord


async def test_restarts_are_found_by_node_and_time_window(tmp_path: Path) -> None:
    ledger = RestartLedger(tmp_path / "ledger.sqlite")
    await ledger.record(RestartRecord(node="n1", replica_id="r1", reason="hang", at_wall=100.0))
    await ledger.record(
        RestartRecord(node="n1", replica_id="r2", reason="engine_dead", at_wall=200.0)
    )
    await ledger.record(RestartRecord(node="n2", replica_id="r3", reason="hang", at_wall=250.0))
    assert await ledger.restarts("n1", since_wall=150.0) == [
        RestartRecord(node="n1", replica_id="r2", reason="engine_dead", at_wall=200.0)
    ]
    assert [r.replica_id for r in await ledger.restarts("n1", since_wall=0.0)] == ["r1", "r2"]
    assert await ledger.restarts("n3", since_wall=0.0) == []
    await ledger.close()


async def test_records_and_cordons_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ledger.sqlite"
    first = RestartLedger(path)
    await first.record(RestartRecord(node="n1", replica_id="r1", reason="hang", at_wall=10.0))
    evidence = Evidence(
        node="n1",
        reasons=("3 restarts within 3600 s",),
        restarts=((10.0, "r1", "hang"),),
        extra={"xid": "79"},
    )
    await first.set_cordoned("n1", True, evidence)
    await first.close()

    second = RestartLedger(path)
    assert await second.restarts("n1", 0.0) == [
        RestartRecord(node="n1", replica_id="r1", reason="hang", at_wall=10.0)
    ]
    cordons = await second.cordoned_nodes()
    assert list(cordons) == ["n1"]
    assert cordons["n1"].evidence == evidence
    await second.set_cordoned("n1", False)
    await second.close()

    third = RestartLedger(path)
    assert await third.cordoned_nodes() == {}
    await third.close()


async def test_cordoning_twice_keeps_the_first_time(tmp_path: Path) -> None:
    ledger = RestartLedger()
    await ledger.set_cordoned("n1", True, Evidence("n1", ("first",)))
    since = (await ledger.cordoned_nodes())["n1"].since_wall
    await ledger.set_cordoned("n1", True, Evidence("n1", ("second",)))
    record = (await ledger.cordoned_nodes())["n1"]
    assert record.since_wall == since
    assert record.evidence.reasons == ("second",)
    await ledger.close()


async def test_failures_are_kept_apart_from_restarts(tmp_path: Path) -> None:
    ledger = RestartLedger(tmp_path / "ledger.sqlite")
    failure = RestartRecord("replica:r0", "r0", "health check failed", 10.0, RecordKind.failure)
    await ledger.record(failure)
    await ledger.record(RestartRecord("replica:r0", "r0", "stuck", 20.0))
    assert [r.reason for r in await ledger.restarts("replica:r0", 0.0)] == ["stuck"]
    assert await ledger.failures("replica:r0", 0.0) == [failure]
    await ledger.close()


async def test_an_uncordon_is_remembered(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = RestartLedger(path)
    assert await ledger.uncordoned_at("n1") is None
    await ledger.set_cordoned("n1", True, Evidence("n1", ("3 restarts",)))
    await ledger.set_cordoned("n1", False)
    at = await ledger.uncordoned_at("n1")
    await ledger.close()
    reopened = RestartLedger(path)
    assert at is not None and await reopened.uncordoned_at("n1") == at
    assert await reopened.cordoned_nodes() == {}
    await reopened.close()


async def test_a_version_1_ledger_keeps_its_rows_as_restarts(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE restarts (at_wall REAL NOT NULL, node TEXT NOT NULL,"
        " replica_id TEXT NOT NULL, reason TEXT NOT NULL);"
        "CREATE TABLE cordons (node TEXT PRIMARY KEY, since_wall REAL NOT NULL,"
        " evidence TEXT NOT NULL);"
        "INSERT INTO restarts VALUES (5.0, 'n1', 'r1', 'hang');"
        "PRAGMA user_version=1;"
    )
    db.close()
    ledger = RestartLedger(path)
    assert await ledger.restarts("n1", 0.0) == [RestartRecord("n1", "r1", "hang", 5.0)]
    await ledger.record(RestartRecord("n1", "r1", "hang", 6.0, RecordKind.failure))
    assert len(await ledger.failures("n1", 0.0)) == 1
    await ledger.close()


async def test_a_ledger_opened_by_the_release_before_and_then_this_one_again(
    tmp_path: Path,
) -> None:
    """A rollback and a roll forward: the release before (schema 1) opens a file this
    one wrote and sets user_version back to 1; this release must open it again, rows of
    both kinds intact (before: "duplicate column name: kind", and the gateway died)."""
    path = tmp_path / "ledger.sqlite"
    ledger = RestartLedger(path)
    await ledger.record(RestartRecord("n1", "r1", "hang", 5.0))
    await ledger.record(RestartRecord("n1", "r1", "crash", 6.0, RecordKind.failure))
    await ledger.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=1")  # what the release before does when it opens it
    db.close()
    again = RestartLedger(path)
    assert await again.restarts("n1", 0.0) == [RestartRecord("n1", "r1", "hang", 5.0)]
    assert len(await again.failures("n1", 0.0)) == 1
    await again.close()
