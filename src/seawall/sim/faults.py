"""Faults the emulator can be told to have: their JSON shape and the state they leave.

Owns: parsing a fault body (`POST /sim/fault`, or `--fault JSON` at start) into a frozen
value, and `FaultState`, the set of faults in force. Pure: no I/O, no asyncio, no clock;
the server reads this state and acts (exits, stops stepping, answers 503, ...).

Kinds (all fields optional unless said):
- `{"kind": "crash", "after_tokens": N, "after_s": S}`: exit at once (connections reset),
  or after N more generated tokens, or after S seconds.
- `{"kind": "engine_dead", "grace_s": 5.0}`: `/health` 503, requests 500 EngineDeadError,
  then the process exits after `grace_s` (vLLM's watchdog checks every 5 s).
- `{"kind": "hang", "running": "keep" | "zero"}`: no more steps; `/health` stays 200;
  `vllm:num_requests_running` keeps its value or drops to 0.
- `{"kind": "slow", "factor": k}`: every step takes k times longer.
- `{"kind": "errors", "rate": 0.5, "when": "before_first_token" | "mid_stream",
  "after_tokens": N}`: that fraction of new requests fails, with a 500 before the first
  token, or with a mid-stream error event after N tokens (default 1).
- `{"kind": "load_time", "seconds": S}`: at start only: the port is bound after S s.
- `{"kind": "dcgm", "gpu": 0, "xid": 79, "ecc_dbe": 1, "ecc_sbe": 0,
  "row_remap_failure": 1, "recovery_action": 2, "nvlink_crc_flit": 1,
  "fields": {"DCGM_FI_...": value}}`: set hardware signals of one GPU (default 0) on
  `/dcgm/metrics`.
- `{"kind": "clear"}`: every fault off, hardware signals back to healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


class FaultError(ValueError):
    """A fault body that does not parse (becomes a 400)."""


@dataclass(frozen=True, slots=True)
class Crash:
    after_tokens: int | None = None
    after_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineDead:
    grace_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Hang:
    running: Literal["keep", "zero"] = "keep"


@dataclass(frozen=True, slots=True)
class Slow:
    factor: float


@dataclass(frozen=True, slots=True)
class Errors:
    rate: float
    when: Literal["before_first_token", "mid_stream"] = "before_first_token"
    after_tokens: int = 1


@dataclass(frozen=True, slots=True)
class LoadTime:
    seconds: float


@dataclass(frozen=True, slots=True)
class Dcgm:
    fields: dict[str, float]
    gpu: int = 0


@dataclass(frozen=True, slots=True)
class Clear:
    pass


Fault = Crash | EngineDead | Hang | Slow | Errors | LoadTime | Dcgm | Clear

# dcgm-exporter default counters (etc/default-counters.csv) and their healthy values.
DCGM_FIELDS: dict[str, tuple[str, str, float]] = {
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered.", 0),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (
        "counter",
        "Total number of single-bit volatile ECC errors.",
        0,
    ),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (
        "counter",
        "Total number of double-bit volatile ECC errors.",
        0,
    ),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether remapping of rows has failed", 0),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "counter",
        "Number of remapped rows for uncorrectable errors",
        0,
    ),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": (
        "counter",
        "Number of remapped rows for correctable errors",
        0,
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries.", 0),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        0,
    ),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": (
        "counter",
        "Total number of NVLink data CRC errors.",
        0,
    ),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (
        "counter",
        "Total number of NVLink retries.",
        0,
    ),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (
        "counter",
        "Total number of NVLink recovery errors.",
        0,
    ),
    "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION": (
        "gauge",
        "GPU recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.",
        0,
    ),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C).", 41),
    "DCGM_FI_DEV_MEMORY_TEMP": ("gauge", "Memory temperature (in C).", 45),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W).", 95.0),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %).", 0),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Frame buffer memory free (in MB).", 8000),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Frame buffer memory used (in MB).", 73000),
}
_DCGM_SHORTCUTS = {
    "xid": "DCGM_FI_DEV_XID_ERRORS",
    "ecc_sbe": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "ecc_dbe": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "row_remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "uncorrectable_remapped_rows": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "pcie_replay": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "gpu_temp": "DCGM_FI_DEV_GPU_TEMP",
    "recovery_action": "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",
    "nvlink_crc_flit": "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "nvlink_crc_data": "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "nvlink_replay": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "nvlink_recovery": "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
}


def _number(body: dict[str, Any], key: str, *, minimum: float = 0.0) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise FaultError(f"'{key}' must be a number >= {minimum:g}")
    return float(value)


def parse_fault(body: Any) -> Fault:
    if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
        raise FaultError('a fault is a JSON object with a string "kind"')
    kind = body["kind"]
    if kind == "clear":
        return Clear()
    if kind == "crash":
        after_tokens = _number(body, "after_tokens")
        return Crash(
            after_tokens=None if after_tokens is None else int(after_tokens),
            after_s=_number(body, "after_s"),
        )
    if kind == "engine_dead":
        grace_s = _number(body, "grace_s")
        return EngineDead(grace_s=5.0 if grace_s is None else grace_s)
    if kind == "hang":
        running = body.get("running", "keep")
        if running not in ("keep", "zero"):
            raise FaultError('\'running\' must be "keep" or "zero"')
        return Hang(running=running)
    if kind == "slow":
        factor = _number(body, "factor", minimum=1e-9)
        if factor is None:
            raise FaultError("'slow' needs a 'factor'")
        return Slow(factor=factor)
    if kind == "errors":
        rate = _number(body, "rate")
        if rate is None or rate > 1.0:
            raise FaultError("'errors' needs a 'rate' in [0, 1]")
        when = body.get("when", "before_first_token")
        if when not in ("before_first_token", "mid_stream"):
            raise FaultError('\'when\' must be "before_first_token" or "mid_stream"')
        after = _number(body, "after_tokens", minimum=1)
        return Errors(rate=rate, when=when, after_tokens=1 if after is None else int(after))
    if kind == "load_time":
        seconds = _number(body, "seconds")
        if seconds is None:
            raise FaultError("'load_time' needs 'seconds'")
        return LoadTime(seconds=seconds)
    if kind == "dcgm":
        fields: dict[str, float] = {}
        for short, name in _DCGM_SHORTCUTS.items():
            value = _number(body, short)
            if value is not None:
                fields[name] = value
        extra = body.get("fields", {})
        if not isinstance(extra, dict):
            raise FaultError("'fields' must be an object of DCGM field name -> number")
        for name, value in extra.items():
            if name not in DCGM_FIELDS:
                raise FaultError(f"unknown DCGM field {name!r}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FaultError(f"DCGM field {name!r} must be a number")
            fields[name] = float(value)
        if not fields:
            raise FaultError("'dcgm' needs at least one field to set")
        gpu = _number(body, "gpu")
        return Dcgm(fields=fields, gpu=0 if gpu is None else int(gpu))
    raise FaultError(f"unknown fault kind {kind!r}")


def healthy_dcgm() -> dict[str, float]:
    return {name: float(default) for name, (_, _, default) in DCGM_FIELDS.items()}


@dataclass(slots=True)
class FaultState:
    """The faults in force. The server applies each change; `apply` only records it."""

    engine_dead: EngineDead | None = None
    hang: Hang | None = None
    slow_factor: float = 1.0
    errors: Errors | None = None
    crash: Crash | None = None
    # per GPU index: only GPUs a fault touched; the others read healthy_dcgm()
    dcgm: dict[int, dict[str, float]] = field(default_factory=dict)

    def apply(self, fault: Fault) -> None:
        match fault:
            case Clear():
                self.engine_dead = None
                self.hang = None
                self.slow_factor = 1.0
                self.errors = None
                self.crash = None
                self.dcgm = {}
            case Crash():
                self.crash = fault
            case EngineDead():
                self.engine_dead = fault
            case Hang():
                self.hang = fault
            case Slow(factor=factor):
                self.slow_factor = factor
            case Errors():
                self.errors = None if fault.rate == 0 else fault
            case LoadTime():
                pass  # only meaningful before the port is bound; the CLI handles it
            case Dcgm(fields=fields, gpu=gpu):
                self.dcgm.setdefault(gpu, healthy_dcgm()).update(fields)

    def dcgm_values(self, gpu: int) -> dict[str, float]:
        return dict(self.dcgm.get(gpu) or healthy_dcgm())


def error_draw(seed: int, ordinal: int) -> float:
    """A deterministic uniform draw in [0, 1) for the ordinal-th request under `errors`."""
    x = (seed * 0x9E3779B97F4A7C15 + ordinal * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x = (x ^ (x >> 31)) * 0x94D049BB133111EB & ((1 << 64) - 1)
    x ^= x >> 29
    return (x >> 11) / float(1 << 53)
