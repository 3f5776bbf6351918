"""When a fleet leader must stop leading, when an instance is running fail-static, and
how long a fail-over takes: pure rules over times passed in.

Why a leader steps down before its lease expires. Another instance may take the lease
the moment it expires on the store's clock. A leader that could not renew (the store
is unreachable, or our event loop stalled) cannot know whether that moment has come, so
it stops acting (no probes, no restarts, no ledger writes) once its last successful
renewal is `lease_ttl_s - renew_interval_s` old: a full renew interval before anyone
else can lead. Its writes are fenced anyway (`seawall.cluster.store`); stepping down
early means it does not even try. (client-go's `RenewDeadline` plays the same part.)

Fail-over bound. A leader that dies renewed its lease at most `lease_ttl_s` before the
lease expires; every other instance tries to acquire once per `renew_interval_s`. So a
new leader holds the lease at most `lease_ttl_s + renew_interval_s` after the old one
died (plus the store's own latency), and a clean shutdown releases the lease, so that
bound shrinks to one `renew_interval_s`.

Fail-static. An instance serves on the last fleet view it has, plus what it sees itself,
and says so, when the store cannot be reached, or (a follower) when the view it holds
is older than `view_stale_s` (no leader is publishing). A leader whose store works is
never fail-static: its view is its own.

Must not: do I/O, read the clock, or know what a store is.
"""

from __future__ import annotations

from dataclasses import dataclass


def must_step_down(
    now: float, last_renewed_at: float | None, lease_ttl_s: float, renew_interval_s: float
) -> bool:
    """True once a leader's last successful renewal (monotonic) is too old to act on."""
    if last_renewed_at is None:
        return True
    return now - last_renewed_at >= lease_ttl_s - renew_interval_s


def failover_bound_s(lease_ttl_s: float, renew_interval_s: float) -> float:
    """The longest a fleet goes without a leader after its leader dies (see above)."""
    return lease_ttl_s + renew_interval_s


@dataclass(frozen=True, slots=True)
class Standing:
    """Whether an instance serves on a view it cannot refresh, and why."""

    fail_static: bool
    reason: str = ""


def standing(
    *,
    leading: bool,
    now: float,
    store_failing_since: float | None,
    store_error: str,
    view_taken_at: float | None,
    view_stale_s: float,
) -> Standing:
    """The instance's standing at monotonic `now` (see the module docstring)."""
    if store_failing_since is not None:
        return Standing(
            True,
            f"cluster store unreachable for {now - store_failing_since:.1f} s ({store_error}); "
            "serving on the last fleet view and this instance's own signals",
        )
    if leading:
        return Standing(False)
    if view_taken_at is None:
        return Standing(True, "no fleet view received yet; no leader has published")
    age_s = now - view_taken_at
    if age_s > view_stale_s:
        return Standing(
            True,
            f"the fleet view is {age_s:.1f} s old (no leader publishing); "
            "serving on it and this instance's own signals",
        )
    return Standing(False)
