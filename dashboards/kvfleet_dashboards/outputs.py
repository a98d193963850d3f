"""The dashboards' and alert rules' generated files, as {path relative to the repository root: content}.

One pure function; ``make generate`` (hack/generate.py) writes its result, adds the chart's copies
(hack/chartgen.py decides where the chart keeps them) and checks that nothing committed has drifted.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from kvfleet_dashboards import alerts, seriesdoc
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS, render_dashboard

DASHBOARDS_DIR = PurePosixPath("dashboards")
DASHBOARD_JSON_DIR = DASHBOARDS_DIR / "json"
RULES_FILE = DASHBOARDS_DIR / "rules" / "kvfleet-alerts.yaml"
SERIES_DOC = PurePosixPath("docs/dashboard-series.md")


def dashboard_file_name(uid: str) -> str:
    return uid.removeprefix("kvfleet-") + ".json"


def build_outputs() -> dict[PurePosixPath, str]:
    """Every dashboard's JSON (dashboards/json/<uid without kvfleet->.json), the alert rules, and the
    table of the series each panel and alert reads (docs/dashboard-series.md)."""
    out = {
        DASHBOARD_JSON_DIR / dashboard_file_name(spec.uid): render_dashboard(spec) for spec in ALL_DASHBOARDS
    }
    out[RULES_FILE] = alerts.render_rules()
    out[SERIES_DOC] = seriesdoc.build_series_doc()
    return out
