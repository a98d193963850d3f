"""Status conditions, the Kubernetes way. Pure.

Every kvfleet object reports ``Ready``, ``Progressing`` and ``Degraded`` with a machine-readable
reason, a sentence a human can act on, and the generation they describe. ``lastTransitionTime``
changes only when a condition's status flips, so re-reconciling a converged object writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

Status = Literal["True", "False", "Unknown"]
READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


@dataclass(frozen=True)
class Condition:
    type: str
    status: Status
    reason: str
    message: str


def now_rfc3339() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def merge_conditions(
    current: Sequence[dict[str, Any]] | None,
    updates: Sequence[Condition],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The condition list after applying ``updates``; conditions not updated are kept as they are."""
    by_type = {c["type"]: dict(c) for c in current or []}
    for update in updates:
        old = by_type.get(update.type)
        transitioned = old is None or old.get("status") != update.status
        by_type[update.type] = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if transitioned or old is None else old["lastTransitionTime"],
        }
    order = {READY: 0, PROGRESSING: 1, DEGRADED: 2}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], 9), c["type"]))


def ready(reason: str, message: str) -> list[Condition]:
    return [
        Condition(READY, "True", reason, message),
        Condition(PROGRESSING, "False", reason, "Converged."),
        Condition(DEGRADED, "False", reason, "No problem found."),
    ]


def progressing(reason: str, message: str) -> list[Condition]:
    return [
        Condition(READY, "False", reason, message),
        Condition(PROGRESSING, "True", reason, message),
        Condition(DEGRADED, "False", reason, "No problem found."),
    ]


def failed(reason: str, message: str) -> list[Condition]:
    """The spec cannot be served as written; a human must change something."""
    return [
        Condition(READY, "False", reason, message),
        Condition(PROGRESSING, "False", reason, "Waiting for the spec to change."),
        Condition(DEGRADED, "True", reason, message),
    ]
