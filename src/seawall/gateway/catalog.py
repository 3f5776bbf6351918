"""The models the fleet serves, learnt from the replicas' own `GET /v1/models`.

A replica configured without a model gets the first one it serves; each model's card
(vLLM's includes `max_model_len`) is kept, by served name, so that `/v1/models` answers
with the engines' own cards (under the public names, see `aliases.py`) and admission
can cap a request's KV reservation at the context length. Runs off the request path;
the request path reads `card` and `max_model_len`.

Must not: route or refuse (it only learns).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from seawall.fleet.probes import forget_failure
from seawall.gateway.replicas import ReplicaSet

_PENDING_INTERVAL_S = 1.0  # a replica whose model is not known yet is asked again soon
_KNOWN_INTERVAL_S = 5.0


class ModelCatalog:
    def __init__(
        self,
        replicas: ReplicaSet,
        on_new_card: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.cards: dict[str, dict[str, Any]] = {}
        self._on_new_card = on_new_card

    def card(self, public: str) -> dict[str, Any] | None:
        """The engine's card for a public model name, under that name (an alias's card is
        its served model's, with `id` the alias; vLLM's `root` still names the weights)."""
        found = self._served_card(public)
        if found is None:
            return None
        served, card = found
        return card if served == public else {**card, "id": public}

    def max_model_len(self, public: str) -> int | None:
        """Asked once per request: read from the served model's card in place."""
        found = self._served_card(public)
        cap = found[1].get("max_model_len") if found is not None else None
        return cap if isinstance(cap, int) and cap > 0 else None

    def _served_card(self, public: str) -> tuple[str, dict[str, Any]] | None:
        """(served model, its card) for a public name, from the first replica that has it."""
        for r in self.replicas:
            if r.public == public and r.model is not None:
                card = self.cards.get(r.model)
                if card is not None:
                    return r.model, card
        return None

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Learn each replica's served model (and its card), for as long as it runs."""
        while True:
            pending = [
                r for r in self.replicas.all() if r.model is None or r.model not in self.cards
            ]
            for r in pending:
                try:
                    auth = {"Authorization": f"Bearer {r.api_key}"} if r.api_key else None
                    async with session.get(
                        r.url + "/v1/models", headers=auth, timeout=aiohttp.ClientTimeout(total=2.0)
                    ) as resp:
                        if resp.status != 200:
                            continue
                        cards = (await resp.json()).get("data") or []
                        if not cards:
                            continue
                        if r.model is None:
                            r.model = str(cards[0]["id"])
                        for card in cards:
                            self._learn(str(card["id"]), card)
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                    forget_failure(exc)  # asked again in a second: leave no cycle each time
            await asyncio.sleep(_PENDING_INTERVAL_S if pending else _KNOWN_INTERVAL_S)

    def _learn(self, model: str, card: dict[str, Any]) -> None:
        if model in self.cards:
            return
        self.cards[model] = card
        if self._on_new_card is not None:
            self._on_new_card(model, card)
