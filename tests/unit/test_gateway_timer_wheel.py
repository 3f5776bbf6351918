"""The request path's timer wheel (gateway/idle.py): deadlines fire once due, never before,
at most one tick late; cleared ones never fire; the one loop timer follows the earliest
deadline still set. Time is passed in; the wheel's tick is called by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from seawall import clock
from seawall.gateway import idle
from seawall.gateway.idle import TICK_S, Callback, Entry, Expiry, Wheel


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def entry(fired: list[str], name: str) -> Entry:
    return Callback(lambda: fired.append(name))


def test_a_deadline_fires_once_due_never_before_and_within_a_tick(
    loop: asyncio.AbstractEventLoop,
) -> None:
    now = Clock()
    wheel = Wheel(loop, now)
    fired: list[str] = []
    wheel.set(entry(fired, "a"), now.t + 0.5)
    wheel.set(entry(fired, "b"), now.t + 2.0)
    now.t += 0.5 - TICK_S / 2
    wheel._tick()
    assert fired == []  # not early
    now.t += TICK_S
    wheel._tick()
    assert fired == ["a"]  # within one tick of its deadline
    assert wheel.next_tick is not None and wheel.next_tick >= 1002.0
    now.t += 5.0
    wheel._tick()
    assert fired == ["a", "b"]
    assert wheel.next_tick is None and len(wheel) == 0


def test_a_cleared_deadline_never_fires_and_the_timer_moves_to_the_next(
    loop: asyncio.AbstractEventLoop,
) -> None:
    now = Clock()
    wheel = Wheel(loop, now)
    fired: list[str] = []
    first, later = entry(fired, "first"), entry(fired, "later")
    wheel.set(first, now.t + 1.0)
    wheel.set(later, now.t + 30.0)
    assert wheel.next_tick == pytest.approx(1001.0)
    wheel.clear(first)
    wheel.clear(first)  # twice is harmless
    now.t += 1.5
    wheel._tick()  # the timer set for `first` fires and finds it gone
    assert fired == []
    assert wheel.next_tick == pytest.approx(1030.0)
    now.t += 30.0
    wheel._tick()
    assert fired == ["later"]


def test_an_earlier_deadline_moves_the_timer_and_a_fired_entry_can_be_set_again(
    loop: asyncio.AbstractEventLoop,
) -> None:
    now = Clock()
    wheel = Wheel(loop, now)
    fired: list[float] = []
    again = Callback(lambda: None)

    def idle_check() -> None:  # as IdleDeadline does when chunks came meanwhile
        fired.append(now.t)
        if len(fired) < 3:
            wheel.set(again, now.t + 1.0)

    again.fn = idle_check
    wheel.set(Callback(lambda: None), now.t + 30.0)
    wheel.set(again, now.t + 1.0)
    assert wheel.next_tick == pytest.approx(1001.0)
    for _ in range(3):
        now.t += 1.0 + TICK_S
        wheel._tick()
    assert len(fired) == 3
    assert wheel.next_tick == pytest.approx(1030.0)
    assert len(wheel) == 1


def test_an_expiry_disarmed_as_its_wait_ends_says_whether_the_task_may_go_on(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first token's socket callback disarms the attempt's time-to-first-token expiry
    before it writes the token to the client (upstream._Head): the write must not happen
    when the expiry fired in the same turn of the loop (the attempt is timing out and
    will be retried elsewhere), and a disarmed expiry must never fire afterwards."""
    now = Clock()
    monkeypatch.setattr(clock, "monotonic", now)  # where an expiry reads its start
    wheel = Wheel(loop, now)
    idle._WHEELS[loop] = wheel  # the loop's wheel, on the test's time

    async def attempt() -> None:
        in_time = Expiry(5.0)
        assert in_time.disarm()  # nothing cancels the task: the token may go out
        now.t += 60.0
        wheel._tick()
        await asyncio.sleep(0)  # disarmed: it did not fire

        too_late = Expiry(5.0)
        now.t += 5.0 + TICK_S
        wheel._tick()  # due in the same turn as the token's callback, which comes after
        assert not too_late.disarm()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(0)
        assert too_late.expired()  # the attempt reports a timeout, not a client that left

    loop.run_until_complete(attempt())
