"""The cluster store over Redis: every gateway instance in the fleet shares it.

Owns `RedisStore`, a `ClusterStore` (see `store.py` for the semantics) whose
compare-and-set parts are Lua scripts, atomic on the server: taking or renewing the
lease, the fenced writes (epoch check and write in one step), and membership (a report
hash plus a sorted set of expiry times, pruned on every heartbeat). Times inside the
scripts are Redis's own (`TIME`), so instances with skewed clocks share one timeline.

Keys, under `key_prefix` (default `seawall:cluster:`): `epoch` (the fencing epoch),
`leader` (JSON holder/info/epoch, with a PX expiry: the lease TTL), `members` and
`members:exp`, and the callers' own `kv:<key>`, `list:<key>` and `hash:<key>`.

Retries: one, on a fresh connection, and only after a connection error (refused, reset,
closed): after Redis restarts, every connection idle in the pool is dead and fails its
first use, and that must not read as a second outage. Never after a timeout: a reply
that was merely late may have been applied, and the next tick comes anyway.

Must not: block a call longer than twice its socket timeout (`StoreTimeout`: once, and
once more after a stall of this process's own loop), or raise anything but
`StoreUnavailable` and `FencedOut`.
"""

from __future__ import annotations

from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from seawall.cluster.store import DEFAULT_LIST_CAP, FencedOut, Lease, StoreUnavailable
from seawall.state.store_timeout import StoreTimeout, client_backstop_s

# KEYS: leader, epoch. ARGV: instance, info, ttl ms, min epoch.
# Returns the lease as JSON when `instance` holds it afterwards, else false.
_ACQUIRE = r"""
local cur = redis.call('GET', KEYS[1])
if cur then
  local held = cjson.decode(cur)
  if held['holder'] ~= ARGV[1] then return false end
  held['info'] = ARGV[2]
  local renewed = cjson.encode(held)
  redis.call('SET', KEYS[1], renewed, 'PX', ARGV[3])
  return renewed
end
local epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[4])
if floor > epoch then epoch = floor end
epoch = epoch + 1
redis.call('SET', KEYS[2], epoch)
local lease = cjson.encode({holder = ARGV[1], info = ARGV[2], epoch = epoch})
redis.call('SET', KEYS[1], lease, 'PX', ARGV[3])
return lease
"""

# KEYS: leader. ARGV: instance.
_RELEASE = r"""
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['holder'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: epoch. ARGV: epoch. Returns the store's epoch afterwards.
_RAISE = r"""
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if wanted > epoch then
  redis.call('SET', KEYS[1], wanted)
  return wanted
end
return epoch
"""

_NOW_MS = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: members, members:exp. ARGV: instance, report, ttl ms.
_HEARTBEAT = (
    _NOW_MS
    + r"""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, name in ipairs(gone) do
  redis.call('ZREM', KEYS[2], name)
  redis.call('HDEL', KEYS[1], name)
end
return 1
"""
)

# KEYS: members, members:exp. Returns {name1, report1, name2, report2, ...}.
_MEMBERS = (
    _NOW_MS
    + r"""
local live = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')
local out = {}
if #live == 0 then return out end
local reports = redis.call('HMGET', KEYS[1], unpack(live))
for i, name in ipairs(live) do
  if reports[i] then
    out[#out + 1] = name
    out[#out + 1] = reports[i]
  end
end
return out
"""
)

# KEYS: epoch, target. ARGV: epoch, op, then the op's arguments.
# Refuses (an error reply `FENCED <current>`) a write with an epoch below the store's.
_FENCED = r"""
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[1])
if mine < epoch then return redis.error_reply('FENCED ' .. epoch) end
if mine > epoch then redis.call('SET', KEYS[1], mine) end
local op = ARGV[2]
if op == 'put' then
  redis.call('SET', KEYS[2], ARGV[3])
elseif op == 'del' then
  redis.call('DEL', KEYS[2])
elseif op == 'append' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[4]), -1)
elseif op == 'hset' then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
elseif op == 'hdel' then
  redis.call('HDEL', KEYS[2], ARGV[3])
else
  return redis.error_reply('unknown op ' .. op)
