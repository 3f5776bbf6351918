"""Traffic `seawall up` sends at its own fleet, and the demo's one deliberate crash.

Owns: running `seawall.loadgen` against the gateway (or, with no gateway, against each
replica directly) for a bounded time, feeding results to a callback, and stopping it
on request; `crash_replica` for the demo.

Must not: start or stop processes (that is `fleet.py`) or draw (`view.py`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

import aiohttp

from seawall.loadgen import RequestResult, run_load
from seawall.up.config import TrafficConfig


class Traffic:
    """A bounded load against `targets`, split evenly; `stop()` ends it within `grace_s`."""

    def __init__(
        self,
        config: TrafficConfig,
        model: str,
        targets: Sequence[str],
        on_result: Callable[[RequestResult], None],
        duration_s: float,
        grace_s: float = 2.0,
    ) -> None:
        self.config = config
        self.model = model
        self.targets = list(targets)
        self.on_result = on_result
        self.duration_s = min(duration_s, config.duration_s)
        self.grace_s = grace_s
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[object]] = []

    def start(self) -> None:
        c = self.config
        per_target = max(1, math.ceil(c.concurrency / len(self.targets)))
        max_requests = max(1, c.max_requests // len(self.targets))
        for url in self.targets:
            self._tasks.append(
                asyncio.create_task(
                    run_load(
                        url,
                        self.model,
                        concurrency=per_target,
                        duration_s=self.duration_s,
                        max_requests=max_requests,
                        prompt_tokens=c.prompt_tokens,
                        max_tokens=c.max_tokens,
                        api_key=c.api_key,
                        chat=c.chat,
                        on_result=self.on_result,
                        grace_s=self.grace_s,
                        stop=self._stop,
                    )
                )
            )

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    async def stop(self) -> None:
        self._stop.set()
        if not self._tasks:
            return
        # run_load cuts its own in-flight requests after grace_s; this bound is a backstop.
        _, late = await asyncio.wait(self._tasks, timeout=self.grace_s + 5.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def crash_replica(url: str) -> bool:
    """Ask a `seawall sim --enable-faults` replica to exit at once; True if it was asked."""
    timeout = aiohttp.ClientTimeout(total=2.0)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.post(f"{url}/sim/fault", json={"kind": "crash"}) as resp,
        ):
            return resp.status < 400
    except (aiohttp.ClientError, TimeoutError, OSError):
        # The process exits while answering: a reset here usually means it worked.
        return True
