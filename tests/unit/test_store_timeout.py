"""`StoreTimeout`: a call's timeout judges the store, not a stall of this process's loop.

The stall is real (`time.sleep` blocks the loop, as a GC pause or a starved CPU does);
nothing here asserts how long anything took, only which outcome the call had.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from seawall.state.store_timeout import StoreTimeout


async def _call(reply: asyncio.Future[str], delay: float) -> str:
    async with StoreTimeout(delay):
        return await reply


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair of sockets: the store's reply arrives on the first."""
    ours, store = socket.socketpair()
    ours.setblocking(False)
    yield ours, store
    ours.close()
    store.close()


async def _receive(sock: socket.socket, delay: float) -> bytes:
    async with StoreTimeout(delay):
        return await asyncio.get_running_loop().sock_recv(sock, 16)


async def test_a_store_that_never_answers_times_out() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await _call(never, 0.01)


async def test_a_reply_that_arrived_while_the_loop_was_stalled_is_read(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, store = pair
    call = asyncio.create_task(_receive(ours, 0.01))
    await asyncio.sleep(0)  # the call waits for its reply
    store.send(b"ok")  # the store answers at once...
    time.sleep(0.1)  # ...while this loop is blocked for ten times the timeout
    # The reply and the timer are seen in one turn of the loop: asyncio.timeout would
    # have cancelled the call with its reply in the buffer.
    assert await call == b"ok"


async def test_a_call_that_started_just_before_a_stall_gets_its_time_after_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, store = pair
    call = asyncio.create_task(_receive(ours, 0.2))
    await asyncio.sleep(0)
    time.sleep(0.3)  # blocked past the deadline before the store could answer
    asyncio.get_running_loop().call_later(0.005, store.send, b"ok")  # it answers after
    assert await call == b"ok"


async def test_after_its_one_grace_a_silent_store_still_times_out() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(_call(never, 0.01))
    await asyncio.sleep(0)
    time.sleep(0.05)
    with pytest.raises(TimeoutError):
        await call


async def test_the_callers_own_cancellation_stays_a_cancellation() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(_call(never, 10.0))
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_no_timer_outlives_the_call() -> None:
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[str] = loop.create_future()
    reply.set_result("ok")
    assert await _call(reply, 0.01) == "ok"
    await asyncio.sleep(0.03)  # past the deadline: a leftover timer would cancel this task
    assert asyncio.current_task() is not None and not asyncio.current_task().cancelling()  # type: ignore[union-attr]
