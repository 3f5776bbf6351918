"""An aiohttp application served on loopback from an event loop of its own, in a thread:
for test doubles whose clients (a gateway) run in another process or on another loop.

One piece of plumbing for every such double (the Kubernetes API server, the upstream
that cuts its streams, the audio engine): start the loop, bind 127.0.0.1 on a free
port, and on exit clean the runner up, stop the loop and join the thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Self

from aiohttp import web


@contextmanager
def served(app: web.Application, name: str = "test-double") -> Iterator[int]:
    """Serve `app` on 127.0.0.1; yields its port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return int(runner.addresses[0][1])

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class ServedDouble:
    """A test double that is a context manager serving `app()` (see `served`): entering
    starts it and sets `port`, leaving stops it. Subclasses build the application."""

    name = "test-double"

    def __init__(self) -> None:
        self.port = 0
        self._served: AbstractContextManager[int] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._served = served(self.app(), self.name)
        self.port = self._served.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._served is not None:
            self._served.__exit__(None, None, None)
            self._served = None
