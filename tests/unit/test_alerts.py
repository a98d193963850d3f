"""kvfleet's alert rules: promtool accepts them, promtool's unit tests fire and spare each alert, every
alert the issue asks for exists, and every runbook link lands on a section of docs/operations.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary
from devcluster.binaries import PROMETHEUS_COMMAND
from kvfleet_dashboards.alerts import ALERTS, build_rule_groups

from conftest import missing_component

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "rules" / "kvfleet-alerts.yaml"
RULE_TESTS = REPO / "dashboards" / "rules" / "kvfleet-alerts_test.yaml"
CHART_RULES = REPO / "charts" / "kvfleet" / "files" / "prometheus-rules.yaml"
OPERATIONS = REPO / "docs" / "operations.md"

#: What the issue asks alerts for, and the alert that covers each.
REQUIRED = {
    "KV cache usage above 90%": "KvfleetKVCacheNearlyFull",
    "tenant TTFT p99 above 500 ms": "KvfleetTenantTTFTSLOBreached",
    "tenant sustained over quota": "KvfleetTenantOverQuota",
    "eviction storm": "KvfleetKVEvictionStorm",
    "operator reconcile errors": "KvfleetOperatorReconcileErrors",
    "gateway upstream errors": "KvfleetGatewayUpstreamErrors",
}


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


def _cases() -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    spec: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    for test in spec["tests"]:
        for case in test.get("alert_rule_test", []):
            kind = "fires" if case.get("exp_alerts") else "silent"
            counts.setdefault(case["alertname"], {"fires": 0, "silent": 0})[kind] += 1
    return counts


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    cases = _cases()
    for alert in ALERTS:
        assert cases.get(alert.name, {}).get("fires", 0) >= 1, f"{alert.name}: no case that fires it"
        assert cases.get(alert.name, {}).get("silent", 0) >= 1, f"{alert.name}: no case where it stays silent"


def test_every_alert_the_issue_asks_for_exists() -> None:
    names = {alert.name for alert in ALERTS}
    for what, name in REQUIRED.items():
        assert name in names, f"no alert for {what}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def test_every_alert_has_a_runbook_section_and_severity() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for rule in build_rule_groups()["groups"][0]["rules"]:
        runbook = rule["annotations"]["runbook"]
        assert runbook.startswith("docs/operations.md#"), runbook
        assert runbook.split("#", 1)[1] in anchors, f"{rule['alert']}: {runbook} is not a heading"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
