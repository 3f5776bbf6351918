"""Pure reliability decisions: every rule the gateway and the fleet controller apply.

Owns: rate and budget arithmetic (`token_bucket`, `retry_budget`), request limits
(`limits`), request timeouts (`deadline`), admission (`admission`), replica choice
(`balance`), hedging (`hedge`), the replica state machine (`health`) and health score
(`score`), stuck and storm detection (`watchdog`, `storm`), and the cordon rule
(`ledger`).

Must not: do I/O, use asyncio, or read the clock. Time is always an argument (`now`,
monotonic seconds unless a name says `_wall`), so every rule here is tested instantly
and exactly, and the shells that call these modules are the only places time comes from.
"""
