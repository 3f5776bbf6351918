"""The restart ledger keeps restarts and cordons across a monitor restart."""

from __future__ import annotations

from pathlib import Path

from seawall.actuate.base import Evidence
from seawall.state.ledger import RestartLedger, RestartRecord


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
