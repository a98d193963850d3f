"""kvfleet's alert rules as data: every alert has a promtool case that fires it and one where it stays
silent, every alert the requirements name exists (KV cache nearly full, TTFT SLO, over quota, eviction
storm, reconcile errors, upstream errors), and every runbook link lands on a section of docs/operations.md.
promtool itself runs on the rules in tests/tools/test_alerts_promtool.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from kvfleet_dashboards.alerts import ALERTS, build_rule_groups

REPO = Path(__file__).resolve().parents[2]
RULE_TESTS = REPO / "dashboards" / "rules" / "kvfleet-alerts_test.yaml"
OPERATIONS = REPO / "docs" / "operations.md"

#: What kvfleet must alert on, and the alert that covers each.
REQUIRED = {
    "KV cache usage above 90%": "KvfleetKVCacheNearlyFull",
    "tenant TTFT p99 above 500 ms": "KvfleetTenantTTFTSLOBreached",
    "tenant sustained over quota": "KvfleetTenantOverQuota",
    "eviction storm": "KvfleetKVEvictionStorm",
    "operator reconcile errors": "KvfleetOperatorReconcileErrors",
    "gateway upstream errors": "KvfleetGatewayUpstreamErrors",
}


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
