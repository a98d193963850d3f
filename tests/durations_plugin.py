"""pytest plugin: where the suite's time goes, as a results file (``--durations-results PATH``).

Registered from ``tests/conftest.py``. ``make test`` (hack/test.sh) writes
``benchmarks/results/test_durations.json`` on every run; ``benchmarks/report.py`` renders its tables in
docs/benchmarks.md (time per tier, the 20 slowest tests and the 20 slowest fixtures).

What is recorded, per test: the seconds of its setup, call and teardown (pytest's own report durations)
and the tier it belongs to (the folder under ``tests/``); per fixture: the seconds its own setup took,
without the fixtures it depends on (pytest sets those up before calling ``pytest_fixture_setup``), and
how many times it was set up. Under pytest-xdist the fixture timings travel from the workers to the
controller on the setup report (an extra report attribute, which xdist serialises), and the controller
writes the file; ``wall_s`` is the controller's session from start to finish, so it shows what running
side by side saved against the summed test time.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from parallel_plugin import strip_group

#: The test tiers, each a folder under tests/ (tests/conftest.py marks every test with its folder's name).
TIERS = ("unit", "tools", "loopback", "cluster", "engine", "security", "e2e")
#: Tests shorter than this are counted in their tier but not listed one by one in the file.
LISTED_TEST_S = 1.0
#: The report attribute that carries one test's fixture setups from a worker to the controller.
_REPORT_ATTR = "kvfleet_fixture_setups"
RESULTS_NAME = "test_durations"


def tier_of(nodeid: str) -> str:
    """The tier of a test from its node id (``tests/<tier>/...``); ``other`` outside the tier folders."""
    parts = nodeid.split("::", 1)[0].split("/")
    return next((p for p in parts if p in TIERS), "other")


@dataclass
class TestTime:
    """One test's phases, in seconds."""

    tier: str
    setup: float = 0.0
    call: float = 0.0
    teardown: float = 0.0
    outcome: str = "passed"

    @property
    def total(self) -> float:
        return self.setup + self.call + self.teardown


@dataclass
class FixtureTime:
    """Every setup of one fixture (by name and scope): how many and how long in all."""

    scope: str
    setups: int = 0
    seconds: float = 0.0
    longest: float = 0.0


@dataclass
class Durations:
    """What one pytest session's reports say about its time (pure; filled by the hooks below)."""

    tests: dict[str, TestTime] = field(default_factory=dict)
    fixtures: dict[str, FixtureTime] = field(default_factory=dict)

    def add_report(self, nodeid: str, when: str, duration: float, outcome: str) -> None:
        test = self.tests.setdefault(nodeid, TestTime(tier_of(nodeid)))
        setattr(test, when, getattr(test, when) + duration)
        if outcome != "passed" and test.outcome == "passed":
            test.outcome = outcome

    def add_fixture_setups(self, setups: Iterable[tuple[str, str, float]]) -> None:
        for name, scope, seconds in setups:
            entry = self.fixtures.setdefault(f"{name} ({scope})", FixtureTime(scope))
            entry.setups += 1
            entry.seconds += seconds
            entry.longest = max(entry.longest, seconds)

    def per_tier(self) -> dict[str, tuple[int, float]]:
        """tier -> (tests, summed seconds), tiers in TIERS order, then any other."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for test in self.tests.values():
            sums[test.tier][0] += 1
            sums[test.tier][1] += test.total
        order = [t for t in TIERS if t in sums] + sorted(set(sums) - set(TIERS))
        return {t: (int(sums[t][0]), sums[t][1]) for t in order}

    def summary(self, *, wall_s: float, workers: int, command: str, today: datetime.date) -> dict[str, Any]:
        """The results file's content (the shape of benchmarks/results_format.Results)."""

        def single(value: float, unit: str, note: str = "") -> dict[str, Any]:
            out: dict[str, Any] = {"unit": unit, "median": value, "min": value, "max": value}
            if note:
                out["note"] = note
            return out

        figures = {"wall_s": single(round(wall_s, 1), "s", "the pytest session, first report to last")}
        figures["tests"] = single(len(self.tests), "tests")
        figures["test_time_s"] = single(
            round(sum(t.total for t in self.tests.values()), 1), "s", "every test's setup, call and teardown"
        )
        for tier, (count, seconds) in self.per_tier().items():
            figures[f"{tier}_tests"] = single(count, "tests")
            figures[f"{tier}_s"] = single(round(seconds, 1), "s", "summed over the tier's tests")
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1].total)
        listed = {
            nodeid: [round(t.setup, 2), round(t.call, 2), round(t.teardown, 2)]
            for nodeid, t in slowest
            if t.total >= LISTED_TEST_S
        }
        fixtures = {
            name: {"setups": f.setups, "seconds": round(f.seconds, 2), "longest": round(f.longest, 2)}
            for name, f in sorted(self.fixtures.items(), key=lambda kv: -kv[1].seconds)
            if f.seconds >= LISTED_TEST_S
        }
        failed = sorted(n for n, t in self.tests.items() if t.outcome == "failed")
        return {
            "name": RESULTS_NAME,
            "command": command,
            "date": today.isoformat(),
            "machine": {
                "cores": os.cpu_count() or 1,
                "load": f"1-min load average {os.getloadavg()[0]:.1f} at the end",
                "note": f"{workers} pytest-xdist workers" if workers else "one pytest process",
            },
            "source": "measured: written by the command when it ran",
            "figures": figures,
            "details": {
                "python": platform.python_version(),
                "tests_s": listed,
                "tests_note": f"setup, call, teardown in seconds; tests of {LISTED_TEST_S:g} s or more",
                "fixtures": fixtures,
                "failed": failed,
            },
        }


_SESSION = Durations()
_CURRENT_SETUPS: list[tuple[str, str, float]] = []
_STARTED = [time.monotonic()]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-results",
        metavar="PATH",
        default=None,
        help="write every test's and fixture's durations to PATH (a benchmarks/results file)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTED[0] = time.monotonic()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    start = time.monotonic()
    try:
        return (yield)
    finally:
        _CURRENT_SETUPS.append((fixturedef.argname, fixturedef.scope, time.monotonic() - start))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    # Fixtures are set up in the setup phase, or in the call by ``request.getfixturevalue``.
    if _CURRENT_SETUPS:
        setattr(report, _REPORT_ATTR, [list(s) for s in _CURRENT_SETUPS])
        _CURRENT_SETUPS.clear()
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SESSION.add_report(strip_group(report.nodeid), report.when, report.duration, report.outcome)
    setups = getattr(report, _REPORT_ATTR, None)
    if setups:
        _SESSION.add_fixture_setups((str(n), str(s), float(d)) for n, s, d in setups)


def _workers(config: pytest.Config) -> int:
    value = getattr(config.option, "numprocesses", None)
    return int(value) if isinstance(value, int) else 0


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    target = config.getoption("--durations-results")
    if not target or hasattr(config, "workerinput"):  # xdist workers report; the controller writes
        return
    if not _SESSION.tests:
        return
    command = os.environ.get("KVFLEET_DURATIONS_COMMAND") or " ".join(
        [".venv/bin/pytest", *map(str, config.invocation_params.args)]
    )
    summary = _SESSION.summary(
        wall_s=time.monotonic() - _STARTED[0],
        workers=_workers(config),
        command=command,
        today=datetime.datetime.now(datetime.UTC).date(),
    )
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
