"""What every gateway instance heartbeats: who it is and what it has in flight, per replica.

Owns `InstanceReport` and `ReplicaReport` and their encoding (orjson, versioned). The
leader sums these over the live instances: a restart-drain waits until no instance has
anything in flight on the replica, and the watchdog sees every instance's streams and
relayed chunks, not only its own.

Seams for features built on this (fill them, the transport carries them as they are):
- `ReplicaReport.demand`: what this instance holds of the replica and would like of it,
  per resource (the keys below); the leader reads it to size per-instance grants
  (`policy.quota`, `gateway/fleet_quota.py`). `*_held` is what it has reserved there
  now; `*_wanted` adds what waits in its admission queue or was refused for room in the
  last few seconds. KV in blocks (at the reserve level its admission uses), sequences
  in requests.
- `InstanceReport.extra`: any further per-instance figures (e.g. retry-budget spend).

`view_epoch`/`view_seq` say which published view the instance applied last: the leader
waits for reports that have seen a change (a replica out of routing) before trusting
their zero in-flight counts.

Must not: read the clock (the caller stamps `sent_wall`) or do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

REPORT_VERSION = 1

# `ReplicaReport.demand` keys (see the module docstring).
KV_HELD = "kv_held"
KV_WANTED = "kv_wanted"
SEQS_HELD = "seqs_held"
SEQS_WANTED = "seqs_wanted"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One instance's own counts for one replica (its in-flight ledger and EWMAs)."""

    requests: int = 0
    streams: int = 0
    kv_blocks: int = 0
    chunks_relayed: int = 0  # cumulative, since the instance started
    ttft_ewma_s: float | None = None
    itl_ewma_s: float | None = None
    error_ewma: float = 0.0
    demand: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InstanceReport:
    instance: str
    admin_url: str = ""
    role: str = "follower"
    view_epoch: int = 0
    view_seq: int = 0
    sent_wall: float = 0.0
    replicas: Mapping[str, ReplicaReport] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def view_applied(self) -> tuple[int, int]:
        return (self.view_epoch, self.view_seq)


def encode_report(report: InstanceReport) -> bytes:
    return orjson.dumps(
        {
            "v": REPORT_VERSION,
            "instance": report.instance,
            "admin_url": report.admin_url,
            "role": report.role,
            "view": [report.view_epoch, report.view_seq],
            "sent_wall": report.sent_wall,
            "replicas": {
                rid: {
                    "requests": r.requests,
                    "streams": r.streams,
                    "kv_blocks": r.kv_blocks,
                    "chunks": r.chunks_relayed,
                    "ttft": r.ttft_ewma_s,
                    "itl": r.itl_ewma_s,
                    "err": r.error_ewma,
                    "demand": dict(r.demand),
                }
                for rid, r in report.replicas.items()
            },
            "extra": dict(report.extra),
        }
    )


def decode_report(raw: bytes) -> InstanceReport:
    """A report; raises ValueError for one this version cannot read."""
    try:
        d = orjson.loads(raw)
        if d.get("v") != REPORT_VERSION:
            raise ValueError(f"report version {d.get('v')!r}")
        epoch, seq = d.get("view", [0, 0])
        return InstanceReport(
            instance=str(d["instance"]),
            admin_url=str(d.get("admin_url", "")),
            role=str(d.get("role", "follower")),
            view_epoch=int(epoch),
            view_seq=int(seq),
            sent_wall=float(d.get("sent_wall", 0.0)),
            replicas={
                str(rid): ReplicaReport(
                    requests=int(r["requests"]),
                    streams=int(r["streams"]),
                    kv_blocks=int(r["kv_blocks"]),
                    chunks_relayed=int(r["chunks"]),
                    ttft_ewma_s=r.get("ttft"),
                    itl_ewma_s=r.get("itl"),
                    error_ewma=float(r.get("err", 0.0)),
                    demand={str(k): float(v) for k, v in (r.get("demand") or {}).items()},
                )
                for rid, r in d.get("replicas", {}).items()
            },
            extra=dict(d.get("extra") or {}),
        )
    except (KeyError, TypeError, orjson.JSONDecodeError) as e:
        raise ValueError(f"unreadable instance report: {e!r}") from None
