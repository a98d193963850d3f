"""Shared test plumbing.

``require_component`` is how every test that needs a real component reacts to its absence: outside CI it
skips with the name of the component and the command that provides it; with ``CI=true`` it fails, so a
missing real component can never hide behind a skip in CI.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

# The real control plane and Prometheus fixtures (api_cluster, full_cluster, prometheus).
pytest_plugins = ["cluster_fixtures", "engine_fixtures"]

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing_component(component: str, provide_with: str) -> NoReturn:
    message = f"real component missing: {component} (provide it with: {provide_with})"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test sits in a folder named after its marker; mark it so ``-m`` selects by folder."""
    for item in items:
        parts = item.path.parts
        for marker in ("unit", "cluster", "engine", "e2e"):
            if marker in parts:
                item.add_marker(getattr(pytest.mark, marker))
