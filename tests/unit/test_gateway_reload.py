"""Reloading the configuration in the composition root: tenants, keys and tiers change as
one value, and a request keeps the one it started under.

No sockets: the gateway is built but not started; `Gateway.reload` is the code a running
gateway runs on SIGHUP (tests/integration/test_gateway_reload.py runs that)."""

from __future__ import annotations

from typing import Any

import pytest

from seawall import clock
from seawall.auth import hash_key
from seawall.config import ConfigError, Timeouts, parse_config
from seawall.errors import ApiError
from seawall.gateway.app import Gateway
from seawall.gateway.context import RequestCtx
from seawall.protocol.openai import parse

A, B, C = (f"sk-sw-reload-{n}-" + "0" * 36 for n in "abc")


def config(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": [
            {"url": "http://127.0.0.1:9001", "model": "m", "id": "r0"},
            {"url": "http://127.0.0.1:9002", "model": "m", "id": "r1"},
        ],
        "tiers": {"small": {"max_tokens": 10}},
        "tenants": {
            "alpha": {"tier": "small", "api_key_hashes": [hash_key(A)]},
            "beta": {"api_key_hashes": [hash_key(B)]},
        },
    }
    return {**base, **over}


def request(key: str, max_tokens: int) -> tuple[dict[str, str], RequestCtx]:
    ctx = RequestCtx("id", "completions", clock.monotonic(), Timeouts())
    ctx.req = parse("completions", b'{"model":"m","prompt":"hi","max_tokens":%d}' % max_tokens)
    return {"Authorization": f"Bearer {key}"}, ctx


async def test_a_request_keeps_the_policy_it_authenticated_under() -> None:
    gw = Gateway(parse_config(config()), access_log=False)
    headers, inflight = request(A, 50)
    gw.tenancy.authenticate(headers, inflight)  # under the old file: small allows 10
    # The new file drops alpha's tier altogether and lets small have 100.
    new = config(
        tiers={"small": {"max_tokens": 100}},
        tenants={"gamma": {"tier": "small", "api_key_hashes": [hash_key(C)]}},
    )
    report = gw.reload(parse_config(new))
    assert (report.tenants.added, report.tenants.removed) == (("gamma",), ("alpha", "beta"))
    assert report.tiers.changed == ("small",)
    # The request already past authentication finishes under the old policy, whole.
    with pytest.raises(ApiError) as e:
        await gw.tenancy.tier_limits(inflight)
    assert e.value.status == 400 and "10" in e.value.message
    # Requests from now on: the new policy, whole.
    for key, allowed in ((A, False), (B, False), (C, True)):
        headers, ctx = request(key, 50)
        if not allowed:
            with pytest.raises(ApiError) as e:
                gw.tenancy.authenticate(headers, ctx)
            assert e.value.status == 401
            continue
        gw.tenancy.authenticate(headers, ctx)
        await gw.tenancy.tier_limits(ctx)  # 50 <= 100: passes
        assert (ctx.tenant, ctx.tier) == ("gamma", "small")
    await gw.close()


async def test_a_refused_reload_changes_nothing() -> None:
    gw = Gateway(parse_config(config()), access_log=False)
    policy, replicas = gw.tenancy.policy, gw.replicas.all()
    same_key = {
        "alpha": {"api_key_hashes": [hash_key(A)]},
        "beta": {"api_key_hashes": [hash_key(A)]},
    }
    bad = config(tenants=same_key, replicas=[{"url": "http://127.0.0.1:9003", "id": "r9"}])
    with pytest.raises(ConfigError, match="listed under both"):
        gw.reload(parse_config(bad))
    assert gw.tenancy.policy is policy and gw.replicas.all() == replicas
    assert gw.config.tenants.keys() == {"alpha", "beta"}
    await gw.close()
