"""GPU signals from a DCGM-exporter scrape, and THE Xid table.

Owns: which DCGM fields Seawall reads, what each Xid means for the fleet (restart the
app, drain the node, or only warn), and the judgement `assess(current, previous)` that
turns two scrapes into a `GpuHealth`. Every other module asks this one; no Xid number
appears anywhere else.

Must not do I/O or read the clock: the monitor fetches the text and keeps the previous
sample. The rule here is pure so that it can be tested line by line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from seawall.fleet.adapters import parse_labelled


class XidAction(StrEnum):
    RESTART_APP = "restart_app"  # the application faulted; the GPU is fine: do not drain
    DRAIN_NODE = "drain_node"  # hardware: move work off, cordon, open a ticket
    WARN = "warn"  # recorded or trending: keep serving, watch the rate
    FOLLOW_RECOVERY_ACTION = "follow_recovery_action"  # Xid 154: the driver says what to do


# THE Xid table. Sources:
# - NVIDIA Xid catalog, "Resolution Bucket" column (RESTART_APP, RESET_GPU, ...):
#   https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
# - NVIDIA "A100 GPU memory error management" for row remapping and recovery actions.
# - Operator runbooks (plexus.company, ai-infrastructure.net, Modal's GPU-health page) for
#   48/79/94/95, whose catalog rows could not be read directly; see
#   docs/engines-reference.md §6. Re-check against the catalog when it changes.
XID_ACTIONS: Mapping[int, XidAction] = {
    13: XidAction.RESTART_APP,  # Graphics Engine Exception
    31: XidAction.RESTART_APP,  # GPU memory page fault
    43: XidAction.RESTART_APP,  # GPU stopped processing
    45: XidAction.RESTART_APP,  # preemptive cleanup after another fault
    48: XidAction.DRAIN_NODE,  # double-bit ECC error
    63: XidAction.WARN,  # row remap / page retirement recorded; takes effect on reset
    64: XidAction.DRAIN_NODE,  # row remap / page retirement failure
    74: XidAction.DRAIN_NODE,  # NVLink error
    79: XidAction.DRAIN_NODE,  # GPU has fallen off the bus: node reboot
    92: XidAction.WARN,  # high single-bit ECC rate: trend it
    94: XidAction.WARN,  # contained ECC error: the app restarts, watch the rate
    95: XidAction.DRAIN_NODE,  # uncontained ECC error: GPU reset
    119: XidAction.DRAIN_NODE,  # GSP RPC timeout
    120: XidAction.DRAIN_NODE,  # GSP error
    154: XidAction.FOLLOW_RECOVERY_ACTION,  # GPU recovery action changed
}

# NVML `nvmlDeviceGpuRecoveryAction_t`: NONE, GPU_RESET, NODE_REBOOT, DRAIN_P2P,
# DRAIN_AND_RESET. Anything but NONE takes the GPU out of service.
RECOVERY_ACTIONS: Mapping[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
}

XID = "DCGM_FI_DEV_XID_ERRORS"  # gauge: value of the LAST Xid, not a count
ECC_DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
UNCORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
# Exported by DCGM 3.3+ when enabled in the counters CSV; absent on older exporters.
RECOVERY_ACTION = "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION"
NVLINK_ERRORS = (
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
DCGM_METRICS: tuple[str, ...] = (
    XID,
    ECC_DBE_VOLATILE,
    ROW_REMAP_FAILURE,
    UNCORRECTABLE_REMAPPED_ROWS,
    RECOVERY_ACTION,
    *NVLINK_ERRORS,
)

_GPU_LABEL = re.compile(r'(?:^|,)gpu="([^"]*)"')


@dataclass(frozen=True, slots=True)
class DcgmSample:
    """One scrape: field name -> GPU index -> value."""

    fields: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def get(self, name: str, gpu: str) -> float | None:
        return self.fields.get(name, {}).get(gpu)

    def gpus(self) -> tuple[str, ...]:
        return tuple(sorted({g for per_gpu in self.fields.values() for g in per_gpu}))


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """The node's GPUs, judged. `fatal`: drain the node and cordon it."""

    fatal: bool
    reasons: tuple[str, ...] = ()  # why fatal (empty when not)
    restart_app: tuple[str, ...] = ()  # new application-class Xids: restart, do not drain
    warnings: tuple[str, ...] = ()