end
return 1
"""

_UNREACHABLE = (RedisError, OSError, TimeoutError)


def _lease(raw: Any) -> Lease | None:
    if not raw:
        return None
    data = orjson.loads(raw)
    return Lease(str(data["holder"]), str(data.get("info", "")), int(data["epoch"]))


class RedisStore:
    """`RedisStore(url)`; constructing it does no I/O (Redis connects on first use)."""

    def __init__(
        self, url: str, key_prefix: str = "seawall:cluster:", socket_timeout_s: float = 0.5
    ) -> None:
        self.prefix = key_prefix
        self.socket_timeout_s = socket_timeout_s
        self._redis = aioredis.Redis.from_url(
            url,
            # Each call, connecting included, is bounded by a `StoreTimeout` instead (a
            # stall of this process's loop is not Redis being slow); the client's own
            # connect timeout is only a backstop, longer.
            socket_timeout=None,
            socket_connect_timeout=client_backstop_s(socket_timeout_s),
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        r = self._redis
        self._acquire = r.register_script(_ACQUIRE)
        self._release = r.register_script(_RELEASE)
        self._raise = r.register_script(_RAISE)
        self._heartbeat = r.register_script(_HEARTBEAT)
        self._members = r.register_script(_MEMBERS)
        self._fenced = r.register_script(_FENCED)
        self._k_epoch = key_prefix + "epoch"
        self._k_leader = key_prefix + "leader"
        self._k_members = key_prefix + "members"
        self._k_members_exp = key_prefix + "members:exp"

    async def _call(self, coro: Any) -> Any:
        try:
            async with StoreTimeout(self.socket_timeout_s):
                return await coro
        except ResponseError as e:
            text = str(e)
            if text.startswith("FENCED"):
                raise
            raise StoreUnavailable(f"redis refused a cluster script: {text}") from e
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {e!r}") from e

    async def _write(self, key: str, epoch: int, op: str, *args: bytes | str | int) -> None:
        try:
            await self._call(self._fenced(keys=[self._k_epoch, key], args=[epoch, op, *args]))
        except ResponseError as e:
            current = int(str(e).split()[1])
            raise FencedOut(epoch, current) from None

    # -- leadership ---------------------------------------------------------------------

    async def acquire(
        self, instance: str, info: str, ttl_s: float, min_epoch: int = 0
    ) -> Lease | None:
        raw = await self._call(
            self._acquire(
                keys=[self._k_leader, self._k_epoch],
                args=[instance, info, max(1, int(ttl_s * 1000)), min_epoch],
            )
        )
        return _lease(raw)

    async def release(self, instance: str) -> None:
        await self._call(self._release(keys=[self._k_leader], args=[instance]))

    async def leader(self) -> Lease | None:
        return _lease(await self._call(self._redis.get(self._k_leader)))

    async def raise_epoch(self, epoch: int) -> int:
        return int(await self._call(self._raise(keys=[self._k_epoch], args=[epoch])))

    # -- membership ---------------------------------------------------------------------

    async def heartbeat(self, instance: str, report: bytes, ttl_s: float) -> None:
        await self._call(
            self._heartbeat(
                keys=[self._k_members, self._k_members_exp],
                args=[instance, report, max(1, int(ttl_s * 1000))],
            )
        )

    async def leave(self, instance: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(self._k_members_exp, instance)
        pipe.hdel(self._k_members, instance)
        await self._call(pipe.execute())

    async def members(self) -> dict[str, bytes]:
        flat = await self._call(self._members(keys=[self._k_members, self._k_members_exp]))
        return {flat[i].decode(): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}

    # -- fenced writes ------------------------------------------------------------------

    async def put(self, key: str, value: bytes, epoch: int) -> None:
        await self._write(self.prefix + "kv:" + key, epoch, "put", value)

    async def delete(self, key: str, epoch: int) -> None:
        await self._write(self.prefix + "kv:" + key, epoch, "del")

    async def get(self, key: str) -> bytes | None:
        raw = await self._call(self._redis.get(self.prefix + "kv:" + key))
        return None if raw is None else bytes(raw)

    async def append(self, key: str, value: bytes, epoch: int, cap: int = DEFAULT_LIST_CAP) -> None:
        await self._write(self.prefix + "list:" + key, epoch, "append", value, cap)

    async def range(self, key: str) -> list[bytes]:
        items = await self._call(self._redis.lrange(self.prefix + "list:" + key, 0, -1))
        return [bytes(i) for i in items]

    async def hset(self, key: str, field: str, value: bytes, epoch: int) -> None:
        await self._write(self.prefix + "hash:" + key, epoch, "hset", field, value)

    async def hdel(self, key: str, field: str, epoch: int) -> None:
        await self._write(self.prefix + "hash:" + key, epoch, "hdel", field)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        raw = await self._call(self._redis.hgetall(self.prefix + "hash:" + key))
        return {k.decode(): bytes(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._redis.aclose()
