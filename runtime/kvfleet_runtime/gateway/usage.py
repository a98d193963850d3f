"""The bill: per-tenant, per-day usage from the gateway's metering counters in Prometheus. Pure.

``kvfleet usage`` (``gateway.usage_cli``) asks Prometheus for the raw samples of each metered counter
over each UTC day (``build_day_query``) and turns the answers into rows here. What a row counts, per
(day, namespace, ModelDeployment, tenant):

| column | counter (``gateway.metrics``) |
|---|---|
| ``requests`` | ``kvfleet_gateway_responses_total`` (every API answer, any status) |
| ``ok`` | the same with a 2xx ``code`` |
| ``throttled`` | ``kvfleet_gateway_throttled_total`` (429 from admission) |
| ``prompt_tokens`` | ``kvfleet_gateway_prompt_tokens_total`` (the engine's ``usage.prompt_tokens``) |
| ``cached_tokens`` | ``kvfleet_gateway_cached_prompt_tokens_total`` (``usage.prompt_tokens_details``) |
| ``completion_tokens`` | ``kvfleet_gateway_completion_tokens_total`` (``usage.completion_tokens``) |

Why raw samples and not PromQL's ``increase()``: ``increase`` extrapolates to the window's edges and
ignores what a counter held at its first sample, so its figures are fractional and do not add up to what
the engine counted. A bill has to. ``series_increase`` counts exactly what a counter gained in the day:
from its last sample before the day (or from 0 for a counter born in the day: a counter starts at 0) to
its last sample in the day, a drop counted as a restart (the value after it is all new). Samples are
fetched ``LOOKBACK_S`` before the day (Prometheus's staleness period) to find that baseline; a series
that reappears after a longer gap is taken as new.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Final

from kvfleet_runtime.gateway import metrics as m

DAY_S: Final = 86_400
#: How far before a day the baseline sample may lie (Prometheus's default staleness period).
LOOKBACK_S: Final = 300
#: The labels a row is grouped by. ``namespace`` comes from Prometheus's target labels (a
#: ServiceMonitor adds it); a series without it is billed under "".
GROUP_LABELS: Final = ("namespace", m.MODEL_DEPLOYMENT_LABEL, "tenant")


#: A series' raw samples, ``(timestamp, value)`` in time order.
Samples = list[tuple[float, float]]


@dataclass(frozen=True)
class Column:
    """One column of the bill: the counter it sums and an optional label matcher."""

    name: str
    metric: str
    matcher: str = ""


COLUMNS: Final = (
    Column("requests", m.RESPONSES_TOTAL),
    Column("ok", m.RESPONSES_TOTAL, 'code=~"2.."'),
    Column("throttled", m.THROTTLED_TOTAL),
    Column("prompt_tokens", m.PROMPT_TOKENS_TOTAL),
    Column("cached_tokens", m.CACHED_PROMPT_TOKENS_TOTAL),
    Column("completion_tokens", m.COMPLETION_TOKENS_TOTAL),
)
COLUMN_NAMES: Final = tuple(c.name for c in COLUMNS)
HEADER: Final = ("day", *GROUP_LABELS, *COLUMN_NAMES)


@dataclass(frozen=True)
class DayWindow:
    """One UTC day of the bill; ``end`` is the day's end, or "now" for the current day."""

    day: date
    start: float
    end: float


@dataclass
class UsageRow:
    """What one tenant of one ModelDeployment used on one day (each column a count, see the module)."""

    day: date
    namespace: str
    model_deployment: str
    tenant: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLUMN_NAMES, 0))

    @property
    def key(self) -> tuple[date, str, str, str]:
        return (self.day, self.namespace, self.model_deployment, self.tenant)


def day_windows(last_day: date, days: int, now: float) -> list[DayWindow]:
    """The ``days`` UTC days ending with ``last_day``, oldest first; none reaches past ``now``."""
    if days < 1:
        raise ValueError("days must be at least 1")
    out = []
    for i in range(days - 1, -1, -1):
        day = last_day - timedelta(days=i)
        start = datetime.combine(day, time(), tzinfo=UTC).timestamp()
        if start >= now:
            continue
        out.append(DayWindow(day, start, min(start + DAY_S, now)))
    return out


