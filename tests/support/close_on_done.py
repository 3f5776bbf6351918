"""Streams read as SDKs read them, each connection reset the moment `data: [DONE]`
arrives: `python -m tests.support.close_on_done HOST PORT CONCURRENCY PER_LOOP BODY_JSON`.
Prints one JSON line: streams read to their `[DONE]`, and streams that ended without it.

Its own process (asyncio, no GIL shared with the test) so that its close comes as fast
as a real client's, in the moment after the gateway wrote `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys


async def main(host: str, port: int, concurrency: int, per_loop: int, body: bytes) -> None:
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts = {"done": 0, "cut": 0}

    async def loop() -> None:
        for _ in range(per_loop):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            seen = b""
            while b"data: [DONE]" not in seen:
                chunk = await asyncio.wait_for(reader.read(65536), 30)
                if not chunk:
                    break
                seen += chunk
            counts["done" if b"data: [DONE]" in seen else "cut"] += 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # a reset, at once

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    host, port, concurrency, per_loop, body = sys.argv[1:6]
    asyncio.run(main(host, int(port), int(concurrency), min(int(per_loop), 1000), body.encode()))
