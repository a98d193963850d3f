"""Condition reasons (api/reasons.py): defined once, documented there and in docs/operations.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvfleet_operator.api import Condition, reasons

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "operator/kvfleet_operator/api/reasons.py"
OPERATOR = ROOT / "operator/kvfleet_operator"


def _constants() -> dict[str, tuple[str, str | None]]:
    """Name -> (value, the docstring right below it) for every string constant of the module."""
    body = ast.parse(MODULE.read_text()).body
    found: dict[str, tuple[str, str | None]] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc = (
                after.value.value
                if isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
                else None
            )
            found[node.target.id] = (node.value.value, doc)
    return found


def _documented_in_operations() -> list[str]:
    text = (ROOT / "docs/operations.md").read_text()
    section = text.split("## Conditions and what to do", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Za-z]+)` \|", section, flags=re.MULTILINE)


def test_every_reason_is_a_documented_constant() -> None:
    constants = _constants()
    assert {value for value, _ in constants.values()} == {*reasons.CONDITION_REASONS, reasons.ADMITTED}
    for name, (_value, doc) in constants.items():
        assert doc and len(doc.split()) >= 8, f"{name} needs a docstring: what it means, what to do"


def test_operations_guide_lists_exactly_the_condition_reasons() -> None:
    assert _documented_in_operations() == list(reasons.CONDITION_REASONS)


@pytest.mark.parametrize("reason", reasons.CONDITION_REASONS)
def test_reason_is_one_word_the_crd_accepts(reason: str) -> None:
    condition = Condition.model_validate(
        {"type": "Ready", "status": "False", "reason": reason, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    )
    assert condition.reason == reason
    assert re.fullmatch(r"[A-Z][A-Za-z]+", reason)


def test_reasons_are_unique() -> None:
    assert len(set(reasons.CONDITION_REASONS)) == len(reasons.CONDITION_REASONS)
    assert reasons.ADMITTED not in reasons.CONDITION_REASONS


# "Ready" is also a condition type (reconcile/conditions.py), so it may be spelled elsewhere.
@pytest.mark.parametrize(
    "reason", [r for r in (*reasons.CONDITION_REASONS, reasons.ADMITTED) if r != "Ready"]
)
def test_no_other_operator_module_spells_a_reason(reason: str) -> None:
    spelled = [
        str(path.relative_to(ROOT))
        for path in sorted(OPERATOR.rglob("*.py"))
        if path != MODULE
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value == reason
    ]
    assert spelled == [], f"import kvfleet_operator.api.reasons instead of spelling {reason!r}"
