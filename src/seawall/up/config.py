"""`seawall up` configuration: the local fleet, the gateway in front of it, optional traffic.

Owns: the schema (every default documented here once), YAML loading with errors that
name the field and what it accepts, the built-in `--demo` config, and merging the
started replicas into the gateway's config.

Must not: know the gateway's schema. `gateway:` is the lead's `seawall serve` config,
passed through as an opaque mapping; `up` only adds `replicas:` and `listen:` to it (and
the demo writes its own: a tier that migrates streams, the admin API for the status page).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from seawall import envref
from seawall.actuate.local import DEFAULT_COMMAND, render_command
from seawall.config import format_validation_error

PositiveSeconds = Annotated[float, Field(gt=0)]


class UpConfigError(ValueError):
    """A config that does not validate; the message names each bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FleetConfig(_Strict):
    replicas: Annotated[int, Field(ge=1, le=64)] = 3
    model: Annotated[str, Field(min_length=1)] = "sim-model"
    # argv template with {port} {model} {replica} {index}; None = `seawall sim` (this Python)
    command: list[str] | None = None
    # the fleet monitor's startup allowance: a replica is `starting` (never restarted)
    # until its liveness probe passes or this expires
    startup_allowance_s: PositiveSeconds = 600.0
    # the failure domain all replicas share (K restarts within the window cordon it);
    # null: each replica is its own, so one replica's crashes never stop another
    node: Annotated[str, Field(min_length=1)] | None = None
    env: dict[str, str] = Field(default_factory=dict)  # added to each replica's environment
    health_path: str = "/health"  # what the fleet monitor's liveness probe asks for
    stop_grace_s: PositiveSeconds = 10.0  # SIGTERM -> SIGKILL on shutdown

    @field_validator("command")
    @classmethod
    def _command_renders(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("must be a non-empty list of strings, or null for seawall sim")
            render_command(value, port=1, model="m", replica="r0", index=0)
        return value

    @field_validator("health_path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/', e.g. /health")
        return value


class TrafficConfig(_Strict):
    """Steady traffic from `seawall.loadgen`, so the view shows the system working."""

    concurrency: Annotated[int, Field(ge=1, le=256)] = 2
    prompt_tokens: Annotated[int, Field(ge=1)] = 64
    max_tokens: Annotated[int, Field(ge=1)] = 32
    chat: bool = False
    api_key: str | None = Field(default=None, repr=False)  # os.environ/NAME and ${NAME} work
    max_requests: Annotated[int, Field(ge=1)] = 100_000  # the load stops by itself here...
    duration_s: PositiveSeconds = 3600.0  # ...or here, whichever comes first


class UpConfig(_Strict):
    fleet: FleetConfig = FleetConfig()
    # the `seawall serve` config (opaque here); null = no gateway, traffic goes direct
    gateway: dict[str, Any] | None = Field(default_factory=dict)
    # in-process: the gateway runs inside `seawall up` and its fleet monitor restarts and
    # cordons through the local supervisor; process: `seawall serve` as a child process,
    # whose monitor can only route around (its fleet.actuator must be none)
    gateway_mode: Literal["in-process", "process"] = "in-process"
    # Gateway instances over the fleet, one cluster (`seawall.cluster`) through a store
    # `up` hosts. In-process: the first is the leader (it owns the supervisor: restarts,
    # cordons, rollouts); the others are `seawall serve` processes that follow its view
    # and never lead. Process: all are processes, any may lead, `up`'s own monitor acts.
    gateways: Annotated[int, Field(ge=1, le=8)] = 1
    traffic: TrafficConfig | None = None  # null = no traffic of our own


def demo_config(admin_token_hash: str | None = None) -> UpConfig:
    """`--demo`: three sim replicas (faults enabled, so the demo can crash one) behind
    the gateway, with steady streamed traffic whose tier opts into mid-stream migration
    (so a crash shows what the gateway saves), and, given a token's hash, the admin API
    with the status page on a free port."""
    gateway: dict[str, Any] = {"tiers": {"default": {"migrate": True}}}
    if admin_token_hash is not None:
        gateway["admin"] = {"enabled": True, "port": 0, "token_hash": admin_token_hash}
    return UpConfig(
        fleet=FleetConfig(
            replicas=3, model="sim-model", command=[*DEFAULT_COMMAND, "--enable-faults"]
        ),
        gateway=gateway,
        # Streams long enough that a crash finds several in flight.
        traffic=TrafficConfig(concurrency=6, prompt_tokens=32, max_tokens=96),
    )


def _allowed(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def format_errors(e: ValidationError, source: str) -> str:
    """One line per error: the field's dotted path, what was wrong, what is allowed."""
    return format_validation_error(e, source, UpConfig)


def parse_up_config(data: object, source: str = "config") -> UpConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UpConfigError(f"{source}: the top level must be a mapping with {_allowed(UpConfig)}")
    data = envref.resolve_config(data, source, UpConfigError)  # os.environ/NAME and ${NAME}
    try:
        return UpConfig.model_validate(data)
    except ValidationError as e:
        raise UpConfigError(format_errors(e, source)) from None


def load_up_config(path: str | Path) -> UpConfig:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UpConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UpConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_up_config(data, str(path))


def gateway_config(
    base: dict[str, Any], replicas: Sequence[dict[str, str]], host: str, port: int
) -> dict[str, Any]:
    """The gateway's config: the user's `gateway:` with the started replicas and the
    listen address `up` chose. Replicas the user listed by hand are kept, after ours."""
    merged = dict(base)
    merged["replicas"] = [*replicas, *(base.get("replicas") or [])]
    merged["listen"] = {**(base.get("listen") or {}), "host": host, "port": port}
    return merged


def python_argv(*args: str) -> list[str]:
    """`seawall <args>` run by this Python (works without the console script on PATH)."""
    return [sys.executable, "-m", "seawall", *args]


def check_gateway_config(config: UpConfig, source: str) -> None:
    """Validate `gateway:` with the gateway's own schema before anything starts, so a typo
    is one clear error instead of a gateway process crash-looping in the view."""
    if config.gateway is None:
        return
    try:
        from seawall.config import ConfigError, parse_config
    except ImportError:  # a build without the gateway: `up` runs without one
        return
    fleet = config.gateway.get("fleet") or {}
    actuator = fleet.get("actuator") if isinstance(fleet, dict) else None
    allowed = ("none", "local") if config.gateway_mode == "in-process" else ("none",)
    if actuator is not None and actuator not in allowed:
        raise UpConfigError(
            f"{source}: gateway.fleet.actuator: {actuator!r} cannot act on the processes "
            f"`seawall up` starts with gateway_mode {config.gateway_mode}; "
            f"allowed: {', '.join(allowed)}"
        )
    probe = [{"url": "http://127.0.0.1:1", "model": "m", "node": "local", "id": "seawall-up-probe"}]
    try:
        parse_config(gateway_config(config.gateway, probe, "127.0.0.1", 0), f"{source}: gateway")
    except ConfigError as e:
        raise UpConfigError(str(e)) from None
