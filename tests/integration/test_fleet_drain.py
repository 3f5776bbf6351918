"""A drain-then-restart ordered through the admin API, through the whole product:
`seawall up` (the local supervisor restarts real `seawall sim` processes), the gateway
in-process with its admin API, and a plain HTTP client.

The drain must wait for every request in flight on the replica, streamed or not, before
the restart: a non-streaming completion is as much in flight as a stream is.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fleet import MODEL, running, wait_until
from tests.support.up import AUTH, start_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# About 3 s at the sim's 5 ms step: long enough to be mid-generation when the drain
# is ordered, short enough for the drain's 30 s deadline.
LONG_UNARY_TOKENS = 600


def test_a_restart_drain_lets_a_non_streaming_request_finish(artifacts: Path) -> None:
    up = start_up(artifacts, replicas=1)
    with running(up.proc):
        result: dict[str, Any] = {}

        def unary() -> None:
            r = httpx.post(
                up.api + "/v1/completions",
                timeout=60,
                json={
                    "model": MODEL,
                    "prompt": "x",
                    "max_tokens": LONG_UNARY_TOKENS,
                    "ignore_eos": True,
                },
            )
            result["status"], result["body"] = r.status_code, r.json()

        t = threading.Thread(target=unary)
        t.start()
        wait_until(lambda: up.replica("r0")["inflight"] == 1, 10, what="the request in flight")
        r = httpx.post(up.admin + "/admin/replicas/r0/drain", params={"restart": "1"}, headers=AUTH)
        assert r.status_code == 200, r.text
        t.join(timeout=60)
        assert result["status"] == 200, result
        assert result["body"]["usage"]["completion_tokens"] == LONG_UNARY_TOKENS
        # ...and the drain did end in a restart, once the request was done.
        wait_until(
            lambda: up.replica("r0")["restarts"] == 1 and up.replica("r0")["routable"],
            30,
            what="r0 restarted and routable again",
        )
        transitions = httpx.get(up.admin + "/admin/state", headers=AUTH).json()["transitions"]
        drained = [t for t in transitions if t["event"] == "drained"]
        assert drained and drained[-1]["reason"].endswith("0 requests left"), drained
