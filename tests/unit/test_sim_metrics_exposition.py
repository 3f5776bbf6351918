"""How the emulator answers a scrape, route by route, as vLLM 0.33.0 does.

Measured against vLLM 0.33.0's own `/metrics` wiring (prometheus-fastapi-instrumentator
8.1.0's route, then prometheus_client 0.26.0's ASGI app mounted at `/metrics`) with
the Accept headers Prometheus 2.42 and 3.x send; docs/engines-reference.md §1.1.
"""

from __future__ import annotations

import gzip
import importlib.metadata

import prometheus_client
import pytest

from seawall.sim.metrics import TEXT_CONTENT_TYPE, SimMetrics

# What Prometheus 2.42 (Debian 12) sends; captured from a real scrape.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
# What Prometheus 3.x sends with its default UTF-8 name validation (scrape/scrape.go
# acceptHeader: `escaping=allow-utf-8` on the 1.0.0 formats).
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,"
    "*/*;q=0.2"
)


def _sim() -> SimMetrics:
    return SimMetrics("Qwen/Qwen3-0.6B", 4096, block_size=16, num_gpu_blocks=27000)


def _sample_names(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_the_library_is_the_version_whose_behaviour_was_measured() -> None:
    # prometheus_client 0.23 began escaping names on negotiation; the tests below pin
    # that behaviour, which vLLM 0.33 gets (it requires >=0.18 and resolves the newest).
    version = importlib.metadata.version("prometheus_client")
    assert tuple(int(p) for p in version.split(".")[:2]) >= (0, 23), version


def test_plain_metrics_route_is_text_with_colon_names_whatever_accept_says() -> None:
    text = _sim().render().decode()
    assert TEXT_CONTENT_TYPE == prometheus_client.CONTENT_TYPE_LATEST
    assert "vllm:kv_cache_usage_perc" in _sample_names(text)
    assert not any(n.startswith("vllm_") for n in _sample_names(text))
    assert "# EOF" not in text


def test_negotiated_route_gives_prometheus_2_openmetrics_with_underscored_samples() -> None:
    body, headers = _sim().render_negotiated(PROMETHEUS_2_ACCEPT)
    text = body.decode()
    assert headers["Content-Type"] == (
        "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    )
    names = _sample_names(text)
    assert "vllm_kv_cache_usage_perc" in names
    assert "vllm_num_preemptions_total" in names
    assert not any(n.startswith("vllm:") for n in names)
    # The family lines keep the declared name: the sample and its TYPE disagree.
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert text.endswith("# EOF\n")


def test_negotiated_route_keeps_colons_for_prometheus_3() -> None:
    body, headers = _sim().render_negotiated(PROMETHEUS_3_ACCEPT)
    assert headers["Content-Type"].endswith("escaping=allow-utf-8")
    names = _sample_names(body.decode())
    assert "vllm:kv_cache_usage_perc" in names
    assert not any(n.startswith("vllm_") for n in names)


@pytest.mark.parametrize("accept", ["*/*", "", "text/plain"])
def test_negotiated_route_gives_text_0_0_4_to_curl_and_gateways(accept: str) -> None:
    body, headers = _sim().render_negotiated(accept)
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "vllm:kv_cache_usage_perc" in _sample_names(body.decode())


def test_negotiated_route_compresses_when_asked() -> None:
    body, headers = _sim().render_negotiated(PROMETHEUS_2_ACCEPT, "gzip")
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body).decode().endswith("# EOF\n")
