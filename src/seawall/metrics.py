"""The gateway's and the fleet monitor's Prometheus metrics: every family, in one place.

Alert rules, the Grafana dashboard, the drift check and the status page all name these
families, so a rename here is a rename everywhere: tests check that each of those
consumers only uses names that exist here or in an engine's scrape.

Each `Gateway` gets its own registry (tests run several in one process); `Metrics`
holds the families for one registry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.samples import Sample

from seawall.fastmetrics import Children, FastHistogram
from seawall.gateway.outcomes import ATTEMPT_RULES, Attempt, StreamEnd

# Seconds. TTFT through a gateway is the engine's TTFT plus the hop, so the buckets
# reach down to the milliseconds the hop costs and up to the engine's worst case.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SHED_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

# Names, so consumers (alerts, dashboard, drift check) import rather than retype them.
REQUESTS = "seawall_requests_total"
TTFT = "seawall_ttft_seconds"
ITL = "seawall_itl_seconds"
E2E = "seawall_e2e_seconds"
INFLIGHT = "seawall_inflight_requests"
UPSTREAM_ATTEMPTS = "seawall_upstream_attempts_total"
UPSTREAM_CONNECTIONS = "seawall_upstream_connections_opened_total"
RETRIES = "seawall_retries_total"
RETRY_BUDGET = "seawall_retry_budget_tokens"
RETRY_BUDGET_EXHAUSTED = "seawall_retry_budget_exhausted_total"
HEDGES = "seawall_hedges_total"
TIMEOUTS = "seawall_timeouts_total"
CANCELLATIONS = "seawall_client_cancellations_total"
SHED = "seawall_shed_total"
SHED_LATENCY = "seawall_shed_latency_seconds"
QUEUE_DEPTH = "seawall_admission_queue_depth"
ADMISSION_RESERVE_LEVEL = "seawall_admission_reserve_level"
RATELIMIT_BACKEND_DEGRADED = "seawall_ratelimit_backend_degraded"
RATELIMIT_INSTANCES = "seawall_ratelimit_instances"
REPLICA_STATE = "seawall_replica_state"
REPLICA_SCORE = "seawall_replica_health_score"
REPLICA_SCORE_PART = "seawall_replica_health_score_part"
REPLICA_READY = "seawall_replica_ready"
DEEP_PROBE_FAILURES = "seawall_deep_probe_failures_total"
RESTARTS = "seawall_replica_restarts_total"
NODE_CORDONED = "seawall_node_cordoned"
HARDWARE_TICKETS = "seawall_hardware_tickets_total"
MIGRATIONS = "seawall_migrations_total"
STREAM_ERRORS = "seawall_stream_errors_total"
DRAINING = "seawall_draining"
CLUSTER_ROLE = "seawall_cluster_role"
CLUSTER_FAIL_STATIC = "seawall_cluster_fail_static"
CLUSTER_INSTANCES = "seawall_cluster_instances"
FLEET_VIEW_AGE = "seawall_fleet_view_age_seconds"
# pools (issue 16), registered below;
# `seawall budget --from-prometheus` reads them (ops/budget_prom.py).
REPLICA_POOL = "seawall_replica_pool"  # {replica, pool} = 1: which pool a replica is in
POOL_INFO = "seawall_pool_info"  # {pool, priority, mode} = 1
POOL_ROUTABLE = "seawall_pool_routable_replicas"  # {pool, model}
POOL_SERVING = "seawall_pool_serving"  # {pool, model}: 1 for the pool serving the model now
POOL_FAILOVERS = "seawall_pool_failovers_total"  # {model, from_pool, to_pool}
POOL_FAILBACKS = "seawall_pool_failbacks_total"  # {model, from_pool, to_pool}

# Label values the gateway and the fleet monitor write, known before any event happens.
# `Metrics.seed` creates these series at zero: a labelled series that is born at its
# first event shows "No data" instead of 0 on a dashboard, and `increase()` cannot see
# that first event (a series that starts at 1 has no earlier sample to rise from).
# upstream.py's `AttemptFailed` outcomes, plus those proxy.py records itself.
# The outcome and reason label values are the outcome enums' own (gateway/outcomes.py).
ATTEMPT_OUTCOMES = tuple(a.value for a in Attempt)
RETRY_REASONS = tuple(a.value for a, rule in ATTEMPT_RULES.items() if rule.retryable)
HEDGE_OUTCOMES = ("launched", "won", "lost")
TIMEOUT_KINDS = ("ttft", "itl", "total")
CANCEL_STAGES = ("queued", "before_first_token", "streaming", "non_streaming")
SHED_REASONS = (
    "tier_limit",
    "requests_per_min",
    "prompt_tokens_per_min",
    "max_concurrent",
    "backend_unavailable",
    "fleet_saturated",
    "queue_timeout",
)
MIGRATION_OUTCOMES = ("ok", "failed", "refused")
STREAM_ERROR_REASONS = tuple(e.value for e in StreamEnd if e is not StreamEnd.done)
ROUTES = ("completions", "chat")
# The status every route answers first; other statuses appear with their first answer.
SEEDED_STATUS = "200"
# A request without an API key (no tenants configured) is counted as this tenant and tier.
ANONYMOUS_TENANT = "default"
DEFAULT_TIER = "default"


def restart_reasons() -> tuple[str, ...]:
    """The `reason` label of `seawall_replica_restarts_total`: every health transition
    that restarts a replica (policy/health.py), as the fleet monitor labels it."""
    from seawall.policy.health import TRANSITIONS, Action

    return tuple(
        sorted(
            {
                t.reason.split(":", 1)[0][:60]
                for t in TRANSITIONS.values()
                if Action.restart in t.actions
            }
        )
    )


class Metrics:
    """All families, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None, process: bool = True) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._seeded_replicas: set[str] = set()
        self._restart_reasons = restart_reasons()
        if process:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            REQUESTS[: -len("_total")],
            "Requests answered by the gateway, by model, route and HTTP status.",
            ["model", "route", "status"],
            registry=r,
        )
        # Observed once per request (ttft, e2e) or per chunk (itl): the lock-free kind.
        self.ttft = FastHistogram(
            TTFT,
            "Time to first token as the client sees it through the gateway.",
            ["model"],
            TTFT_BUCKETS_S,
            r,
        )
        self.itl = FastHistogram(
            ITL,
            "Gap between consecutive streamed chunks relayed to the client.",
            ["model"],
            ITL_BUCKETS_S,
            r,
        )
        self.e2e = FastHistogram(
            E2E,
            "Whole request duration as the client sees it.",
            ["model"],
            E2E_BUCKETS_S,
            r,
        )
        self.inflight = Gauge(
            INFLIGHT,
            "Requests in flight from the gateway to each replica.",
            ["replica"],
            registry=r,
        )
        self.upstream_connections = Counter(
            UPSTREAM_CONNECTIONS[: -len("_total")],
            "Connections opened to each replica by the request path. Streams read to the end "
            "leave theirs for the next request; one cut short (client left, timeout, a lost "
            "hedge) closes it, so the engine aborts the request.",
            ["replica"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            UPSTREAM_ATTEMPTS[: -len("_total")],
            "Upstream attempts by replica and outcome (ok, connect_error, reset, http_5xx, "
            "http_429, redirect, ttft_timeout, cancelled, hedge_lost).",
            ["replica", "outcome"],
            registry=r,
        )
        # The request path's per-request increments, without `labels()` each time.
        self.requests_of: Children[Counter] = Children(self.requests)
        self.attempts_of: Children[Counter] = Children(self.upstream_attempts)
        self.retries = Counter(
            RETRIES[: -len("_total")],
            "Retries on another replica before the first token, by cause.",
            ["reason"],
            registry=r,
        )
        self.retry_budget = Gauge(
            RETRY_BUDGET, "Retry budget tokens available now (fleet-wide).", registry=r
        )
        self.retry_budget_exhausted = Counter(
            RETRY_BUDGET_EXHAUSTED[: -len("_total")],
            "Retries or hedges refused because the retry budget was empty.",
            registry=r,
        )
        self.hedges = Counter(
            HEDGES[: -len("_total")],
            "Hedged requests by outcome (launched, won, lost).",
            ["outcome"],
            registry=r,
        )
        self.timeouts = Counter(
            TIMEOUTS[: -len("_total")],
            "Timeouts by kind: ttft (no first token), itl (idle between chunks), total.",
            ["kind"],
            registry=r,
        )
        self.cancellations = Counter(
            CANCELLATIONS[: -len("_total")],
            "Clients that went away, by the stage they left at (queued, before_first_token, "
            "streaming, non_streaming).",
            ["stage"],
            registry=r,
        )
        self.shed = Counter(
            SHED[: -len("_total")],
            "Requests refused at the door, by tenant, tier and reason.",
            ["tenant", "tier", "reason"],
            registry=r,
        )
        self.shed_latency = Histogram(
            SHED_LATENCY,
            "Time to answer a shed request (429/503 at the door).",
            buckets=SHED_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_depth = Gauge(
            QUEUE_DEPTH,
            "Requests waiting for a replica to leave saturation.",
            ["model"],
            registry=r,
        )
        self.admission_reserve_level = Gauge(
            ADMISSION_RESERVE_LEVEL,
            "Adaptive admission's reserve level per replica: 1 reserves prompt + max_tokens "
            "(worst case), 0 the learned mean output, below 0 overcommits by its spread; "
            "`cause` says why it is there (calm, loosening, preemptions, outgrown, progress, "
            "near_full).",
            ["replica", "cause"],
            registry=r,
        )
        self.ratelimit_backend_degraded = Gauge(
            RATELIMIT_BACKEND_DEGRADED,
            "1 while the shared rate-limit backend (Redis) is unreachable and the configured "
            "failure mode is in force.",
            registry=r,
        )
        self.ratelimit_instances = Gauge(
            RATELIMIT_INSTANCES,
            "Gateway instances this one counts as sharing the tenant limits, itself "
            "included: a fail-open fallback holds 1/N of each limit (the cluster's count, or "
            "without one, the instances beating in Redis; 1 for per-process limits).",
            registry=r,
        )
        self.replica_state = Gauge(
            REPLICA_STATE,
            "1 for the replica's current state, 0 for the others.",
            ["replica", "node", "state"],
            registry=r,
        )
        self.replica_score = Gauge(
            REPLICA_SCORE, "Health score in (0, 1]; routing weighs by it.", ["replica"], registry=r
        )
        self.replica_score_part = Gauge(
            REPLICA_SCORE_PART,
            "Each factor of the health score (1 = no penalty).",
            ["replica", "part"],
            registry=r,
        )
        self.replica_ready = Gauge(
            REPLICA_READY, "1 while the replica receives new requests.", ["replica"], registry=r
        )
        self.deep_probe_failures = Counter(
            DEEP_PROBE_FAILURES[: -len("_total")],
            "Deep (one-token) probes that failed, by replica.",
            ["replica"],
            registry=r,
        )
        self.restarts = Counter(
            RESTARTS[: -len("_total")],
            "Replica restarts by node and reason.",
            ["node", "reason"],
            registry=r,
        )
        self.node_cordoned = Gauge(
            NODE_CORDONED, "1 while the node is cordoned.", ["node"], registry=r
        )
        self.hardware_tickets = Counter(
            HARDWARE_TICKETS[: -len("_total")],
            "Hardware tickets emitted when a node was cordoned.",
            ["node"],
            registry=r,
        )
        self.migrations = Counter(
            MIGRATIONS[: -len("_total")],
            "Mid-stream migrations by outcome (ok, failed, refused).",
            ["outcome"],
            registry=r,
        )
        self.draining = Gauge(DRAINING, "1 while the gateway is draining.", registry=r)
        self.stream_errors = Counter(
            STREAM_ERRORS[: -len("_total")],
            "Streams that reached the client and then ended with an error event "
            "(dropped streams), by cause.",
            ["reason"],
            registry=r,
        )
        # Pools (gateway/pools.py): where each model is served, and its moves.
        self.replica_pool = Gauge(
            REPLICA_POOL, "1 for the pool each replica is in.", ["replica", "pool"], registry=r
        )
        self.pool_info = Gauge(
            POOL_INFO,
            "1 for each pool, with its priority and mode.",
            ["pool", "priority", "mode"],
            registry=r,
        )
        self.pool_routable = Gauge(
            POOL_ROUTABLE,
            "Replicas of the pool serving the model that may take new work now.",
            ["pool", "model"],
            registry=r,
        )
        self.pool_serving = Gauge(
            POOL_SERVING, "1 for the pool serving the model now.", ["pool", "model"], registry=r
        )
        self.pool_failovers = Counter(
            POOL_FAILOVERS[: -len("_total")],
            "A model's traffic moved to a later pool (its pool had no routable replica).",
            ["model", "from_pool", "to_pool"],
            registry=r,
        )
        self.pool_failbacks = Counter(
            POOL_FAILBACKS[: -len("_total")],
            "A model's traffic moved back to a better pool (healthy long enough).",
            ["model", "from_pool", "to_pool"],
            registry=r,
        )
        # Several gateway instances, one fleet (seawall.cluster).
        self.cluster_role = Gauge(
            CLUSTER_ROLE,
            "1 for this instance's role in the fleet (leader or follower), 0 for the other.",
            ["role"],
            registry=r,
        )
        self.cluster_fail_static = Gauge(
            CLUSTER_FAIL_STATIC,
            "1 while this instance serves on a fleet view it cannot refresh (the cluster "
            "store or the leader is gone).",
            registry=r,
        )
        self.cluster_instances = Gauge(
            CLUSTER_INSTANCES, "Live gateway instances in the fleet, this one included.", registry=r
        )
        self.fleet_view_age = Gauge(
            FLEET_VIEW_AGE,
            "Age of the fleet view this instance routes by (0 on the leader).",
            registry=r,
        )

    def seed(
        self,
        *,
        replicas: Iterable[tuple[str, str]] = (),
        models: Iterable[str] = (),
        tenants: Mapping[str, str] | None = None,
        pools: Iterable[str] = (),
    ) -> None:
        """Create every series the gateway can name in advance, at zero, and forget the
        per-replica series of replicas seeded before and gone now.

        `replicas`: (replica id, node) pairs; `tenants`: tenant -> tier (None or empty:
        the anonymous tenant of an open gateway); `pools`: the pools replicas are in
        (every model's moves between any two of them: a pool loss is rare, and
        `increase()` over a series born at 1 would miss it). Idempotent and cheap: the
        gateway calls it at start and on every scrape, so replicas added or removed since,
        and models discovered since, are covered. Existing values are never changed.
        """
        replica_nodes = dict(replicas)
        pool_names = list(pools)
        for replica_id, node in replica_nodes.items():
            self.upstream_connections.labels(replica_id)
            self.deep_probe_failures.labels(replica_id)
            for outcome in ATTEMPT_OUTCOMES:
                self.upstream_attempts.labels(replica_id, outcome)
            self.node_cordoned.labels(node)
            self.hardware_tickets.labels(node)
            for reason in self._restart_reasons:
                self.restarts.labels(node, reason)
        for replica_id in self._seeded_replicas - set(replica_nodes):
            self._forget_replica(replica_id)
        self._seeded_replicas = set(replica_nodes)
        for model in models:
            for route in ROUTES:
                self.requests.labels(model, route, SEEDED_STATUS)
            self.queue_depth.labels(model)
            self.ttft.labels(model)
            self.e2e.labels(model)
            for a, b in itertools.permutations(pool_names, 2):
                self.pool_failovers.labels(model, a, b)
                self.pool_failbacks.labels(model, a, b)
        for tenant, tier in (tenants or {ANONYMOUS_TENANT: DEFAULT_TIER}).items():
            for reason in SHED_REASONS:
                self.shed.labels(tenant, tier, reason)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for outcome in HEDGE_OUTCOMES:
            self.hedges.labels(outcome)
        for kind in TIMEOUT_KINDS:
            self.timeouts.labels(kind)
        for stage in CANCEL_STAGES:
            self.cancellations.labels(stage)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        for reason in STREAM_ERROR_REASONS:
            self.stream_errors.labels(reason)

    def _forget_replica(self, replica_id: str) -> None:
        """Drop a departed replica's series (pod IPs churn; kept forever they would grow
        the scrape without bound). Its in-flight gauge is the gateway's to remove."""
        for family in (self.upstream_connections, self.deep_probe_failures):
            family.remove(replica_id)
        for outcome in _label_values(self.upstream_attempts, "replica", replica_id, "outcome"):
            self.upstream_attempts.remove(replica_id, outcome)
        self.attempts_of.clear()

    def record_shed(self, tenant: str, tier: str, reason: str, latency_s: float) -> None:
        """A request refused at the door, and how long refusing it took."""
        self.shed.labels(tenant, tier, reason).inc()
        self.shed_latency.observe(latency_s)


def _samples(family: Counter | Gauge) -> list[Sample]:
    return [s for metric in family.collect() for s in metric.samples]


def _label_values(family: Counter | Gauge, key: str, value: str, other: str) -> set[str]:
    return {
        s.labels[other]
        for s in _samples(family)
        if s.labels.get(key) == value and other in s.labels and s.name.endswith("_total")
    }
