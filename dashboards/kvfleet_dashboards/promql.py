"""Just enough PromQL lexing to list the metric names an expression reads.

Not a parser (``promtool`` checks syntax); it removes what cannot be a metric name (strings, label
matchers, range and subquery brackets, grouping label lists, Grafana variables, numbers, durations) and
returns the identifiers left that are not functions, aggregations or keywords.
"""

from __future__ import annotations

import re

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
     "offset", "atan2", "inf", "nan", "start", "end"}
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")

#: What Grafana substitutes for its variables when a dashboard query runs; used to make a panel query
#: plain PromQL (for promtool and for running it against Prometheus).
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "1h",
}


def metric_names(expr: str) -> set[str]:
    """Metric names read by the PromQL ``expr`` (which may hold Grafana ``$variables``)."""
    text = _STRING.sub(" ", expr)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        ident, call = match.group(1), match.group(2)
        if call or ident.lower() in _KEYWORDS:
            continue
        names.add(ident)
    return names


def substitute_grafana_variables(expr: str, values: dict[str, str] | None = None) -> str:
    """``expr`` with Grafana's built-in interval variables and the given template variables replaced."""
    out = expr
    for name, value in {**GRAFANA_SUBSTITUTIONS, **(values or {})}.items():
        key = name if name.startswith("$") else f"${name}"
        out = out.replace(key, value)
    return out
