"""The one place Seawall reads time.

Pure policy code never calls this module: it takes `now` as an argument. Only the I/O
shells (gateway, fleet monitors, emulator server) read the clock, and only through here,
so that a reader can find every time source with one grep.
"""

from __future__ import annotations

import time


def monotonic() -> float:
    """Seconds on a monotonic clock: use for every interval, deadline and rate."""
    return time.monotonic()


def wall() -> float:
    """Unix seconds: use only for timestamps shown to people or other systems."""
    return time.time()
