"""Every PromQL query kvfleet ships (panel queries with Grafana's variables substituted, variable queries,
alert expressions) parses: promtool checks them as recording rules, and a broken query is caught."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from devcluster import find_binary
from devcluster.binaries import PROMETHEUS_COMMAND
from kvfleet_dashboards.dashboards import (
    ALL_DASHBOARDS,
    variable_queries,
)
from kvfleet_dashboards.promql import substitute_grafana_variables

from components import missing_component
from factories import all_promql


def _promtool() -> str:
    path = find_binary("promtool")
    if path is None:
        missing_component("promtool", PROMETHEUS_COMMAND)
    return str(path)


def _check_as_rules(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess[str]:
    rules = [{"record": f"kvfleet:panel_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "panel-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    return subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )


def test_every_panel_query_parses(tmp_path: Path) -> None:
    """promtool parses each panel query (Grafana's variables substituted) as a recording rule."""
    values = {"model": ".*", "tenant": ".*", "datasource": "prometheus"}
    exprs = [substitute_grafana_variables(e, values) for _, e in all_promql() if "label_values" not in e]
    exprs += [
        substitute_grafana_variables(e, values) for spec in ALL_DASHBOARDS for e in variable_queries(spec)
    ]
    assert all("$" not in e for e in exprs), [e for e in exprs if "$" in e]
    done = _check_as_rules(tmp_path, exprs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_a_broken_query_is_caught_by_promtool(tmp_path: Path) -> None:
    done = _check_as_rules(tmp_path, ["sum by (le (rate(x[5m]))"])
    assert done.returncode != 0
