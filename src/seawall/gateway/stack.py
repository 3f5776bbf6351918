"""The admission stack: which layers run before a replica is chosen, in which order, and why.

Order (each layer refuses before the next one spends anything):
1. auth: who is asking decides every limit below; an unknown key costs nothing more.
2. tier limits (prompt tokens, max_tokens): a request that can never be served is refused
   before it takes a rate-limit token or a concurrency slot.
3. rate limits and tenant concurrency: charged only for requests that passed 1-2, so a
   rejected oversized request does not eat the tenant's budget.
4. fleet admission (saturation): last, because it may queue; a request that would be
   refused anyway must not wait in the queue first.
The retry budget, hedging and balancing run after these, in `proxy.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seawall.gateway.app import Gateway


def install_layers(gw: Gateway) -> None:
    """Attach the admission layers: always on (an open gateway still gets tier defaults
    and fleet admission); tenants, rates and Redis only when configured."""
    from seawall.gateway.tenancy import TenancyGuard, load_tenancy, warn_if_open
    from seawall.state.limits import open_limits_backend

    _, _, rate, _ = load_tenancy(gw.config)
    backend = open_limits_backend(
        rate.redis_url if rate.backend == "redis" else None,
        fail_mode=rate.fail_mode,
        key_prefix=rate.key_prefix,
        # A lease outlives the longest request, so only a crashed gateway's leases expire.
        lease_ttl_s=gw.config.timeouts.total_s + 60.0,
    )
    gw.guard = TenancyGuard(gw, backend)
    warn_if_open(gw.config)