def build_selector(column: Column, filters: Mapping[str, str]) -> str:
    """``metric{matchers}`` for ``column``, restricted to the exact label values in ``filters``."""
    matchers = [column.matcher] if column.matcher else []
    matchers += [f'{label}="{_escape(value)}"' for label, value in sorted(filters.items())]
    return f"{column.metric}{{{', '.join(matchers)}}}" if matchers else column.metric


def build_day_query(column: Column, window: DayWindow, filters: Mapping[str, str]) -> str:
    """The instant query (evaluated at ``window.end``) that returns every raw sample ``series_increase``
    needs: the whole window plus ``LOOKBACK_S`` before it."""
    seconds = round(window.end - window.start) + LOOKBACK_S
    return f"{build_selector(column, filters)}[{seconds}s]"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def series_increase(samples: Sequence[tuple[float, float]], start: float) -> float:
    """What a counter gained after ``start``, from its samples ``(timestamp, value)`` in time order.

    The baseline is the last sample at or before ``start`` (0 when there is none: the counter was born
    in the window); each later sample adds its rise over the previous one, or its whole value after a
    drop (the process restarted and counted from 0 again).
    """
    previous = 0.0
    gained = 0.0
    for ts, value in samples:
        if ts <= start:
            previous = value
            continue
        gained += value - previous if value >= previous else value
        previous = value
    return gained


def parse_matrix(
    result: Iterable[Mapping[str, Any]],
) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
    """Prometheus's ``matrix`` result (``[{"metric": {...}, "values": [[ts, "v"], ...]}, ...]``) as
    (labels, samples) pairs."""
    out = []
    for series in result:
        labels = {str(k): str(v) for k, v in dict(series.get("metric") or {}).items()}
        samples = [(float(ts), float(value)) for ts, value in series.get("values") or []]
        out.append((labels, samples))
    return out


def add_column(
    rows: dict[tuple[date, str, str, str], UsageRow],
    column: str,
    window: DayWindow,
    series: Iterable[tuple[Mapping[str, str], Sequence[tuple[float, float]]]],
) -> None:
    """Add each series' gain over ``window`` to its row's ``column`` (rows are created as needed)."""
    for labels, samples in series:
        gained = series_increase(samples, window.start)
        if not gained:
            continue
        ns, md, tenant = (labels.get(label, "") for label in GROUP_LABELS)
        row = rows.get((window.day, ns, md, tenant))
        if row is None:
            row = rows[(window.day, ns, md, tenant)] = UsageRow(window.day, ns, md, tenant)
        row.counts[column] += round(gained)


def sorted_rows(rows: Mapping[tuple[date, str, str, str], UsageRow]) -> list[UsageRow]:
    return [rows[key] for key in sorted(rows)]


def row_values(row: UsageRow) -> list[str]:
    return [
        row.day.isoformat(),
        row.namespace,
        row.model_deployment,
        row.tenant,
        *(str(row.counts[c]) for c in COLUMN_NAMES),
    ]


def render_csv(rows: Sequence[UsageRow]) -> str:
    """The bill as CSV (a header line, then one line per row; counts as plain integers)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(HEADER)
    writer.writerows(row_values(r) for r in rows)
    return buffer.getvalue()


def render_table(rows: Sequence[UsageRow]) -> str:
    """The bill as an aligned text table (counts right-aligned), with a total line per day."""
    lines = [list(HEADER)]
    for day in sorted({r.day for r in rows}):
        of_day = [r for r in rows if r.day == day]
        lines += [row_values(r) for r in of_day]
        if len(of_day) > 1:
            totals = [str(sum(r.counts[c] for r in of_day)) for c in COLUMN_NAMES]
            lines.append([day.isoformat(), "", "", "(total)", *totals])
    if not rows:
        return "no usage recorded in these days\n"
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    text = []
    for line in lines:
        cells = [
            cell.ljust(widths[i]) if i <= len(GROUP_LABELS) else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ]
        text.append("  ".join(cells).rstrip())
    return "\n".join(text) + "\n"
