"""The operator toolkit: what an operator runs around the gateway, never on its request path.

- `rules`, `engines`, `alerts_cli`: Prometheus alert rules per engine (`seawall alerts`).
- `drift`, `promql`: metric names Seawall reads that a live scrape lacks (`seawall alerts check`).
- `budget`, `budget_prom`, `budget_cli`: the error-budget calculator (`seawall budget`).
- `domains`, `map_cli`: the failure-domain map (`seawall map`).
- `dashboard`: the Grafana dashboard in deploy/grafana.
"""
