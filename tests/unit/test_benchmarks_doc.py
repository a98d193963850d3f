"""docs/benchmarks.md and the results files in benchmarks/results/ agree: every generated table matches the
files it is rendered from, every results file is used, no table of figures is typed by hand, and every
benchmark script writes a results file (``benchmarks/report.py --check``, ``make bench-docs``)."""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# The benchmarks are scripts, not a package: they import each other by bare name from their own folder.
sys.path.insert(0, str(BENCHMARKS))

import report  # noqa: E402
from results_format import (  # noqa: E402
    MEASURED,
    Figure,
    Machine,
    Results,
    load_all,
    load_results,
    write_results,
)

DOC_TEXT = report.DOC.read_text()
RESULTS = load_all()
#: Files in benchmarks/ that are not benchmarks: the results format, the renderer, the fake upstream.
NOT_BENCHMARKS = {"results_format.py", "report.py", "fake_upstream.py"}


def _results(name: str, figures: dict[str, Figure] | None = None) -> Results:
    return Results(
        name=name,
        command=".venv/bin/python benchmarks/x.py",
        date=datetime.date(2026, 11, 30),
        machine=Machine(cores=2, load="1-min load average 1.0 at start, 1.0 at end"),
        source=MEASURED,
        figures=figures or {"x": Figure.single(1.0, "s")},
    )


def test_the_page_agrees_with_the_results_files() -> None:
    assert report.check(DOC_TEXT, RESULTS) == []


def test_every_laid_out_table_is_on_the_page() -> None:
    on_page = {m["name"] for m in report.BLOCK_RE.finditer(DOC_TEXT)}
    assert set(report.BLOCKS) <= on_page
    assert RESULTS, "no results files found"


def test_a_new_results_file_needs_only_its_markers_on_the_page() -> None:
    # A name no real results file has (images.json exists: make images writes it).
    new = _results("new_bench", {"kvfleet.build_cold": Figure.of([95.0, 80.0, 110.0], "s", note="no cache")})
    results = {**RESULTS, "new_bench": new}
    text = report.update(DOC_TEXT + "\n<!-- results:new_bench -->\n<!-- /results:new_bench -->\n", results)
    assert "| `kvfleet.build_cold` | 95 [80\u2013110] (no cache) | s | 3 |" in text
    assert "`benchmarks/results/new_bench.json` (measured on 2026-11-30" in text
    assert report.check(text, results) == []


def test_rendering_the_page_again_changes_nothing() -> None:
    emptied = report.BLOCK_RE.sub(
        lambda m: f"<!-- results:{m['name']} -->\n<!-- /results:{m['name']} -->", DOC_TEXT
    )
    assert emptied != DOC_TEXT
    assert report.update(emptied, RESULTS) == DOC_TEXT


def test_a_changed_figure_in_a_results_file_is_drift() -> None:
    name, r = next((n, r) for n, r in RESULTS.items() if any(f.median for f in r.figures.values()))
    key, fig = next((k, f) for k, f in r.figures.items() if f.median)
    assert fig.median is not None
    bumped = fig.model_copy(update={"median": fig.median * 3 + 7, "min": None, "max": None, "values": []})
    changed = {**RESULTS, name: r.model_copy(update={"figures": {**r.figures, key: bumped}})}
    problems = report.check(DOC_TEXT, changed)
    assert any("differs from its results files" in p for p in problems), problems


def test_a_hand_edited_number_inside_a_block_is_drift() -> None:
    match = next(m for m in report.BLOCK_RE.finditer(DOC_TEXT) if re.search(r"\d", m["body"]))
    body = match["body"]
    digit = re.search(r"\d", body)
    assert digit is not None
    edited_body = body[: digit.start()] + str((int(digit[0]) + 1) % 10) + body[digit.end() :]
    edited = DOC_TEXT[: match.start("body")] + edited_body + DOC_TEXT[match.end("body") :]
    assert any(match["name"] in p and "differs" in p for p in report.check(edited, RESULTS))


def test_an_unused_results_file_and_a_missing_one_are_reported() -> None:
    extra = {**RESULTS, "orphan": _results("orphan")}
    assert "results file orphan.json is used by no block on the page" in report.check(DOC_TEXT, extra)
    missing = {k: v for k, v in RESULTS.items() if k != "gateway_ttft"}
    assert any("missing results file(s) gateway_ttft" in p for p in report.check(DOC_TEXT, missing))


def test_a_hand_typed_table_of_figures_outside_a_block_is_reported() -> None:
    numbers = "\n| what | result |\n|---|---|\n| start | 12 s |\n"
    words = "\n| what | where |\n|---|---|\n| start | here |\n"
    fenced = "\n```\n| what | result |\n|---|---|\n| start | 12 s |\n```\n"
    assert any("table of figures outside" in p for p in report.check(DOC_TEXT + numbers, RESULTS))
    assert report.check(DOC_TEXT + words + fenced, RESULTS) == []


def test_an_unknown_block_is_reported() -> None:
    text = DOC_TEXT + "\n<!-- results:no_such_table -->\n<!-- /results:no_such_table -->\n"
    assert any("no_such_table" in p for p in report.check(text, RESULTS))


def test_every_results_file_says_where_its_figures_come_from() -> None:
    for name, r in RESULTS.items():
        assert r.figures, name
        assert r.source == MEASURED or "earlier session" in r.source, name
        # The command a reader can run from the repository root: no path of the machine that ran it.
        assert not re.search(r"(^|\s)/(tmp|root|home|work)/", r.command), (name, r.command)


def test_every_benchmark_script_writes_a_results_file() -> None:
    scripts = [p for p in BENCHMARKS.rglob("*.py") if p.name not in NOT_BENCHMARKS]
    assert len(scripts) >= 10
    for script in scripts:
        text = script.read_text()
        if '__name__ == "__main__"' in text:
            assert "write_results(" in text, script.relative_to(REPO)


def test_a_figure_is_consistent_with_its_runs() -> None:
    fig = Figure.of([3.0, 1.0, 2.0], "s")
    assert (fig.median, fig.min, fig.max, fig.runs, fig.values) == (2.0, 1.0, 3.0, 3, [3.0, 1.0, 2.0])
    with pytest.raises(ValidationError):
        Figure(unit="s", median=1.0, min=2.0, max=3.0)
    with pytest.raises(ValidationError):
        Figure(unit="s", median=1.0, runs=2, values=[1.0])
    with pytest.raises(ValidationError):
        Figure(unit="s", median=None, min=1.0)


def test_a_results_file_round_trips_and_must_be_named_after_itself(tmp_path: Path) -> None:
    r = _results("sample", {"wall": Figure.of([1.5, 2.5], "s")})
    path = write_results(r, tmp_path / "sample.json")
    assert load_results(path) == r
    with pytest.raises(ValueError, match="cannot go to"):
        write_results(r, tmp_path / "other.json")
    (tmp_path / "renamed.json").write_text(path.read_text())
    with pytest.raises(ValueError, match="expected 'renamed'"):
        load_results(tmp_path / "renamed.json")
