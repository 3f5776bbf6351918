"""Validated gateway configuration. Every default is documented here, once.

The file is YAML. Unknown keys are errors (a typo must not silently fall back to a
default), and every error names the field, what was given and what is allowed. Every
section, tenants, tiers, rate limits, admission and the fleet monitor's included, is a
typed model validated in one pass when the file is parsed: a gateway loads its
configuration once, and a bad value fails `seawall serve` before anything starts.
The fleet monitor's own section lives in `seawall.fleet.config`, beside the code that
reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from yarl import URL

from seawall import envref
from seawall.auth import is_key_hash
from seawall.fleet.config import FleetMonitorConfig
from seawall.policy.adaptive_admission import ControlConfig
from seawall.policy.admission import AdmissionThresholds
from seawall.policy.limits import TierLimits
from seawall.policy.pools import TierPools
from seawall.protocol.routes import Route

DEFAULT_TIER = "default"
DEFAULT_POOL = "default"

PositiveSeconds = Annotated[float, Field(gt=0)]
EngineKind = Literal["auto", "vllm", "sglang", "tgi", "llamacpp", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaConfig(_Strict):
    url: str  # base URL, e.g. http://127.0.0.1:8001 (no trailing /v1)
    model: str | None = None  # served model name; None: discovered from GET /v1/models
    # The hardware this replica shares with others (a machine, a GPU host): K restarts
    # within the window on one node cordon it. None: the replica is its own failure
    # domain, so one replica's failures never take another out of service.
    node: str | None = None
    # Stable name in metrics and logs; default "r<index>". A reload matches replicas by
    # it: without ids, removing one renumbers the ones after it (each then drains and
    # joins again), so give replicas ids where reloads change the list.
    id: str | None = None
    # The pool (a region, a cluster, a hardware class: replicas that fail together) this
    # replica belongs to; pools are defined under `pools:` ("default" always exists).
    pool: str = "default"
    engine: EngineKind = "auto"
    # Sent upstream as a bearer token; never logged, nor shown in the config's repr.
    api_key: str | None = Field(default=None, repr=False)
    # The public name clients ask for (LiteLLM's `model_name`), when it is not the served
    # `model`: routing, limits, metrics and logs use it, and the request sent to this
    # replica carries `model` (see gateway/aliases.py). None: clients use `model`.
    model_name: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or not URL(v).host:
            raise ValueError("must be an http:// or https:// URL with a host")
        return v.rstrip("/")


# `model_list`: LiteLLM's shape for the same thing as `replicas`, so a LiteLLM proxy config's
# deployments can be pasted in. Each entry is one replica; the entries that share a
# `model_name` are the pool behind that public name. How it maps:
#   model_name               -> ReplicaConfig.model_name (the public name)
#   litellm_params.model     -> ReplicaConfig.model (served; a `hosted_vllm/` or `openai/`
#                               provider prefix is dropped, as LiteLLM drops it upstream)
#   litellm_params.api_base  -> ReplicaConfig.url (a trailing `/v1` is dropped)
#   litellm_params.api_key   -> ReplicaConfig.api_key (`os.environ/NAME` works here too)
#   model_info.id            -> ReplicaConfig.id
# LiteLLM's other per-deployment settings (rpm, tpm, timeout, ...) are not taken: they are
# errors naming the allowed fields, and Seawall's tiers and timeouts do those jobs.
_PROVIDER_PREFIXES: dict[str, EngineKind] = {"hosted_vllm/": "vllm", "openai/": "auto"}


class LiteLLMParams(_Strict):
    model: Annotated[str, Field(min_length=1)]
    api_base: str
    api_key: str | None = Field(default=None, repr=False)


class ModelInfo(_Strict):
    id: str | None = None
    node: str | None = None  # Seawall's own: the replica's failure domain (see ReplicaConfig)


class ModelListEntry(_Strict):
    model_name: Annotated[str, Field(min_length=1)]
    litellm_params: LiteLLMParams
    model_info: ModelInfo = ModelInfo()

    def replica(self) -> ReplicaConfig:
        served: str = self.litellm_params.model
        engine: EngineKind = "auto"
        for prefix, kind in _PROVIDER_PREFIXES.items():
            if served.startswith(prefix):
                served, engine = served[len(prefix) :], kind
                break
        url = self.litellm_params.api_base.rstrip("/").removesuffix("/v1")
        return ReplicaConfig(
            url=url,
            model=served,
            model_name=None if served == self.model_name else self.model_name,
            id=self.model_info.id,
            node=self.model_info.node,
            engine=engine,
            api_key=self.litellm_params.api_key,
        )


class Timeouts(_Strict):
    """The three timeouts. Before the first token each is a retryable failure."""

    ttft_s: PositiveSeconds = 30.0  # request sent -> first token chunk
    itl_s: PositiveSeconds = 15.0  # gap between two chunks once streaming
    total_s: PositiveSeconds = 600.0  # whole request, queueing included


class TimeoutOverrides(_Strict):
    ttft_s: PositiveSeconds | None = None
    itl_s: PositiveSeconds | None = None
    total_s: PositiveSeconds | None = None

    def apply(self, base: Timeouts) -> Timeouts:
        return Timeouts(
            ttft_s=self.ttft_s or base.ttft_s,
            itl_s=self.itl_s or base.itl_s,
            total_s=self.total_s or base.total_s,
        )


class RetryConfig(_Strict):
    """Retries happen only before the first token, on a replica not yet tried."""

    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3  # first try included
    budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1  # each success earns this much
    budget_min_per_s: Annotated[float, Field(ge=0)] = 1.0  # reserve refill for idle gateways
    budget_reserve_window_s: PositiveSeconds = 10.0  # reserve holds min_per_s * this
    # Earned tokens expire this long after the success that earned them (Finagle's and
    # tower's TTL, 10 s there too): a long healthy stretch cannot bank an allowance that
    # a sudden failure would spend all at once.
    budget_ttl_s: PositiveSeconds = 10.0
    budget_max_balance: Annotated[float, Field(ge=0)] = 100.0  # cap on earned tokens
    eject_s: PositiveSeconds = 2.0  # a replica refusing connections is skipped this long
    max_migrations: Annotated[int, Field(ge=0, le=5)] = 2  # mid-stream, for tiers that opt in
    # A continuation that gives no token within this is abandoned (the stream then ends
    # cleanly): a replica with room prefills it within a few seconds, one that would
    # queue it (every slot busy) would stall the client's stream for the whole ttft_s.
    migration_ttft_s: PositiveSeconds = 4.0


class HedgeConfig(_Strict):
    """Off by default: a hedge doubles engine work for the requests it covers."""

    enabled: bool = False
    delay_s: PositiveSeconds = 0.1  # no first token after this long -> second copy
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 512  # only short prompts
    max_fleet_load: Annotated[float, Field(gt=0, le=1)] = 0.5  # only a lightly loaded fleet


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080


class LimitsConfig(_Strict):
    max_body_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024


class DrainConfig(_Strict):
    timeout_s: PositiveSeconds = 30.0  # in-flight streams get this long after SIGTERM
    retry_after_s: PositiveSeconds = 5.0  # told to clients refused while draining


class AdminConfig(_Strict):
    """The admin API listens on its own port with its own credential."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8081
    token_hash: str | None = None  # "sha256:<hex>" of the admin token (seawall keys new)


