"""Choosing the tenant-limits backend from the configuration.

Its own module so that the in-memory backend (`limits.py`) and the Redis one
(`limits_redis.py`, which builds on the first's types) never import each other both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from seawall.state.limits import LimitsBackend, MemoryLimits


def open_limits_backend(
    redis_url: str | None,
    *,
    fail_mode: Literal["open", "closed"] = "open",
    key_prefix: str = "seawall:limits:",
    lease_ttl_s: float = 660.0,
    instances: Callable[[], int] | None = None,
) -> LimitsBackend:
    """The configured backend: shared through Redis when a URL is given, else in-memory.
    Constructing either does no I/O (Redis connects on `start` or the first request).
    `instances`: how many gateway instances share the limits (a fail-open fallback holds
    a share); None: Redis counts them itself."""
    if redis_url is None:
        return MemoryLimits(lease_ttl_s=lease_ttl_s)
    from seawall.state.limits_redis import RedisLimits  # only deployments with Redis

    return RedisLimits(
        redis_url, fail_mode, key_prefix, lease_ttl_s=lease_ttl_s, instances=instances
    )
