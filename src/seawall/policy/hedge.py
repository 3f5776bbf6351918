"""When to hedge: send a second copy of a request if the first is slow to start.

A hedge trades extra load for lower tail latency: if the first replica has not produced
its first token after `delay_s`, the gateway sends the same request to another replica
and streams whichever answers first. That trade is only good in one corner:

- Short prompts. The duplicated work is the prefill of the prompt plus whatever the
  loser generates before it is cancelled. For a short prompt that is cheap; for a long
  one, the hedge doubles the most expensive part of the request.
- A lightly loaded fleet. On a busy fleet, slowness is usually queueing everywhere, and a
  hedge just adds to every queue: it turns an overload into a worse overload. Hedging
  helps when one replica is slow (a straggler) and the others have room.

Every hedge also withdraws from the retry budget (see `retry_budget`), which bounds the
aggregate extra load; this module only decides eligibility per request.

Must not: read the clock, schedule the delay, or touch the budget. The gateway owns the
timer and the budget; this module is the yes/no.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """Hedging configuration.

    `delay_s`: how long the first attempt may go without a first token before a hedge is
    sent. `max_prompt_tokens`: prompts longer than this are never hedged.
    `max_fleet_load`: hedge only while fleet load (the caller's measure, e.g. mean KV
    usage or in-flight per replica; same unit as `fleet_load`) is at or below this.
    """

    delay_s: float
    max_prompt_tokens: int
    max_fleet_load: float

    def allows(self, prompt_tokens: int, fleet_load: float) -> bool:
        return should_hedge(prompt_tokens, self.max_prompt_tokens, fleet_load, self.max_fleet_load)


def should_hedge(
    prompt_tokens: int, max_prompt_tokens: int, fleet_load: float, max_fleet_load: float
) -> bool:
    """True when the prompt is short enough and the fleet lightly loaded enough to hedge.

    Both limits are inclusive. A NaN load (no measurement) never hedges: without knowing
    the fleet has room, the safe answer is not to add load.
    """
    return prompt_tokens <= max_prompt_tokens and fleet_load <= max_fleet_load
