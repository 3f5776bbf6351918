"""The adaptive controller with a share of the replica (several gateways, issue 15): its
reservations are held within its share, and the engine's usage, which counts every
gateway's requests, is not read as its own requests outgrowing their estimates."""

from __future__ import annotations

from seawall.policy.adaptive_admission import Admit, Cause, ControlConfig, Hold, ReplicaAdmission
from tests.unit.test_policy_admission_adaptive import eos, holding, load


def test_within_a_share_even_with_nothing_in_flight_here() -> None:
    c = ReplicaAdmission(ControlConfig())
    nothing = holding()
    assert isinstance(c.decide(eos(), nothing, load(0.0), 0.0), Admit)  # alone
    # A tenth of 199 blocks is 19.9: a 26-block request does not fit this gateway's share.
    held = c.decide(eos(), nothing, load(0.0), 0.0, quota=0.1)
    assert isinstance(held, Hold) and "10% share" in held.reason
    assert isinstance(c.decide(eos(), nothing, load(0.0), 0.0, quota=0.5), Admit)


def test_the_others_usage_is_not_read_as_this_gateways_requests_outgrowing() -> None:
    """Three gateways hold two EOS requests each (~60 blocks at the means) on a cache
    that is 98% used (195 blocks, all of them real requests)."""
    mine = holding(eos(), eos())
    alone, shared = ReplicaAdmission(ControlConfig()), ReplicaAdmission(ControlConfig())
    for i in range(10):
        t = i * 0.2
        alone.observe(load(t, kv=0.98, running=6), mine, t)
        shared.observe(load(t, kv=0.98, running=6), mine, t, quota=1 / 3)
    assert alone.cause is Cause.outgrown and alone.level > 0.5  # as if its own outgrew
    assert shared.cause is not Cause.outgrown and shared.level == 0.0
