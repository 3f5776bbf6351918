"""Replica ports chosen by the local supervisor (actuate/local.py): free, and outside the
kernel's ephemeral range, so that nothing bound to port 0 can take one before its
replica binds it (a CI run lost a demo replica that way: the admin API got its port)."""

from __future__ import annotations

import random
import socket

from seawall.actuate.local import RESERVED_FROM, ephemeral_range, free_loopback_port


def test_a_replica_port_is_free_and_never_one_the_kernel_hands_out_for_port_0() -> None:
    low, high = ephemeral_range()
    rng = random.Random(7)
    for _ in range(50):
        port = free_loopback_port("127.0.0.1", rng)
        assert RESERVED_FROM <= port < low, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_port_in_use_is_never_chosen() -> None:
    rng = random.Random(7)
    first = free_loopback_port("127.0.0.1", random.Random(7))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        assert free_loopback_port("127.0.0.1", rng) != first  # same draw, then the next
