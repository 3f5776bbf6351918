"""Metric names out of PromQL, and sample names out of a Prometheus text scrape.

Owns the two small parsers the drift check and the dashboard test share. Must not do
I/O. The PromQL reader is a scanner, not a full parser: it finds every bare metric
selector name, which is all a "does this metric exist" check needs.
"""

from __future__ import annotations

import re

# Words that look like identifiers but never name a metric.
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
        "atan2",
        # Aggregations may be followed by `by (...)` rather than `(`.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
# Followed by a parenthesised list of label names, not an expression.
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)[a-zA-Z]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<var>\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?)
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<space>\s+)
  | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (Grafana `$vars` tolerated)."""
    tokens = [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(expr)]
    tokens = [t for t in tokens if t[0] != "space"]
    names: set[str] = set()
    # Inside `{...}` (label matchers) and `[...]` (ranges), identifiers are labels or
    # durations; inside the parentheses after `by`/`on`/... they are label names.
    stack: list[str] = []
    label_list_next = False
    for i, (kind, text) in enumerate(tokens):
        if kind == "open":
            if text == "(" and label_list_next:
                stack.append("labels")
            else:
                stack.append(text)
            label_list_next = False
            continue
        if kind == "close":
            if stack:
                stack.pop()
            continue
        if kind != "ident":
            label_list_next = False
            continue
        in_labels = bool(stack) and stack[-1] in ("{", "[", "labels")
        lowered = text.lower()
        label_list_next = lowered in _LABEL_LIST_KEYWORDS
        if in_labels or lowered in _KEYWORDS:
            continue
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if following == ("open", "("):
            continue  # a function or aggregation
        names.add(text)
    return names


def exposed_sample_names(text: str) -> set[str]:
    """Sample names in a Prometheus text (or OpenMetrics) exposition, including the
    samples a `# TYPE` line declares: a labelled family with no child yet prints only
    its HELP and TYPE, and it is exported all the same (its series appear with traffic).
    """
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE "):
            names |= _declared(line.split()[2:])
            continue
        if not line or line.startswith("#"):
            continue
        end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if at != -1:
                end = min(end, at)
        names.add(line[:end])
    return names


def _declared(fields: list[str]) -> set[str]:
    if len(fields) < 2:
        return set()
    name, kind = fields[0], fields[1]
    if kind in ("histogram", "gaugehistogram"):
        return {name + "_bucket", name + "_sum", name + "_count"}
    if kind == "summary":
        return {name, name + "_sum", name + "_count"}
    if kind == "counter" and not name.endswith("_total"):
        return {name + "_total"}  # OpenMetrics declares counters without the suffix
    return {name}


def escape_underscores(name: str) -> str:
    """prometheus_client's `underscores` escaping of a sample name: every character
    outside [a-zA-Z0-9_] becomes `_` (the client checks sample names with its label-name
    rule, so the `:` of `vllm:` goes too; its `# TYPE` lines keep it)."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)


def stored_sample_names(text: str, content_type: str = "") -> set[str]:
    """The metric names a Prometheus server stores from this scrape: the names on the
    sample lines, which are not always the `# TYPE` names (prometheus_client 0.23+
    escapes samples, not TYPE lines, when the answer says `escaping=underscores`). A
    family with no sample yet counts by its `# TYPE` line, escaped the same way."""
    samples: set[str] = set()
    declared: dict[str, set[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("# TYPE "):
            fields = line.split()[2:]
            if fields:
                declared[fields[0]] = _declared(fields)
            continue
        if not line or line.startswith("#"):
            continue
        end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if at != -1:
                end = min(end, at)
        samples.add(line[:end])
    escaped = "escaping=underscores" in content_type.replace(" ", "")
    names = set(samples)
    for family, family_samples in declared.items():
        if escaped:
            family_samples = {escape_underscores(n) for n in family_samples}
            family = escape_underscores(family)
        if not any(s == family or s.startswith(family + "_") for s in samples):
            names |= family_samples
    return names
