"""docs/security.md cannot claim a defence nobody attacks: every row of a table that starts with a
``threat`` column and ends with a ``test`` column (the overview and the threat → defence → test tables)
names at least one test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/security.md"


def _rows() -> list[list[str]]:
    """The cells of every row of a table whose header starts with ``| threat |`` and ends with
    ``| test |``; a row with more or fewer cells than its header fails here."""
    rows: list[list[str]] = []
    width = 0
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("| threat |") and cells[-1] == "test":
            width = len(cells)
            continue
        if width and line.startswith("|---"):
            continue
        if width and line.startswith("|"):
            assert len(cells) == width, f"a row of {len(cells)} cells in a table of {width}: {cells[0]}"
            rows.append(cells)
        else:
            width = 0
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
    assert len(rows) >= 40, "the threat tables with a test column are missing"
    files, functions = _defined_tests()
    for row in rows:
        named = re.findall(r"\b(test_\w+)(\.py)?", row[-1])
        assert named, f"no test named for: {row[0]}"
        for name, py in named:
            assert (name + ".py" in files) if py else (name in functions), f"{name}{py} does not exist"
