"""Fault points (``kvfleet_operator.handlers.faults``): armed by ``KVFLEET_FAULT_POINT`` at import, the
process ends exactly at that point and nowhere else. Each case runs in a fresh interpreter, as the
variable is read once. The crashes inside real reconciles are in tests/cluster/test_operator_faults.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfleet_operator.handlers.faults import FAULT_ENV, FAULT_EXIT_CODE, FAULT_POINTS

SCRIPT = """
from kvfleet_operator.handlers.faults import crash_point
crash_point("between-key-secrets")
print("passed the point")
"""


def _run(point: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if point is not None:
        env[FAULT_ENV] = point
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_armed_point_ends_the_process_there() -> None:
    done = _run("between-key-secrets")
    assert done.returncode == FAULT_EXIT_CODE
    assert "passed the point" not in done.stdout
    assert "fault point between-key-secrets reached" in done.stderr


@pytest.mark.parametrize("point", [None, "after-children-before-status"])
def test_unset_or_another_point_passes(point: str | None) -> None:
    done = _run(point)
    assert done.returncode == 0 and "passed the point" in done.stdout, done.stderr


def test_an_unknown_point_is_refused_at_import() -> None:
    done = _run("between-keys")
    assert done.returncode != 0 and "is not one of" in done.stderr
    assert set(FAULT_POINTS) == {
        "after-children-before-status",
        "between-key-secrets",
        "before-finalizer-removal",
    }
