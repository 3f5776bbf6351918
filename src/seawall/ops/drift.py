"""Metric drift: names Seawall reads that a live engine (or gateway) does not export.

Owns the comparison and its wording. Engine upgrades rename metrics; an alert over a
missing series is silently never true, so this check is how an operator finds out
before an incident does. Must not do I/O: the CLI fetches the scrape and the rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from seawall.ops.engines import previous_name_of, removal_reason, rename_of
from seawall.ops.promql import escape_underscores

GATEWAY_PREFIX = "seawall_"
RELABEL_HINT = (
    "keep the metric_relabel_configs of deploy/prometheus/prometheus.yml (they restore "
    "the colon), or scrape vLLM's /metrics, which never negotiates"
)


@dataclass(frozen=True, slots=True)
class Drift:
    name: str  # the name Seawall uses
    used_by: tuple[str, ...]
    hint: str  # the known rename or removal, or "" when we know nothing

    def describe(self) -> str:
        line = f"{self.name}  (used by {', '.join(self.used_by)})"
        return f"{line}\n    {self.hint}" if self.hint else line


def is_gateway_name(name: str) -> bool:
    return name.startswith(GATEWAY_PREFIX)


def find_drift(
    used: Mapping[str, Iterable[str]], exposed: set[str], check_gateway: bool, check_engine: bool
) -> list[Drift]:
    """`used`: metric name -> who uses it. `exposed`: sample names in the scrape."""
    drifts: list[Drift] = []
    for name in sorted(used):
        if name in exposed:
            continue
        if is_gateway_name(name) and not check_gateway:
            continue
        if not is_gateway_name(name) and not check_engine:
            continue
        drifts.append(Drift(name, tuple(sorted(set(used[name]))), _hint(name, exposed)))
    return drifts


def escaped_name(name: str) -> str:
    """`name` as prometheus_client 0.23+ writes a sample when asked for OpenMetrics
    without `escaping=allow-utf-8` (Prometheus 2.x): `vllm:x` -> `vllm_x`."""
    return escape_underscores(name)


def _hint(name: str, exposed: set[str]) -> str:
    escaped = escaped_name(name)
    if escaped != name and escaped in exposed:
        return (
            f"stored as {escaped}: the target answered OpenMetrics with escaped names "
            "(prometheus_client 0.23+ negotiating with Prometheus 2.x, as vLLM's /metrics/ "
            f"mount and prometheus_client's own exporters do); {RELABEL_HINT}"
        )
    newer = rename_of(name)
    if newer is not None:
        state = "exported" if newer in exposed else "also not exported"
        return f"renamed: {name} -> {newer} ({state}); use {newer}"
    older = previous_name_of(name)
    if older is not None and older in exposed:
        return (
            f"the engine exports the old name {older} (renamed {older} -> {name}): "
            "it predates the rename; upgrade it or point the rule at the old name"
        )
    if older is not None:
        return f"formerly {older}; neither name is exported"
    why = removal_reason(name)
    if why is not None:
        return f"removed: {why}"
    return ""