class ServerConfig(_Strict):
    """How the client listener treats connections, before any request reaches the
    OpenAI routes (`gateway/frontdoor.py` enforces it; its docstring says why each
    rule exists). A connection "has a valid key" once a request on it carried one;
    until then it is unauthenticated, and unauthenticated connections have tighter caps,
    so a flood without a key can never take the room kept for tenants."""

    # Connection open (or, between requests, the first byte of the next one) -> the
    # request's headers complete. A slow-header client is answered 408 and closed.
    header_timeout_s: PositiveSeconds = 10.0
    # Headers complete -> the whole body received. 4 MiB in 30 s is 140 KB/s.
    body_timeout_s: PositiveSeconds = 30.0
    # An idle connection between two requests is closed after this (aiohttp: 3,630 s).
    keepalive_timeout_s: PositiveSeconds = 30.0
    # Every client connection. Also bounded by the descriptor limit: at most
    # (soft limit - fd_reserve) / 2, since each may hold an upstream connection too.
    max_connections: Annotated[int, Field(ge=16)] = 4096
    # Connections that have not yet sent a valid key. At either cap a new connection
    # evicts the longest-waiting idle one of its kind; if none is idle it is refused
    # with 503. With no tenants configured (no keys) both default to max_connections:
    # one address is then often a balancer carrying every client.
    max_unauthenticated_connections: Annotated[int, Field(ge=1)] = 1024
    max_unauthenticated_per_address: Annotated[int, Field(ge=1)] = 128
    # Descriptors never given to client connections: the admin port, replicas, Redis,
    # the ledger, logs. The soft descriptor limit is raised to the hard one at start.
    fd_reserve: Annotated[int, Field(ge=32)] = 256

    @model_validator(mode="after")
    def _caps_nest(self) -> ServerConfig:
        if self.max_unauthenticated_connections > self.max_connections:
            raise ValueError("max_unauthenticated_connections must be <= max_connections")
        if self.max_unauthenticated_per_address > self.max_unauthenticated_connections:
            raise ValueError(
                "max_unauthenticated_per_address must be <= max_unauthenticated_connections"
            )
        return self


