"""A bounded request flood from its own process: `python -m tests.support.flood URL KEY
SECONDS CONCURRENCY BODY_JSON`. Each of CONCURRENCY loops sends BODY_JSON and, whatever
the answer, sends the next at once (a client retrying immediately on 429), until SECONDS
have passed or 10,000 requests each. Prints one JSON line of counts by status at the end.

Its own process so that the flood is as fast as a real aggressive client, and the test
process stays free to measure the bystander it cares about."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time

import aiohttp


async def main(url: str, key: str, seconds: float, concurrency: int, body: bytes) -> None:
    stop_at = time.monotonic() + seconds
    counts: collections.Counter[int] = collections.Counter()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            for _ in range(10_000):
                if time.monotonic() > stop_at:
                    return
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        counts[r.status] += 1
                except aiohttp.ClientError:
                    counts[0] += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    print(json.dumps({str(k): v for k, v in counts.items()}), flush=True)


if __name__ == "__main__":
    u, k, s, c, b = sys.argv[1:6]
    asyncio.run(main(u, k, float(s), int(c), b.encode()))
