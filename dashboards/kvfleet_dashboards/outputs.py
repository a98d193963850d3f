"""Every generated artefact, as {path: content}: one pure function the generator writes and tests compare."""

from __future__ import annotations

from pathlib import Path

from kvfleet_dashboards import alerts, chart
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS, render_dashboard

DASHBOARDS_DIR = chart.REPO / "dashboards"


def dashboard_file_name(uid: str) -> str:
    return uid.removeprefix("kvfleet-") + ".json"


def build_outputs() -> dict[Path, str]:
    """Dashboard JSON (dashboards/json and the chart's copy), alert rules (both), CRD templates, README."""
    out: dict[Path, str] = {}
    for spec in ALL_DASHBOARDS:
        text = render_dashboard(spec)
        name = dashboard_file_name(spec.uid)
        out[DASHBOARDS_DIR / "json" / name] = text
        out[chart.CHART / "files" / "dashboards" / name] = text
    rules = alerts.render_rules()
    out[DASHBOARDS_DIR / "rules" / "kvfleet-alerts.yaml"] = rules
    out[chart.CHART / "files" / "prometheus-rules.yaml"] = rules
    out.update(chart.crd_templates())
    out[chart.CHART / "README.md"] = chart.chart_readme()
    return out


def stale_outputs() -> list[Path]:
    """Generated files whose committed content differs from what the code generates now."""
    return [p for p, text in build_outputs().items() if not p.is_file() or p.read_text() != text]