class MetricsConfig(_Strict):
    """Who may read the gateway's own `/metrics` on the client port. Its labels name
    tenants, tiers, models and replicas: one tenant must not learn another's name.

    "auto" (the default) is "public" when no tenants are configured (an open gateway has
    nobody to hide from) and "credential" otherwise. "credential" asks for a bearer token
    whose hash is `token_hash` (a scrape-only credential, so Prometheus need not hold the
    admin levers) or `admin.token_hash`; without either, nobody can read it."""

    access: Literal["auto", "public", "credential"] = "auto"
    token_hash: str | None = None  # "sha256:<hex>" (seawall keys new --tenant prometheus)


class TierPoolsConfig(_Strict):
    """How a tier uses pools (see policy/pools.py)."""

    order: list[str] = Field(default_factory=list)  # its own pool order; [] = by priority
    overflow: bool = True  # to the next pool when its pool is saturated
    failover: bool = True  # to the next pool when its pool has no routable replica

    def policy(self) -> TierPools:
        return TierPools(tuple(self.order), self.overflow, self.failover)


class TierConfig(_Strict):
    priority: Annotated[int, Field(ge=0)] = 0  # 0 is the most important; larger sheds first
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # ceiling on max_tokens
    max_tokens_default: Annotated[int, Field(ge=1)] = 1024  # when the request has none
    max_tokens_mode: Literal["reject", "clamp"] = "reject"
    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    prompt_tokens_per_min: Annotated[int, Field(ge=1)] | None = None
    requests_per_min: Annotated[int, Field(ge=1)] | None = None
    timeouts: TimeoutOverrides | None = None
    migrate: bool = False  # continue a stream on another replica when its replica dies
    # Which pools the tier may use, and whether it may leave its first one: a free tier
    # may be shed rather than sent across regions ({overflow: false, failover: false}).
    pools: TierPoolsConfig = TierPoolsConfig()
    # Bodies larger than this are refused (413) before any token is counted. None: derived
    # from max_prompt_tokens (protocol/tokens.py `max_prompt_bytes`: 10 bytes per token
    # + 64 KiB for the rest of the body); no bound without max_prompt_tokens.
    max_prompt_bytes: Annotated[int, Field(ge=1024)] | None = None
    # Structured output (response_format json_schema, structured_outputs, text.format...;
    # protocol/structured.py): a constraint's JSON nodes and nesting depth, as the grammar
    # each decode step advances grows with them. Over either: 400 before anything is sent.
    max_schema_nodes: Annotated[int, Field(ge=1)] | None = None
    max_schema_depth: Annotated[int, Field(ge=1)] | None = None
    # The bulkhead: replica ids that serve this tier's grammar-constrained requests (and
    # only those take them); plain requests of every tier avoid these replicas while any
    # other replica of the model is usable. None: constrained requests go anywhere.
    grammar_replicas: list[str] | None = None

    def prompt_bytes_limit(self) -> int | None:
        """The byte bound the door applies to this tier's request bodies."""
        from seawall.protocol.tokens import max_prompt_bytes

        return self.max_prompt_bytes or max_prompt_bytes(self.max_prompt_tokens)

    def limits(self) -> TierLimits:
        default = self.max_tokens_default
        if self.max_tokens is not None:
            default = min(default, self.max_tokens)
        return TierLimits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens_max=self.max_tokens,
            max_tokens_default=default,
            max_tokens_mode=self.max_tokens_mode,
            max_concurrent=self.max_concurrent,
            prompt_tokens_per_min=self.prompt_tokens_per_min,
            requests_per_min=self.requests_per_min,
            priority=self.priority,
        )


