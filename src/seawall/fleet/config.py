"""The fleet monitor's configuration: the `fleet:` section of the gateway config.

Every default is documented here, once, with why it has that value. Replicas themselves
(URL, model, node, engine kind) are listed in the gateway config's `replicas:` (see
`seawall.config.ReplicaConfig`) or found by `discovery`.

Must not do I/O: it validates values only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveSeconds = Annotated[float, Field(gt=0)]
EngineChoice = Literal["auto", "vllm", "vllm_legacy", "sglang", "tgi", "llamacpp", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DiscoveryConfig(_Strict):
    """Find replicas behind a Kubernetes headless Service instead of listing them."""

    # `dns`: A records of `service.namespace.svc` (no RBAC needed, no node names, so
    # every replica is its own failure domain for the restart ledger). `endpointslices`:
    # the API server, which also names each pod and its node (needs RBAC).
    mode: Literal["dns", "endpointslices"] = "dns"
    service: str
    namespace: str = "default"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    interval_s: PositiveSeconds = 5.0  # pods come and go on the scale of seconds
    model: str | None = None  # served model name; None: asked from GET /v1/models
    # The public name clients ask for and /v1/models lists, when it is not the served one
    # (gateway/aliases.py): the shipped manifests' `qwen3-8b`.
    model_name: str | None = None
    engine: EngineChoice = "auto"


class FleetMonitorConfig(_Strict):
    actuator: Literal["none", "local", "kubernetes"] = "none"  # none: route around only

    # Liveness: GET /health. 1 s so that a dead engine leaves routing within a second.
    liveness_interval_s: PositiveSeconds = 1.0
    liveness_timeout_s: PositiveSeconds = 1.0
    liveness_path: str = "/health"  # what vLLM, SGLang, TGI and llama.cpp all serve
    # The first failure already takes the replica out of routing; this many in a row
    # count as `health_failed` (a restart), so one lost packet does not restart it.
    liveness_failures_threshold: Annotated[int, Field(ge=1)] = 2
    # Loading weights and compiling can take many minutes, during which vLLM refuses
    # connections: a replica never yet healthy is `starting`, not failed, this long.
    startup_allowance_s: PositiveSeconds = 600.0

    # /metrics scrape through the engine adapter; also feeds the watchdog and storm.
    scrape_interval_s: PositiveSeconds = 1.0
    scrape_timeout_s: PositiveSeconds = 1.0

    # Deep probe: a real one-token completion, the only probe that proves generation.
    # Busy replicas prove themselves by relaying tokens, so they are probed less often
    # than idle ones, which have no other evidence.
    deep_probe_interval_s: PositiveSeconds = 5.0  # replicas with traffic
    deep_probe_idle_interval_s: PositiveSeconds = 2.5  # replicas without traffic
    deep_probe_jitter: Annotated[float, Field(ge=0, le=1)] = 0.2  # +-20%: no lockstep
    deep_probe_timeout_s: PositiveSeconds = 5.0
    deep_probe_path: str = "/v1/completions"
    # Consecutive failures that make one `deep_probe_failed_n` event (ready -> degraded;
    # a second streak while degraded -> restart).
    deep_probe_failures_threshold: Annotated[int, Field(ge=1)] = 3
    deep_probe_window: Annotated[int, Field(ge=1)] = 20  # probes in the success ratio

    # A probe that timed out while the monitor's own event loop (the gateway's) stalled
    # for at least this fraction of its timeout is inconclusive, not a failure: we were
    # late, not the replica. A quarter: a busy but healthy loop stalls milliseconds.
    probe_lag_spoils_fraction: Annotated[float, Field(gt=0, le=1)] = 0.25

    # Progress watchdog: work in flight and no token for this long means stuck. Long
    # enough for the slowest legitimate prefill (a long prompt under load).
    watchdog_window_s: PositiveSeconds = 60.0

    # Preemption storm: above this rate for `storm_sustain_s` -> degraded; at or below
    # half of it for `storm_clear_s` -> ready again (see seawall.policy.storm).
    storm_rate_threshold_per_s: Annotated[float, Field(ge=0)] = 1.0
    storm_sustain_s: Annotated[float, Field(ge=0)] = 30.0
    storm_clear_s: Annotated[float, Field(ge=0)] = 60.0

    # Engine queue (waiting requests) over this: degraded and saturated, so admission
    # holds new work rather than stacking it behind a full batch.
    ready_waiting_threshold: Annotated[float, Field(gt=0)] = 32.0

    # Restarts: drain waits this long for in-flight streams before restarting anyway.
    drain_timeout_s: PositiveSeconds = 30.0
    # K restarts on one node within the window -> cordon it and open a hardware ticket.
    restart_limit: Annotated[int, Field(ge=1)] = 3
    restart_window_s: PositiveSeconds = 3600.0
    ledger_path: str = "seawall-ledger.sqlite"  # ":memory:" keeps nothing across restarts

    # Hardware tickets: always a log line and the `hardware_tickets` metric; also a JSON
    # POST with the evidence when a webhook is set.
    hardware_ticket_webhook_url: str | None = None
    webhook_timeout_s: PositiveSeconds = 5.0

    # DCGM exporter per node: node name -> full metrics URL (http://host:9400/metrics).
    dcgm: dict[str, str] = Field(default_factory=dict)
    dcgm_interval_s: PositiveSeconds = 5.0
    dcgm_timeout_s: PositiveSeconds = 2.0

    discovery: DiscoveryConfig | None = None

    @model_validator(mode="after")
    def _timeouts_fit(self) -> FleetMonitorConfig:
        if self.liveness_timeout_s > self.startup_allowance_s:
            raise ValueError("liveness_timeout_s must not exceed startup_allowance_s")
        if not self.liveness_path.startswith("/"):
            raise ValueError("liveness_path must start with '/', e.g. /health")
        return self
