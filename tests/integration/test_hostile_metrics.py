"""Anyone could read tenant names on the public `/metrics` (issue 11, item 10).

With tenants configured, the gateway's `/metrics` now needs a bearer token: the scrape
credential (`metrics.token_hash`) or the admin token. Without, a client gets a 401 with
an OpenAI-shaped body that names nobody. An open gateway (no tenants) keeps it public.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from seawall.auth import hash_key, new_key
from tests.support.fleet import MODEL, running, start_gateway, start_sim
from tests.support.hostile import assert_openai_error

pytestmark = pytest.mark.integration

SCRAPE_TOKEN = "sk-sw-prometheus-scrape-token-for-tests-0000000000"
ADMIN_TOKEN = "sk-sw-admin-token-for-metrics-tests-000000000000000"


def test_metrics_need_a_credential_when_tenants_are_configured(artifacts: Path) -> None:
    key = new_key()
    sim = start_sim(artifacts)
    cfg = {
        "tiers": {"small": {"max_tokens": 4}},
        "tenants": {"secret-customer-7": {"tier": "small", "api_key_hashes": [hash_key(key)]}},
        "metrics": {"token_hash": hash_key(SCRAPE_TOKEN)},
    }
    gw = start_gateway(artifacts, [sim], cfg)
    with running(gw, sim):
        # A refusal puts the tenant's name in the shed counters.
        r = httpx.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 10},
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        )
        assert r.status_code == 400
        for headers in (
            {},
            {"Authorization": f"Bearer {key}"},  # a tenant's key is not a scrape credential
            {"Authorization": "Bearer nope"},
            {"Authorization": f"Basic {SCRAPE_TOKEN}"},
        ):
            r = httpx.get(gw.url + "/metrics", headers=headers, timeout=10)
            err = assert_openai_error(r, 401)
            assert "secret-customer-7" not in r.text
            assert err["code"] == "metrics_unauthorized"
        ok = httpx.get(
            gw.url + "/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}, timeout=10
        )
        assert ok.status_code == 200 and 'tenant="secret-customer-7"' in ok.text


def test_the_admin_token_reads_metrics_too(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    cfg = {
        "tenants": {"acme": {"api_key_hashes": [hash_key(new_key())]}},
        "admin": {"enabled": True, "port": 0, "token_hash": hash_key(ADMIN_TOKEN)},
    }
    gw = start_gateway(artifacts, [sim], cfg)
    with running(gw, sim):
        assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 401
        r = httpx.get(
            gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        )
        assert r.status_code == 200 and "seawall_requests_total" in r.text


def test_an_open_gateway_keeps_public_metrics_and_public_can_be_chosen(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    open_gw = start_gateway(artifacts, [sim], name="open")
    chosen = start_gateway(
        artifacts,
        [sim],
        {
            "tenants": {"acme": {"api_key_hashes": [hash_key(new_key())]}},
            "metrics": {"access": "public"},
        },
        name="chosen",
    )
    with running(open_gw, chosen, sim):
        for gw in (open_gw, chosen):
            r = httpx.get(gw.url + "/metrics", timeout=10)
            assert r.status_code == 200 and "seawall_requests_total" in r.text
