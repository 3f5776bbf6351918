"""A byte relay: the floor under any HTTP proxy's added latency on this machine.

    python bench/tcp_relay.py LISTEN_PORT UPSTREAM_PORT

Accepts on 127.0.0.1:LISTEN_PORT and, per connection, opens one to
127.0.0.1:UPSTREAM_PORT and copies bytes both ways (asyncio protocols on uvloop, no
parsing, no buffering beyond what the kernel hands over, TCP_NODELAY both sides). It does
nothing a gateway must do, so what it adds to a client's time to first token is the cost
of one more process and two more loopback hops: the part of a proxy's hop that no
proxy can remove. `bench_guidellm.py --floor` runs it beside the gateway. Loopback only.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import uvloop


class _Pipe(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's: not asyncio's class
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def main(listen: int, upstream: int) -> None:
    loop = asyncio.get_running_loop()
    dialling: set[asyncio.Task[None]] = set()

    class Client(_Pipe):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            task = loop.create_task(self.dial())
            dialling.add(task)
            task.add_done_callback(dialling.discard)

        async def dial(self) -> None:
            try:
                _, up = await loop.create_connection(_Pipe, "127.0.0.1", upstream)
            except OSError:
                if self.transport is not None:
                    self.transport.close()
                return
            up.peer, self.peer = self, up
            for data in self.pending:
                up.transport.write(data)  # type: ignore[union-attr]  # connected above
            self.pending.clear()

    server = await loop.create_server(Client, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
