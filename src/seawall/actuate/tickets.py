"""Hardware tickets: how a cordoned failure domain reaches a human.

Owns the ticket's shape and its delivery: always an ERROR log line with the evidence
(`HARDWARE TICKET node=... {json}`), a count for the `hardware_tickets` metric, and,
when `fleet.hardware_ticket_webhook_url` is set, the same JSON POSTed to that webhook
(an incident tool, a chat hook). A webhook that fails or times out is logged; the
cordon stands either way.

Must not decide when to open one (the fleet monitor does, on a cordon with evidence) or
own the HTTP session (the caller's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from seawall import clock
from seawall.actuate.base import Evidence

log = logging.getLogger(__name__)


def ticket_body(evidence: Evidence, at_wall: float) -> dict[str, Any]:
    return {
        "node": evidence.node,
        "reasons": list(evidence.reasons),
        "restarts": [
            {"at_wall": t, "replica": replica, "reason": why}
            for t, replica, why in evidence.restarts
        ],
        "extra": evidence.extra,
        "at_wall": at_wall,
    }


class HardwareTickets:
    def __init__(
        self,
        webhook_url: str | None,
        timeout_s: float,
        on_ticket: Callable[[str], None] | None = None,
    ) -> None:
        self.webhook_url = webhook_url
        self.timeout_s = timeout_s
        self._on_ticket = on_ticket

    async def open(self, session: aiohttp.ClientSession, evidence: Evidence) -> None:
        body = ticket_body(evidence, clock.wall())
        log.error("HARDWARE TICKET node=%s %s", evidence.node, orjson.dumps(body).decode())
        if self._on_ticket is not None:
            self._on_ticket(evidence.node)
        if self.webhook_url is None:
            return
        try:
            async with session.post(
                self.webhook_url,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                if resp.status >= 300:
                    log.error("hardware ticket webhook answered %d", resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.error("hardware ticket webhook failed: %r", exc)
