"""docs/security.md cannot claim a defence nobody attacks: every row of a threat → defence → test table
names at least one test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/security.md"


def _rows() -> list[list[str]]:
    """The cells of every row of a table whose header is ``| threat | defence | test |``."""
    rows: list[list[str]] = []
    in_table = False
    for line in DOC.read_text().splitlines():
        if line.startswith("| threat | defence | test |"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        else:
            in_table = False
    return rows


def _defined_tests() -> tuple[set[str], set[str]]:
    files = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    functions = {
        name
        for p in (REPO / "tests").rglob("test_*.py")
        for name in re.findall(r"^(?:async )?def (test_\w+)\(", p.read_text(), re.MULTILINE)
    }
    return files, functions


def test_every_row_names_a_test_that_exists() -> None:
    rows = _rows()
    assert len(rows) >= 7, "the threat → defence → test tables are missing"
    files, functions = _defined_tests()
    for row in rows:
        assert len(row) == 3, row
        named = re.findall(r"\b(test_\w+)(\.py)?", row[2])
        assert [n for n, py in named if not py], f"no test named for: {row[0]}"
        for name, py in named:
            assert (name + ".py" in files) if py else (name in functions), f"{name}{py} does not exist"