class TenantConfig(_Strict):
    tier: str = DEFAULT_TIER
    api_key_hashes: list[str] = Field(default_factory=list)  # from `seawall keys new`

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes_only(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if not is_key_hash(k):
                raise ValueError(
                    "keys must be hashes ('sha256:<64 hex>', printed by `seawall keys new`); "
                    "never put a raw API key in the configuration"
                )
        return keys


class RateLimitConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", repr=False)  # may hold a password
    fail_mode: Literal["open", "closed"] = "open"  # when Redis is unreachable
    key_prefix: str = "seawall:limits:"


_ADAPTIVE = ControlConfig()  # the defaults, documented once in policy/adaptive_admission.py


class AdaptiveAdmissionConfig(_Strict):
    """`admission.adaptive`: the adaptive KV controller. Every rule and default is explained
    in policy/adaptive_admission.py (ControlConfig); the names are the same."""

    kv_target: Annotated[float, Field(gt=0, le=2)] = _ADAPTIVE.kv_target
    kv_high: Annotated[float, Field(gt=0, le=1)] = _ADAPTIVE.kv_high
    tier_step: Annotated[float, Field(ge=0, lt=1)] = _ADAPTIVE.tier_step
    min_reserve: Annotated[float, Field(ge=-1, le=1)] = _ADAPTIVE.min_reserve
    spread_z: Annotated[float, Field(ge=0)] = _ADAPTIVE.spread_z
    preemption_budget_per_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.preemption_budget_per_s
    preemption_window_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.preemption_window_s
    tighten_step: Annotated[float, Field(gt=0, le=1)] = _ADAPTIVE.tighten_step
    tighten_interval_s: Annotated[float, Field(ge=0)] = _ADAPTIVE.tighten_interval_s
    loosen_per_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.loosen_per_s
    calm_s: Annotated[float, Field(ge=0)] = _ADAPTIVE.calm_s
    outgrown_at: Annotated[float, Field(gt=0, le=1)] = _ADAPTIVE.outgrown_at
    overrun_ratio: Annotated[float, Field(ge=1)] = _ADAPTIVE.overrun_ratio
    progress_floor: Annotated[float, Field(ge=0, le=1)] = _ADAPTIVE.progress_floor
    fresh_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.fresh_s
    lookahead_s: Annotated[float, Field(ge=0)] = _ADAPTIVE.lookahead_s
    hold_lookahead_s: Annotated[float, Field(ge=0)] = _ADAPTIVE.hold_lookahead_s
    hold_while_resuming: bool = _ADAPTIVE.hold_while_resuming
    min_retry_after_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.min_retry_after_s
    min_exact_retry_after_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.min_exact_retry_after_s
    max_retry_after_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.max_retry_after_s
    trend_tau_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.trend_tau_s
    completion_window_s: Annotated[float, Field(gt=0)] = _ADAPTIVE.completion_window_s
    length_alpha: Annotated[float, Field(gt=0, le=1)] = 0.05  # weight of each new completion
    length_min_samples: Annotated[int, Field(ge=1)] = 1  # before a key's estimate is used
    # The first completions are the shortest (the long ones still run): the mean is shrunk
    # toward max_tokens as if this many had run to it (policy: OutputLengths.estimate).
    length_prior_samples: Annotated[float, Field(ge=0)] = 0.5

    def control(self, metrics_max_age_s: float) -> ControlConfig:
        fields = self.model_dump(
            exclude={"length_alpha", "length_min_samples", "length_prior_samples"}
        )
        fields["fresh_s"] = min(self.fresh_s, metrics_max_age_s / 2)
        return ControlConfig(**fields, metrics_max_age_s=metrics_max_age_s)


class AdmissionConfig(_Strict):
    enabled: bool = True
    # "adaptive" (default): reserve KV on learned output lengths, corrected by the engine's
    # gauges (admission.adaptive); it equals "reserve" on traffic that runs to max_tokens
    # and keeps the throughput "reserve" gives away when requests stop at EOS. "reserve":
    # every request reserves prompt + max_tokens (kv_reserve_max below). Either way, an
    # engine that exports no KV cache size falls back to the thresholds below.
    mode: Literal["adaptive", "reserve"] = "adaptive"
    adaptive: AdaptiveAdmissionConfig = Field(default_factory=AdaptiveAdmissionConfig)
    kv_usage_max: Annotated[float, Field(gt=0, le=1)] = 0.9
    waiting_max: Annotated[float, Field(ge=0)] = 5
    preemption_rate_max_per_s: Annotated[float, Field(gt=0)] = 2.0
    metrics_max_age_s: Annotated[float, Field(gt=0)] = 5.0
    inflight_max: Annotated[int, Field(ge=1)] | None = None  # per replica, gateway's own count
    # In-flight prompt + max_tokens may reserve this fraction of a replica's KV cache (read
    # from vLLM's cache_config_info); 1.0 = no preemption even if all run to max_tokens,
    # more overcommits on requests stopping early; null disables. See policy/admission.py.
    kv_reserve_max: Annotated[float, Field(gt=0)] | None = 1.0
    queue_max: Annotated[int, Field(ge=0)] = 64
    queue_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    lowest_priority_to_queue: Annotated[int, Field(ge=0)] = 0
    # A request refused this many times for a saturated fleet (the same tenant sending
    # the same body again) takes its turn ahead of fresh requests of its tier, so that
    # clients already served cannot keep the room to themselves (policy.admission).
    # How, by `turns`: `hold` (the default) refuses it again with a Retry-After but holds
    # the room it needs (fresh requests fit beside it) until it comes back (or, unseen
    # for its Retry-After, at most queue_timeout_s, + `turn_grace_s`, it is taken to
    # have given up), so it starts at once and nothing waits in the gateway (the first
    # owed one back takes the room, or, once one is owed longer than queue_timeout_s,
    # the oldest alone);
    # `queue` makes its next attempt wait in the queue (within queue_max and
    # queue_timeout_s), for clients that stop retrying early (the OpenAI SDKs retry
    # twice). 0: every refusal is final, and nobody takes turns.
    queue_after_refusals: Annotated[int, Field(ge=0)] = 2
    turns: Literal["hold", "queue"] = "hold"
    turn_grace_s: Annotated[float, Field(gt=0)] = 1.0
    tokenizers: dict[str, str] = Field(default_factory=dict)  # model -> tokenizer.json

    def thresholds(self) -> AdmissionThresholds:
        return AdmissionThresholds(
            kv_usage_max=self.kv_usage_max,
            waiting_max=self.waiting_max,
            preemption_rate_max_per_s=self.preemption_rate_max_per_s,
            metrics_max_age_s=self.metrics_max_age_s,
            inflight_max=self.inflight_max,
        )

    @property
    def reserves_kv(self) -> bool:
        return self.enabled and (self.kv_reserve_max is not None or self.mode == "adaptive")


class ClusterConfig(_Strict):
    """Several gateway instances, one fleet: one elected leader probes, decides and acts;
    the others follow its published view (see `seawall.cluster`). Off by default: a
    single instance with `store: none` leads itself, exactly as before."""

    # Where instances share leadership, the fleet view and the restart ledger: `none`
    # (a single instance), `redis` (instances anywhere; `redis_url`), or `local` (several
    # processes on one host, through the store server at `local_socket`).
    store: Literal["none", "redis", "local"] = "none"
    # May hold ${REDIS_PASSWORD} (envref): kept out of the config's repr.
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", repr=False)
    key_prefix: str = "seawall:cluster:"  # every key the cluster writes is under it
    local_socket: str = "seawall-cluster.sock"  # relative to the working directory
    # Who leads: the store's own lease (`store`), or a coordination.k8s.io Lease
    # (`kubernetes`; needs RBAC on leases; the state still lives in `store`).
    election: Literal["store", "kubernetes"] = "store"
    # Whether this instance stands for election. false: it only follows (it never
    # probes, decides or acts; it needs only to read the lease), for instances that hold
    # no actuator: the serving pods beside a separate actuator Deployment, or the
    # `seawall up --gateways` followers beside the gateway that owns the supervisor.
    may_lead: bool = True
    lease_name: str = "seawall-fleet-leader"
    lease_namespace: str = "default"  # in Kubernetes, set it to the gateway's namespace
    # This instance's name in the fleet. None: $POD_NAME, else "<hostname>-<pid>".
    instance_id: str | None = None
    # Where other instances reach this one's admin API (operator actions sent to a
    # follower are forwarded to the leader's). None: the admin API's own host and port,
    # with $POD_IP (else the hostname) in place of a wildcard host such as 0.0.0.0.
    advertise_admin_url: str | None = None

    # Leadership. A leader that dies is replaced within lease_ttl_s + renew_interval_s
    # (5 s with these defaults; a clean shutdown hands over within renew_interval_s). A
    # leader that cannot renew stops acting after lease_ttl_s - renew_interval_s (3 s),
    # before anyone else may start. Kubernetes Leases count whole seconds (rounded up).
    lease_ttl_s: PositiveSeconds = 4.0
    renew_interval_s: PositiveSeconds = 1.0
    # Membership: every instance reports its in-flight counts this often, and an
    # instance that stops reporting leaves the fleet after member_ttl_s.
    heartbeat_interval_s: PositiveSeconds = 0.5
    member_ttl_s: PositiveSeconds = 3.0
    # The fleet view: the leader publishes every change (at most every
    # min_publish_interval_s) and at least every publish_interval_s; followers read it
    # every view_poll_interval_s. A follower whose view is older than view_stale_s is
    # fail-static (it says so in /readyz and the metrics, and keeps serving on it).
    publish_interval_s: PositiveSeconds = 1.0
    min_publish_interval_s: PositiveSeconds = 0.05
    view_poll_interval_s: PositiveSeconds = 0.25
    view_stale_s: PositiveSeconds = 3.0
    store_timeout_s: PositiveSeconds = 0.5  # one store call, before it counts as down

    # Passive outlier detection on followers (which probe nothing themselves), Envoy's
    # consecutive-failure rule: this many replica faults in a row from the requests an
    # instance relays eject that replica from its routing for outlier_ejection_s, twice
    # as long at each repeat up to outlier_max_ejection_s, and never more than
    # outlier_max_ejected_fraction of a model's replicas at once.
    outlier_consecutive_failures: Annotated[int, Field(ge=1)] = 5
    outlier_ejection_s: PositiveSeconds = 5.0
    outlier_max_ejection_s: PositiveSeconds = 60.0
    outlier_max_ejected_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5

    @model_validator(mode="after")
    def _coherent(self) -> ClusterConfig:
        if self.election == "kubernetes" and self.store == "none":
            raise ValueError(
                "cluster.election: kubernetes needs a shared store for the fleet view and "
                "the ledger (cluster.store: redis or local)"
            )
        if self.renew_interval_s * 2 > self.lease_ttl_s:
            raise ValueError(
                "cluster.lease_ttl_s must be at least twice cluster.renew_interval_s "
                "(a leader steps down after lease_ttl_s - renew_interval_s without renewal)"
            )
        if self.heartbeat_interval_s * 2 > self.member_ttl_s:
            raise ValueError(
                "cluster.member_ttl_s must be at least twice cluster.heartbeat_interval_s"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.store != "none"


class TelemetryConfig(_Strict):
    """OpenTelemetry traces, exported over OTLP/HTTP. Off by default, and then nothing of
    OpenTelemetry is imported or run; W3C trace context (`traceparent`, `tracestate`) is
    forwarded to the replicas either way. Needs the `otel` extra (pip install
    'seawall[otel]'). See gateway/telemetry.py for the spans and their attributes."""

    enabled: bool = False
    # The collector's OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces.
    # None: the OpenTelemetry exporter's own default, i.e. OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    # else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else http://localhost:4318/v1/traces.
    endpoint: str | None = None
    # Sent with every export (a collector's API key: write it as os.environ/NAME). Never logged.
    headers: dict[str, str] = Field(default_factory=dict)
    service_name: Annotated[str, Field(min_length=1)] = "seawall-gateway"
    # Traces that start at the gateway are kept at this ratio; a client's own sampling
    # decision (the traceparent's sampled flag) is always followed.
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    export_interval_s: PositiveSeconds = 2.0  # spans are batched and sent this often
    export_timeout_s: PositiveSeconds = 10.0  # one export; a dead collector costs no more


class LoggingConfig(_Strict):
    """The gateway's log on stderr. `json`: one object per line, every record (access
    records carry their fields as keys; see seawall/logs.py). `seawall serve
    --log-format` and `--log-level` win over these."""

    format: Literal["text", "json"] = "text"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    access_log: bool = True  # one record per request (`--no-access-log` turns it off)


class BreakerConfig(_Strict):
    """A circuit breaker on a whole pool (policy/circuit.py): for a remote pool reached
    through one address, whose replicas are not ours to see."""

    failures: Annotated[int, Field(ge=1)] = 5  # consecutive failed attempts open it
    open_s: PositiveSeconds = 10.0  # then one trial request after this long


class PoolConfig(_Strict):
    """A group of replicas that fail together. Traffic stays in the highest-priority pool
    that can serve a model; see policy/pools.py for overflow, failover and failback."""

    priority: Annotated[int, Field(ge=0)] = 0  # 0 is served first
    # passive: no traffic while a pool before it can serve, except the deep probes and
    # warm-up that keep it proven (a standby region).
    mode: Literal["active", "passive"] = "active"
    # A remote pool's own timeouts (a WAN hop and another gateway's queue: a higher TTFT
    # budget); unset ones come from the route and tier.
    timeouts: TimeoutOverrides | None = None
    breaker: BreakerConfig | None = None  # None: no breaker (local replicas are probed)
    # At most one deep probe per replica this often: a remote pool's GPUs are someone
    # else's, and a probe is real work for them. None: the fleet monitor's own intervals.
    deep_probe_min_interval_s: PositiveSeconds | None = None


class FailoverConfig(_Strict):
    """When the serving pool of a model moves (policy/pools.py). Requests that cannot be
    served in their pool go on at once when their tier allows it; these hold the *pool
    state* steady, so that one bad probe does not move a region's traffic."""

    after_s: PositiveSeconds = 2.0  # the serving pool down this long: fail over
    failback_after_s: PositiveSeconds = 30.0  # a better pool up this long: fail back
    # Told to a request whose tier may not leave its pool, when the pool has no
    # routable replica: roughly how long a replica takes to be readmitted.
    retry_after_s: PositiveSeconds = 10.0


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    # LiteLLM's shape (see ModelListEntry): merged into `replicas`, after those listed
    # there, when the file is validated; never written back out (`exclude`).
    model_list: list[ModelListEntry] = Field(default_factory=list, exclude=True)
    timeouts: Timeouts = Timeouts()
    routes: dict[Route, TimeoutOverrides] = Field(default_factory=dict)
    retry: RetryConfig = RetryConfig()
    hedging: HedgeConfig = HedgeConfig()
    limits: LimitsConfig = LimitsConfig()
    drain: DrainConfig = DrainConfig()
    admin: AdminConfig = AdminConfig()
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # The `default` tier always exists (requests of an open gateway get it); configure
    # it like any other to change its limits.
    tiers: dict[str, TierConfig] = Field(default_factory=dict)
    admission: AdmissionConfig = AdmissionConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    fleet: FleetMonitorConfig = FleetMonitorConfig()
    cluster: ClusterConfig = ClusterConfig()
    # Pools of replicas (regions, clusters, hardware classes); "default" always exists.
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    failover: FailoverConfig = FailoverConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int | None = None  # for the balancer's random choices; None = from the OS

    @model_validator(mode="after")
    def _admin_needs_a_credential(self) -> GatewayConfig:
        if self.admin.enabled and not self.admin.token_hash:
            raise ValueError(
                "admin.enabled needs admin.token_hash (the admin API has its own credential; "
                "make one with `seawall keys new --tenant admin`)"
            )
        return self

    @model_validator(mode="after")
    def _default_tier(self) -> GatewayConfig:
        if DEFAULT_TIER not in self.tiers:
            # Frozen model: set the field on the validated instance itself.
            object.__setattr__(self, "tiers", {**self.tiers, DEFAULT_TIER: TierConfig()})
        for name, t in self.tenants.items():
            if t.tier not in self.tiers:
                raise ValueError(
                    f"tenants.{name}.tier: unknown tier {t.tier!r}; "
                    f"defined tiers: {sorted(self.tiers)}"
                )
        return self

    @model_validator(mode="after")
    def _merge_model_list(self) -> GatewayConfig:
        if self.model_list:
            merged = [*self.replicas, *(entry.replica() for entry in self.model_list)]
            object.__setattr__(self, "replicas", merged)
            object.__setattr__(self, "model_list", [])
            # A dump of the set fields (`seawall serve` merges its flags that way) keeps them.
            self.__pydantic_fields_set__.add("replicas")
        return self

    @model_validator(mode="after")
    def _known_pools(self) -> GatewayConfig:
        if DEFAULT_POOL not in self.pools:
            object.__setattr__(self, "pools", {**self.pools, DEFAULT_POOL: PoolConfig()})
        for i, r in enumerate(self.replicas):
            if r.pool not in self.pools:
                raise ValueError(
                    f"replicas.{i}.pool: unknown pool {r.pool!r}; defined pools: "
                    f"{sorted(self.pools)}"
                )
        for name, t in self.tiers.items():
            unknown = [p for p in t.pools.order if p not in self.pools]
            if unknown:
                raise ValueError(
                    f"tiers.{name}.pools.order: unknown pools {unknown}; defined pools: "
                    f"{sorted(self.pools)}"
                )
        return self

    @model_validator(mode="after")
    def _grammar_replicas_exist(self) -> GatewayConfig:
        if self.fleet.discovery is not None:
            return self  # discovered replicas' ids (their addresses) are not known yet
        known = {r.id or f"r{i}" for i, r in enumerate(self.replicas)}
        for name, tier in self.tiers.items():
            unknown = sorted(set(tier.grammar_replicas or ()) - known)
            if unknown:
                raise ValueError(
                    f"tiers.{name}.grammar_replicas: unknown replica ids {unknown}; "
                    f"configured replicas: {sorted(known)}"
                )
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> GatewayConfig:
        ids = [r.id for r in self.replicas if r.id]
        dupes = {i for i in ids if ids.count(i) > 1}
        if dupes:
            raise ValueError(f"replica ids must be unique; repeated: {sorted(dupes)}")
        return self

    def timeouts_for(self, route: Route) -> Timeouts:
        override = self.routes.get(route)
        return override.apply(self.timeouts) if override else self.timeouts


class ConfigError(Exception):
    """A configuration problem, with every offending field named."""


def _model_at(root: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The schema model that holds the field at `loc` (for listing allowed fields).

    A part that names a field descends into its model; a mapping's key or a list's index
    (`tiers.gold`, `replicas.0`) descends into the model of its values."""
    model = root
    container = False  # the previous part named a dict or list of models
    for part in loc[:-1]:
        if container:
            container = False
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        origin = getattr(annotation, "__origin__", None)
        candidates = getattr(annotation, "__args__", (annotation,))
        nested = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if nested is None:
            return model
        container = origin in (dict, list)
        model = nested
    return model


def format_validation_error(
    err: ValidationError, source: str, root: type[BaseModel] | None = None
) -> str:
    """One line per error: the field's dotted path, what was wrong, and what is allowed.

    With `root` (the model validated), an unknown field lists the fields allowed there.
    Values of fields named like keys or tokens are never echoed.
    """
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        where = ".".join(str(p) for p in loc)
        if not where:
            # A rule across fields: its message names the fields itself.
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
            continue
        if e["type"] == "extra_forbidden":
            holder = _model_at(root, loc) if root is not None else None
            allowed = f"; allowed: {', '.join(holder.model_fields)}" if holder else ""
            lines.append(f"  {where}: unknown field{allowed}")
            continue
        got = e.get("input")
        secret = any("key" in str(part) or "token" in str(part) for part in loc)
        shown = "" if secret or isinstance(got, dict | list) else f" (got {got!r})"
        lines.append(f"  {where}: {e['msg'].removeprefix('Value error, ')}{shown}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data = envref.resolve_config(data, source, ConfigError)  # os.environ/NAME and ${NAME}
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, GatewayConfig)) from None


def load_config(path: str | Path) -> GatewayConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return parse_config(data, str(p))
