"""Status conditions, the Kubernetes way. Pure.

Every kvfleet object reports ``Ready``, ``Progressing`` and ``Degraded`` with a machine-readable reason
(one of ``kvfleet_operator.api.reasons``), a sentence a human can act on, and the generation they
describe. ``lastTransitionTime`` changes only when a condition's status flips, so re-reconciling a
converged object writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

Status = Literal["True", "False", "Unknown"]
READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


@dataclass(frozen=True)
class ConditionUpdate:
    """What a reconcile wants one condition to say; :func:`merge_conditions` turns it into the wire form
    (:class:`kvfleet_operator.api.Condition`) with ``observedGeneration`` and ``lastTransitionTime``."""

    type: str
    status: Status
    reason: str
    message: str


def now_rfc3339() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def merge_conditions(
    current: Sequence[dict[str, Any]] | None,
    updates: Sequence[ConditionUpdate],
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


def rebase_conditions(
    conditions: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``conditions`` (computed by :func:`merge_conditions` from an older read) as if merged onto ``base``
    (what the object holds now): a condition whose status did not flip against ``base`` keeps ``base``'s
    ``lastTransitionTime``."""
    by_type = {c["type"]: c for c in base or []}
    out = []
    for condition in conditions:
        old = by_type.get(condition["type"])
        kept = (
            old is not None and old.get("status") == condition.get("status") and "lastTransitionTime" in old
        )
        out.append(
            {**condition, "lastTransitionTime": old["lastTransitionTime"]} if kept and old else condition
        )
    return out


def ready(reason: str, message: str) -> list[ConditionUpdate]:
    return [
        ConditionUpdate(READY, "True", reason, message),
        ConditionUpdate(PROGRESSING, "False", reason, "Converged."),
        ConditionUpdate(DEGRADED, "False", reason, "No problem found."),
    ]


def progressing(reason: str, message: str) -> list[ConditionUpdate]:
    return [
        ConditionUpdate(READY, "False", reason, message),
        ConditionUpdate(PROGRESSING, "True", reason, message),
        ConditionUpdate(DEGRADED, "False", reason, "No problem found."),
    ]


def failed(reason: str, message: str) -> list[ConditionUpdate]:
    """The spec cannot be served as written; a human must change something."""
    return [
        ConditionUpdate(READY, "False", reason, message),
        ConditionUpdate(PROGRESSING, "False", reason, "Waiting for the spec to change."),
        ConditionUpdate(DEGRADED, "True", reason, message),
    ]
