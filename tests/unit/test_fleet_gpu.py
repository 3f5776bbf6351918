"""DCGM signals: which GPU faults drain a node, which only restart the app, which warn."""

from __future__ import annotations

import pytest

from seawall.fleet.gpu import XID_ACTIONS, XidAction, assess, parse_dcgm

LABELS = 'gpu="{gpu}",UUID="GPU-{gpu}",device="nvidia{gpu}",modelName="NVIDIA H100",Hostname="n1"'


def scrape(**per_gpu: dict[str, float]) -> str:
    """`scrape(g0={"DCGM_FI_DEV_XID_ERRORS": 79})` -> exporter-shaped text."""
    lines = ["# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered."]
    for key, fields in per_gpu.items():
        gpu = key.removeprefix("g")
        for name, value in fields.items():
            lines.append(f"{name}{{{LABELS.format(gpu=gpu)}}} {value}")
    return "\n".join(lines) + "\n"


XID = "DCGM_FI_DEV_XID_ERRORS"


def test_clean_gpus_are_healthy() -> None:
    health = assess(parse_dcgm(scrape(g0={XID: 0}, g1={XID: 0})))
    assert not health.fatal
    assert health.reasons == health.restart_app == health.warnings == ()


@pytest.mark.parametrize("xid", [48, 64, 74, 79, 95, 119, 120])
def test_hardware_xids_drain_the_node(xid: int) -> None:
    health = assess(parse_dcgm(scrape(g0={XID: 0}, g3={XID: xid})))
    assert health.fatal
    assert health.reasons == (f"gpu 3: xid {xid}",)


@pytest.mark.parametrize("xid", [13, 31, 43, 45])
def test_application_xids_restart_the_app_once_and_never_drain(xid: int) -> None:
    before = parse_dcgm(scrape(g0={XID: 0}))
    after = parse_dcgm(scrape(g0={XID: xid}))
    first = assess(after, before)
    assert not first.fatal
    assert first.restart_app == (f"gpu 0: xid {xid}",)
    # The gauge keeps its last value: the next scrape must not restart again.
    assert assess(after, after).restart_app == ()


@pytest.mark.parametrize("xid", [63, 92, 94])
def test_recorded_and_trending_xids_only_warn(xid: int) -> None:
    health = assess(parse_dcgm(scrape(g0={XID: xid})))
    assert not health.fatal
    assert health.warnings == (f"gpu 0: xid {xid}",)


def test_xid_154_follows_the_reported_recovery_action() -> None:
    action = "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION"
    reboot = assess(parse_dcgm(scrape(g0={XID: 154, action: 2})))
    assert reboot.fatal and reboot.reasons == ("gpu 0: xid 154: recovery action node_reboot",)
    none = assess(parse_dcgm(scrape(g0={XID: 154, action: 0})))
    assert not none.fatal
    unknown = assess(parse_dcgm(scrape(g0={XID: 154})))
    assert unknown.fatal


def test_ecc_double_bit_and_row_remap_failure_are_fatal() -> None:
    dbe = assess(parse_dcgm(scrape(g1={XID: 0, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2})))
    assert dbe.reasons == ("gpu 1: 2 volatile double-bit ECC errors",)
    remap = assess(parse_dcgm(scrape(g0={"DCGM_FI_DEV_ROW_REMAP_FAILURE": 1})))
    assert remap.fatal


def test_growing_nvlink_errors_warn_without_draining() -> None:
    name = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
    before = parse_dcgm(scrape(g0={name: 10}))
    after = parse_dcgm(scrape(g0={name: 14}))
    health = assess(after, before)
    assert not health.fatal
    assert health.warnings == (f"gpu 0: {name} +4",)
    assert assess(after, after).warnings == ()


def test_every_xid_the_reference_names_is_in_the_one_table() -> None:
    named = {13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154}
    assert set(XID_ACTIONS) == named
    assert {x for x, a in XID_ACTIONS.items() if a is XidAction.RESTART_APP} == {13, 31, 43, 45}
