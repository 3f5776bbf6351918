"""An open gateway (no tenants, so no keys) behind one address: the embedded default, or
any gateway behind an ingress or an L4 balancer that SNATs, where every connection comes
from one or a few client addresses. The caps for connections without a valid key exist
to keep strangers from crowding out tenants; with no tenants there are no strangers, and
a client address must be able to hold as many streams as the gateway holds connections
(before: 128, so 200 concurrent streams from one address had 72 refused with 503, over
and over; bench_cluster.py's throughput run counted 11,799 such failures in 30 s).
Real processes on loopback: a `seawall sim`, `seawall serve`, an aiohttp client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from tests.support.fleet import MODEL, running, start_gateway, start_sim

pytestmark = pytest.mark.integration

STREAMS = 200  # over the old per-address cap of 128


async def _streams(url: str, n: int) -> list[tuple[int, bool]]:
    body = json.dumps(
        {"model": MODEL, "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    ).encode()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> tuple[int, bool]:
            headers = {"Content-Type": "application/json"}
            try:
                async with session.post(f"{url}/v1/completions", data=body, headers=headers) as r:
                    text = await r.text()
                    return r.status, "data: [DONE]" in text
            except aiohttp.ClientError:
                return 0, False  # the connection was closed or refused

        return await asyncio.gather(*(one() for _ in range(n)))


def test_an_open_gateway_holds_more_than_128_streams_from_one_address(artifacts: Path) -> None:
    # 40 tokens at 50 ms a step: each stream holds its connection for 2 s, so all of
    # them are open at once.
    sim = start_sim(
        artifacts, "--step-base-ms", "50", "--step-per-seq-ms", "0", "--max-num-seqs", "256"
    )
    gw = start_gateway(artifacts, [sim], {"admission": {"enabled": False}})
    with running(gw, sim):
        results = asyncio.run(_streams(gw.url, STREAMS))
    statuses = [s for s, _ in results]
    assert statuses.count(200) == STREAMS, {s: statuses.count(s) for s in set(statuses)}
    assert all(done for _, done in results)
