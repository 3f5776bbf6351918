"""What the fleet monitor keeps per replica and per failure domain, between two events.

Owns the shell's own records: `ReplicaSpec` (what to monitor), `TrackedReplica` (the
state machine's state, the rules' `ReplicaSignals`, the stateful detectors, the tasks),
`TrackedDomain` (a node, or a replica's own domain: cordon, evidence, GPU health) and
`TransitionRecord` (the history the admin API shows). Lives apart from the monitor so
that the presenter (`present.py`) reads the same records without importing the monitor.

Must not decide anything (the rules are `seawall.policy.replica_rules`) or do I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from seawall.actuate.base import Evidence, ReplicaRef
from seawall.fleet.adapters import Adapter
from seawall.fleet.gpu import HEALTHY, DcgmSample, GpuHealth
from seawall.fleet.view import EngineLoad
from seawall.policy.health import State
from seawall.policy.ledger import failure_domain
from seawall.policy.replica_rules import ReplicaSignals
from seawall.policy.score import ScoreBreakdown
from seawall.policy.storm import StormDetector
from seawall.policy.watchdog import ProgressWatchdog


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica to monitor. `model=""` asks GET /v1/models once. `node=None`: no
    node known, so the replica is its own failure domain (see `policy.ledger`)."""

    replica_id: str
    url: str
    model: str = ""
    node: str | None = None
    engine: str = "auto"  # auto | vllm | vllm_legacy | sglang | tgi | llamacpp | openai
    pod: str | None = None
    namespace: str | None = None
    uid: str | None = None  # the pod's uid (EndpointSlice targetRef): deletes are fenced by it
    pool: str = "default"  # the group of replicas it fails with (seawall.config.PoolConfig)
    # At most one deep probe this often (a remote pool's GPUs are someone else's).
    deep_probe_min_interval_s: float | None = None

    @property
    def domain(self) -> str:
        return failure_domain(self.node, self.replica_id)

    def ref(self, model: str = "") -> ReplicaRef:
        return ReplicaRef(
            self.replica_id,
            self.url,
            self.node,
            model or self.model,
            self.pod,
            self.namespace,
            self.uid,
        )


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """One state change, kept for `describe()` (the admin API shows the last few)."""

    at: float  # monotonic seconds
    at_wall: float  # unix seconds, for people
    replica_id: str
    event: str
    before: str
    after: str
    reason: str


@dataclass(eq=False)
class TrackedReplica:
    spec: ReplicaSpec
    signals: ReplicaSignals
    watchdog: ProgressWatchdog
    storm: StormDetector
    state: State = State.starting
    reason: str = "started; waiting for the first healthy probe"
    model: str = ""
    held: bool = False  # operator drain without restart
    adapter: Adapter | None = None
    scrape_note: str = ""
    load: EngineLoad | None = None
    # Its engine gives no load view (no /metrics, or one no adapter reads): admission has
    # only the gateway's own counts there. False until a scrape says so: a replica whose
    # first scrape has not answered yet is not one without metrics.
    no_metrics: bool = False
    slots: int | None = None  # the engine's batch slots, once learnt (0: it has none to say)
    breakdown: ScoreBreakdown | None = None
    restarts: int = 0  # real restarts: the actuator restarted something
    failures: int = 0  # failures that restarted nothing (actuator `none`)
    generation: int = 0  # bumped on restart: results from before are discarded
    action: asyncio.Task[None] | None = None
    action_kind: str = ""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    verifying: bool = False  # the readmitting deep probe is out


@dataclass(eq=False)
class TrackedDomain:
    name: str  # a node name, or `replica:<id>`
    cordoned: bool = False
    since_wall: float | None = None
    evidence: Evidence | None = None
    gpu: GpuHealth = HEALTHY
    dcgm_previous: DcgmSample | None = None
    task: asyncio.Task[None] | None = None
