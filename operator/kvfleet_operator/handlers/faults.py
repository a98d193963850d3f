"""Kill the operator at a named point of a reconcile (tests/cluster/test_operator_faults.py).

``KVFLEET_FAULT_POINT=<point>`` makes the operator process end itself with ``os._exit`` (no cleanup, no
``finally``, no flush: what ``kill -9`` does) the first time it reaches that point. The variable is read
once, at import; unset, :func:`crash_point` is one comparison with ``None``.
"""

from __future__ import annotations

import os
import sys
from typing import Final, Literal, get_args

FaultPoint = Literal[
    # The reconcile applied (or pruned) children and has not written any status yet.
    "after-children-before-status",
    # The reconcile created one tenant's generated API-key Secret and more are to come.
    "between-key-secrets",
    # The ModelDeployment's delete handler finished (no tenant left); kopf is about to remove the finalizer.
    "before-finalizer-removal",
]
FAULT_POINTS: Final[tuple[str, ...]] = get_args(FaultPoint)
FAULT_ENV: Final = "KVFLEET_FAULT_POINT"
#: Exit status of a process killed at a fault point (told apart from a crash in the tests' logs).
FAULT_EXIT_CODE: Final = 86


def _armed() -> str | None:
    point = os.environ.get(FAULT_ENV) or None
    if point is not None and point not in FAULT_POINTS:
        raise ValueError(f"{FAULT_ENV}={point!r} is not one of {', '.join(FAULT_POINTS)}")
    return point


ARMED: Final[str | None] = _armed()


def crash_point(point: FaultPoint) -> None:
    """End the process now if ``point`` is the armed fault point."""
    if ARMED is not None and point == ARMED:
        sys.stderr.write(f"kvfleet: fault point {point} reached; exiting\n")
        sys.stderr.flush()
        os._exit(FAULT_EXIT_CODE)
