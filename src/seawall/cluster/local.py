"""The cluster store for several processes on one host: a `MemoryStore` behind a Unix
socket (`StoreServer`) and the `ClusterStore` that talks to it (`LocalStoreClient`).

Why. Several gateway processes on one host (workers sharing a port, or two gateway
instances under `seawall up`) must share leadership and the fleet view exactly as
instances across hosts do, without anyone setting up Redis. One process hosts the
server; the others (and the host itself, through the same client) connect to it.

Protocol: each message is a 4-byte big-endian length and an orjson object. A request is
`{"op": name, "args": [...]}`; the answer is `{"ok": result}` or `{"error": kind,
"message": text}` with kind `fenced` (carrying `epoch` and `current`) or `bad_request`.
Bytes travel base64-encoded. One request at a time per connection (the client holds a
lock): the cluster's calls are a few per second, and ordering them is free.

Hosting: whatever runs the instances on a host starts a `StoreServer` in its own
process (the parent of several workers, `seawall up`), or runs it on its own:
`python -m seawall.cluster.local --socket PATH` (it prints its socket and serves until
SIGTERM).

Must not: hold any state outside the hosted `MemoryStore` (the server restarts empty,
like a Redis without persistence), or raise anything but `StoreUnavailable` and
`FencedOut` from the client.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from seawall.cluster.store import (
    DEFAULT_LIST_CAP,
    FencedOut,
    Lease,
    MemoryStore,
    StoreUnavailable,
)
from seawall.state.store_timeout import StoreTimeout

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a fleet view of thousands of replicas fits


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _unb64(value: Any) -> bytes:
    return base64.b64decode(str(value))


def _lease_json(lease: Lease | None) -> dict[str, Any] | None:
    if lease is None:
        return None
    return {"holder": lease.holder, "info": lease.info, "epoch": lease.epoch}


def _lease_from(data: Any) -> Lease | None:
    if data is None:
        return None
    return Lease(str(data["holder"]), str(data["info"]), int(data["epoch"]))


async def _read(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {size} bytes is over the limit")
    return orjson.loads(await reader.readexactly(size))


def _frame(obj: Any) -> bytes:
    body = orjson.dumps(obj)
    return _HEADER.pack(len(body)) + body


class StoreServer:
    """Hosts `store` (a fresh `MemoryStore` by default) on the Unix socket `path`."""

    def __init__(self, path: str | Path, store: MemoryStore | None = None) -> None:
        self.path = Path(path)
        self.store = store or MemoryStore()
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._ops: dict[str, Callable[..., Any]] = {
            "acquire": self._acquire,
            "release": self.store.release,
            "leader": self._leader,
            "raise_epoch": self.store.raise_epoch,
            "heartbeat": lambda i, r, t: self.store.heartbeat(i, _unb64(r), t),
            "leave": self.store.leave,
            "members": self._members,
            "put": lambda k, v, e: self.store.put(k, _unb64(v), e),
            "delete": self.store.delete,
            "get": self._get,
            "append": lambda k, v, e, c: self.store.append(k, _unb64(v), e, c),
            "range": self._range,
            "hset": lambda k, f, v, e: self.store.hset(k, f, _unb64(v), e),
            "hdel": self.store.hdel,
            "hgetall": self._hgetall,
        }

    async def _acquire(self, instance: str, info: str, ttl_s: float, min_epoch: int) -> Any:
        return _lease_json(await self.store.acquire(instance, info, ttl_s, min_epoch))

    async def _leader(self) -> Any:
        return _lease_json(await self.store.leader())

    async def _members(self) -> Any:
        return {k: _b64(v) for k, v in (await self.store.members()).items()}

    async def _get(self, key: str) -> Any:
        value = await self.store.get(key)
        return None if value is None else _b64(value)

    async def _range(self, key: str) -> Any:
        return [_b64(v) for v in await self.store.range(key)]

    async def _hgetall(self, key: str) -> Any:
        return {k: _b64(v) for k, v in (await self.store.hgetall(key)).items()}

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A socket file left by a host that died: nobody listens there any more.
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        self.path.chmod(0o600)  # the fleet's state: this user's processes only

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while True:
                try:
                    request = await _read(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(_frame(await self._answer(request)))
                await writer.drain()
        except (ValueError, orjson.JSONDecodeError) as e:
            log.warning("cluster store: dropping a client that sent a bad message: %s", e)
        finally:
            self._clients.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, request: Any) -> dict[str, Any]:
        try:
            op = self._ops[request["op"]]
            return {"ok": await op(*request.get("args", []))}
        except FencedOut as e:
            return {"error": "fenced", "epoch": e.epoch, "current": e.current}
        except (KeyError, TypeError, ValueError) as e:
            return {"error": "bad_request", "message": repr(e)}

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # Connected clients too: their handlers end at their next read, and a
            # server that is gone must look gone to every client at once.
            for writer in list(self._clients):
                writer.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class LocalStoreClient:
    """A `ClusterStore` served by a `StoreServer` at `path`; connects on first use and
    again after any failure."""

    def __init__(self, path: str | Path, timeout_s: float = 0.5) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _call(self, op: str, *args: Any) -> Any:
        async with self._lock:
            try:
                async with StoreTimeout(self.timeout_s):  # not fooled by this loop's stalls
                    if self._conn is None:
                        self._conn = await asyncio.open_unix_connection(str(self.path))
                    reader, writer = self._conn
                    writer.write(_frame({"op": op, "args": list(args)}))
                    await writer.drain()
                    answer = await _read(reader)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                self._drop()
                raise StoreUnavailable(f"local cluster store at {self.path}: {e!r}") from e
            except BaseException:
                # Cancelled between request and answer: the answer would be read as the
                # next call's. Only a fresh connection is in a known state.
                self._drop()
                raise
        if "ok" in answer:
            return answer["ok"]
        if answer.get("error") == "fenced":
            raise FencedOut(int(answer["epoch"]), int(answer["current"]))
        raise StoreUnavailable(f"local cluster store refused {op}: {answer.get('message')}")

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def acquire(
        self, instance: str, info: str, ttl_s: float, min_epoch: int = 0
    ) -> Lease | None:
        return _lease_from(await self._call("acquire", instance, info, ttl_s, min_epoch))

    async def release(self, instance: str) -> None:
        await self._call("release", instance)

    async def leader(self) -> Lease | None:
        return _lease_from(await self._call("leader"))

    async def raise_epoch(self, epoch: int) -> int:
        return int(await self._call("raise_epoch", epoch))

    async def heartbeat(self, instance: str, report: bytes, ttl_s: float) -> None:
        await self._call("heartbeat", instance, _b64(report), ttl_s)

    async def leave(self, instance: str) -> None:
        await self._call("leave", instance)

    async def members(self) -> dict[str, bytes]:
        return {k: _unb64(v) for k, v in (await self._call("members")).items()}

    async def put(self, key: str, value: bytes, epoch: int) -> None:
        await self._call("put", key, _b64(value), epoch)

    async def delete(self, key: str, epoch: int) -> None:
        await self._call("delete", key, epoch)

    async def get(self, key: str) -> bytes | None:
        value = await self._call("get", key)
        return None if value is None else _unb64(value)

    async def append(self, key: str, value: bytes, epoch: int, cap: int = DEFAULT_LIST_CAP) -> None:
        await self._call("append", key, _b64(value), epoch, cap)

    async def range(self, key: str) -> list[bytes]:
        return [_unb64(v) for v in await self._call("range", key)]

    async def hset(self, key: str, field: str, value: bytes, epoch: int) -> None:
        await self._call("hset", key, field, _b64(value), epoch)

    async def hdel(self, key: str, field: str, epoch: int) -> None:
        await self._call("hdel", key, field, epoch)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        return {k: _unb64(v) for k, v in (await self._call("hgetall", key)).items()}

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                writer = self._conn[1]
                self._conn = None
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()


async def host(path: str | Path) -> None:
    """Serve a fresh store at `path` until SIGTERM or SIGINT."""
    server = StoreServer(path)
    await server.start()
    print(f"seawall cluster store listening on unix:{server.path}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m seawall.cluster.local",
        description="Host the cluster store for gateway processes on this host.",
    )
    parser.add_argument("--socket", required=True, help="Unix socket path to listen on")
    args = parser.parse_args(argv)
    asyncio.run(host(args.socket))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