HEALTHY = GpuHealth(fatal=False)


def parse_dcgm(text: str) -> DcgmSample:
    labelled = parse_labelled(text, frozenset(DCGM_METRICS))
    fields: dict[str, dict[str, float]] = {}
    for name, children in labelled.items():
        per_gpu = fields.setdefault(name, {})
        for labels, value in children:
            m = _GPU_LABEL.search(labels)
            per_gpu[m.group(1) if m else "?"] = value
    return DcgmSample(fields)


def xid_action(xid: int) -> XidAction | None:
    return XID_ACTIONS.get(xid)


def assess(current: DcgmSample, previous: DcgmSample | None = None) -> GpuHealth:
    """Judge one scrape; `previous` turns the last-Xid gauge and counters into events.

    The Xid gauge keeps its last value forever, so a RESTART_APP Xid is acted on only
    when it changes (a restart must not loop). Hardware Xids are fatal while they show:
    the node needs a reset or reboot, which also clears the gauge.
    """
    fatal: list[str] = []
    restart: list[str] = []
    warn: list[str] = []
    for gpu in current.gpus():
        xid_value = current.get(XID, gpu)
        xid = int(xid_value) if xid_value else 0
        before = previous.get(XID, gpu) if previous is not None else None
        is_new = previous is not None and int(before or 0) != xid
        if xid:
            action = XID_ACTIONS.get(xid)
            label = f"gpu {gpu}: xid {xid}"
            if action is XidAction.DRAIN_NODE:
                fatal.append(label)
            elif action is XidAction.RESTART_APP:
                if is_new:
                    restart.append(label)
            elif action is XidAction.WARN:
                warn.append(label)
            elif action is XidAction.FOLLOW_RECOVERY_ACTION:
                _recovery(current.get(RECOVERY_ACTION, gpu), label, fatal, warn)
            elif is_new:
                warn.append(f"{label} (not in the Xid table)")
        recovery = current.get(RECOVERY_ACTION, gpu)
        if recovery and xid != 154:
            _recovery(recovery, f"gpu {gpu}", fatal, warn)
        dbe = current.get(ECC_DBE_VOLATILE, gpu)
        if dbe:
            fatal.append(f"gpu {gpu}: {int(dbe)} volatile double-bit ECC errors")
        if current.get(ROW_REMAP_FAILURE, gpu):
            fatal.append(f"gpu {gpu}: row remapping failed")
        if previous is not None:
            for name in (UNCORRECTABLE_REMAPPED_ROWS, *NVLINK_ERRORS):
                now_v, before_v = current.get(name, gpu), previous.get(name, gpu)
                if now_v is not None and before_v is not None and now_v > before_v:
                    warn.append(f"gpu {gpu}: {name} +{int(now_v - before_v)}")
    return GpuHealth(
        fatal=bool(fatal), reasons=tuple(fatal), restart_app=tuple(restart), warnings=tuple(warn)
    )


def _recovery(value: float | None, label: str, fatal: list[str], warn: list[str]) -> None:
    if value is None:
        # Xid 154 says a recovery action is required but the exporter does not show
        # which: take the GPU out of service rather than keep routing to it.
        fatal.append(f"{label}: recovery action required (not exported)")
        return
    action = RECOVERY_ACTIONS.get(int(value), f"unknown({int(value)})")
    if action == "none":
        warn.append(f"{label}: recovery action none")
    else:
        fatal.append(f"{label}: recovery action {action}")
