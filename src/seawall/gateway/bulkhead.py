"""The grammar bulkhead: which replicas a request may go to, by whether it is constrained.

A heavy structured-output grammar slows every decode step it shares (vLLM samples only
once the batch's grammar bitmask is filled; `protocol/structured.py`), so the plain
streams batched with it slow too. A tier may name replicas of its own for its
grammar-constrained requests (`TierConfig.grammar_replicas`); then:

- its constrained requests go only there: if none of them is usable the request fails
  (503, no replica) rather than spill its grammar onto everyone's replicas;
- plain requests, of every tier, avoid every tier's grammar replicas while any other
  replica of the model is usable (free or saturated: a plain request waits in a busy
  replica's queue rather than share steps with heavy grammars), and use them only when
  nothing else is left;
- constrained requests of a tier without grammar replicas go anywhere.

The tiers are the current configuration's (a reload may change them): `Bulkheads`
rebuilds the bulkhead when the tiers mapping is a new one, and only then.

Pure: filters candidate lists the dispatcher already holds; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from seawall.config import TierConfig


class _HasId(Protocol):
    id: str


R = TypeVar("R", bound=_HasId)


@dataclass(frozen=True, slots=True)
class Bulkhead:
    pools: Mapping[str, frozenset[str]]  # tier -> replica ids for its constrained requests
    reserved: frozenset[str]  # every tier's grammar replicas: plain requests avoid them

    @classmethod
    def from_tiers(cls, tiers: Mapping[str, TierConfig]) -> Bulkhead | None:
        pools = {
            name: frozenset(t.grammar_replicas)
            for name, t in tiers.items()
            if t.grammar_replicas is not None
        }
        if not pools:
            return None
        return cls(pools, frozenset().union(*pools.values()))

    def split(
        self, tier: str, constrained: bool, free: Sequence[R], saturated: Sequence[R]
    ) -> tuple[list[R], list[R]]:
        """(free, saturated) candidates this request may use."""
        if constrained:
            pool = self.pools.get(tier)
            if pool is None:
                return list(free), list(saturated)
            return [r for r in free if r.id in pool], [r for r in saturated if r.id in pool]
        outside_free = [r for r in free if r.id not in self.reserved]
        outside_saturated = [r for r in saturated if r.id not in self.reserved]
        if outside_free or outside_saturated:
            return outside_free, outside_saturated
        return list(free), list(saturated)


class Bulkheads:
    """The bulkhead of the current tiers (`tiers()`), rebuilt only when they change."""

    __slots__ = ("_built", "_tiers", "_tiers_of")

    def __init__(self, tiers: Callable[[], Mapping[str, TierConfig]]) -> None:
        self._tiers_of = tiers
        self._tiers: Mapping[str, TierConfig] | None = None
        self._built: Bulkhead | None = None

    def current(self) -> Bulkhead | None:
        tiers = self._tiers_of()
        if tiers is not self._tiers:
            self._tiers, self._built = tiers, Bulkhead.from_tiers(tiers)
        return self._built
