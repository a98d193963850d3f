"""Shared test plumbing.

``missing_component`` is how every test that needs a real component reacts to its absence: it fails,
naming the component and the command that provisions it, so `make test` cannot be green while a real
component is missing. A caller who wants to run without them says so: ``KVFLEET_ALLOW_MISSING=1`` (what
`make unit` sets) turns those failures into skips with the same message. CI runs `make test` as it is
(tests/unit/test_docs.py checks .ci/run), so CI never skips.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NoReturn

import pytest

# The real control plane and Prometheus fixtures (api_cluster, full_cluster, prometheus), the real engines,
# the groups that keep heavy setups on one xdist worker, and the durations results file.
pytest_plugins = ["cluster_fixtures", "engine_fixtures", "parallel_plugin", "durations_plugin"]

#: The explicit opt-out: set to exactly ``1``, tests whose real component is missing skip instead of failing.
ALLOW_MISSING_ENV = "KVFLEET_ALLOW_MISSING"

#: component -> the command that provisions it, for every component a test found missing (terminal summary).
MISSING: dict[str, str] = {}


def allow_missing(env: Mapping[str, str] = os.environ) -> bool:
    """True only when the caller opted out explicitly (``KVFLEET_ALLOW_MISSING=1``)."""
    return env.get(ALLOW_MISSING_ENV, "") == "1"


def missing_component(component: str, provide_with: str) -> NoReturn:
    """Fail (or, with the opt-out, skip) the running test: ``component`` is absent; ``provide_with``
    is the command that provisions it."""
    MISSING[component] = provide_with
    message = f"real component missing: {component} (provision it with: {provide_with})"
    if allow_missing():
        pytest.skip(f"{message}; skipped because {ALLOW_MISSING_ENV}=1")
    pytest.fail(f"{message}; {ALLOW_MISSING_ENV}=1 skips the tests that need it instead", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test sits in a folder named after its marker; mark it so ``-m`` selects by folder."""
    for item in items:
        parts = item.path.parts
        for marker in ("unit", "cluster", "engine", "e2e", "security"):
            if marker in parts:
                item.add_marker(getattr(pytest.mark, marker))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per missing real component with the command that provisions it (once, not per test)."""
    if not MISSING:
        return
    outcome = "skipped" if allow_missing() else "failed"
    terminalreporter.section("missing real components")
    for component, command in sorted(MISSING.items()):
        terminalreporter.write_line(f"{component}: provision it with {command} (its tests {outcome})")
