"""DNS replica discovery finds a headless Service's addresses (here: localhost)."""

from __future__ import annotations

import asyncio
import socket

from seawall.fleet.config import DiscoveryConfig
from seawall.fleet.discovery import DnsDiscovery, Endpoint, build_discovery, watch


async def test_dns_discovery_resolves_localhost_to_loopback_endpoints() -> None:
    found = await DnsDiscovery("localhost", 8000, family=socket.AF_INET).resolve()
    assert Endpoint("127.0.0.1", 8000) in found
    assert all(e.port == 8000 and e.url.endswith(":8000") for e in found)


async def test_watch_reports_a_set_once_and_keeps_it_through_failures() -> None:
    class Flaky:
        calls = 0

        async def resolve(self) -> frozenset[Endpoint]:
            self.calls += 1
            if self.calls == 2:
                raise OSError("temporary failure in name resolution")
            if self.calls >= 4:
                stop.set()
            return frozenset({Endpoint("10.0.0.1", 8000)})

    stop = asyncio.Event()
    seen: list[frozenset[Endpoint]] = []
    await asyncio.wait_for(watch(Flaky(), 0.0, seen.append, stop), timeout=10)
    assert seen == [frozenset({Endpoint("10.0.0.1", 8000)})]


def test_endpoint_ids_and_urls() -> None:
    assert Endpoint("10.0.0.1", 8000).replica_id == "10.0.0.1:8000"
    assert Endpoint("10.0.0.1", 8000, "n1", "vllm-0").replica_id == "vllm-0"
    assert Endpoint("fd00::1", 8000).url == "http://[fd00::1]:8000"


def test_config_dns_mode_resolves_the_headless_service_name() -> None:
    found = build_discovery(DiscoveryConfig(service="vllm", namespace="serving", port=8001))
    assert isinstance(found, DnsDiscovery)
    assert (found.name, found.port) == ("vllm.serving.svc", 8001)
