"""kvfleet's alert rules through promtool: ``promtool check rules`` accepts the rules and the chart's copy,
``promtool test rules`` fires and spares each alert, and with a threshold broken those unit tests fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from devcluster import find_binary
from devcluster.binaries import PROMETHEUS_COMMAND
from kvfleet_dashboards.alerts import ALERTS, build_rule_groups

from components import missing_component

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "rules" / "kvfleet-alerts.yaml"
RULE_TESTS = REPO / "dashboards" / "rules" / "kvfleet-alerts_test.yaml"
CHART_RULES = REPO / "charts" / "kvfleet" / "files" / "prometheus-rules.yaml"


def _promtool() -> str:
    path = find_binary("promtool")
    if path is None:
        missing_component("promtool", PROMETHEUS_COMMAND)
    return str(path)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("path", [RULES, CHART_RULES], ids=["rules", "chart-copy"])
def test_promtool_check_rules_passes(path: Path) -> None:
    done = _run(_promtool(), "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_promtool_unit_tests_pass() -> None:
    done = _run(_promtool(), "test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_broken_threshold_makes_promtool_tests_fail(tmp_path: Path) -> None:
    """The unit tests can fail: with the KV threshold moved to 99% the firing case no longer fires."""
    groups = build_rule_groups()
    for rule in groups["groups"][0]["rules"]:
        if rule["alert"] == "KvfleetKVCacheNearlyFull":
            rule["expr"] = rule["expr"].replace("> 0.9", "> 0.99")
    (tmp_path / "kvfleet-alerts.yaml").write_text(yaml.safe_dump(groups))
    (tmp_path / "tests.yaml").write_text(RULE_TESTS.read_text())
    done = _run(_promtool(), "test", "rules", str(tmp_path / "tests.yaml"))
    assert done.returncode != 0
    assert "KvfleetKVCacheNearlyFull" in done.stdout + done.stderr
