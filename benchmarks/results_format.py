"""The results file every benchmark writes: one typed record, and the one place that reads and writes it.

A results file, ``benchmarks/results/<name>.json``, holds one run of one command: what was run
(``command``), when (``date``), on what machine (``machine``), where the numbers come from (``source``:
measured by the command, or migrated from an earlier session's text), the figures it measured (each a
median/min/max over its runs, with a unit) and free-form ``details`` (settings, raw samples). The tables
in docs/benchmarks.md are rendered from these files by ``benchmarks/report.py`` (``make bench-docs``),
and a unit test fails when the doc and the files disagree.

A benchmark script adds ``--results PATH`` with :func:`add_results_argument` and ends with
``write_results(measured(...), args.results)``; the next run of the same command overwrites the file in
the same format. Scripts run as ``python benchmarks/<script>.py``, so this module is imported by its bare
name (``benchmarks/`` is the script's own folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, JsonValue, model_validator

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
#: What ``source`` says for a file the command itself wrote.
MEASURED = "measured: written by the command when it ran"


class Figure(BaseModel):
    """One measured quantity in ``unit``: ``median``, ``min`` and ``max`` over ``runs`` measurements.

    A figure measured once has the three equal. A figure known only as a range (an old note said "3.5 to
    4.1 s") has no median. ``values`` keeps the individual runs when there are few of them; ``note`` is a
    short qualifier the doc prints beside the number.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: str
    median: float | None
    min: float | None = None
    max: float | None = None
    runs: int = 1
    values: list[float] = []
    note: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.runs < 1:
            raise ValueError("runs must be at least 1")
        if self.values and len(self.values) != self.runs:
            raise ValueError(f"{len(self.values)} values for {self.runs} runs")
        known = [v for v in (self.min, self.median, self.max) if v is not None]
        if known != sorted(known):
            raise ValueError(f"expected min <= median <= max, got {self.min}, {self.median}, {self.max}")
        if self.median is None and (self.min is None or self.max is None):
            raise ValueError("a figure without a median needs both min and max")
        return self

    @classmethod
    def of(cls, values: Sequence[float], unit: str, *, keep_values: bool = True, note: str = "") -> Figure:
        """The summary of ``values`` (one per run); the values themselves are kept when ``keep_values``."""
        if not values:
            raise ValueError("a figure needs at least one value")
        return cls(
            unit=unit,
            median=statistics.median(values),
            min=min(values),
            max=max(values),
            runs=len(values),
            values=list(values) if keep_values and len(values) > 1 else [],
            note=note,
        )

    @classmethod
    def single(cls, value: float, unit: str, *, note: str = "") -> Figure:
        """A quantity measured once (or a derived figure such as a ratio)."""
        return cls(unit=unit, median=value, min=value, max=value, note=note)


class Machine(BaseModel):
    """Where a run happened: CPU cores and how busy the machine was (the load average during the run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cores: int
    load: str
    note: str = ""

    @classmethod
    def measured(cls, cores: int, load_at_start: float, load_at_end: float, *, note: str = "") -> Machine:
        """A machine with ``cores`` whose 1-min load average was ``load_at_start`` / ``load_at_end``."""
        load = f"1-min load average {load_at_start:.1f} at start, {load_at_end:.1f} at end"
        return cls(cores=cores, load=load, note=note)

    @classmethod
    def over_phases(cls, loads: Sequence[float]) -> Machine:
        """This machine over a run of phases: ``loads`` is the 1-min load average at the start and after
        each phase (``os.getloadavg()[0]``); the note lists them."""
        after = ", ".join(f"{x:.1f}" for x in loads[1:])
        note = f"1-min load average after each phase: {after}"
        return cls.measured(os.cpu_count() or 1, loads[0], loads[-1], note=note)

    @classmethod
    def here(cls, load_at_start: float, *, note: str = "") -> Machine:
        """This machine now; ``load_at_start`` is ``os.getloadavg()[0]`` taken when the run began."""
        return cls.measured(os.cpu_count() or 1, load_at_start, os.getloadavg()[0], note=note)


class Results(BaseModel):
    """One run of one benchmark command; the content of ``benchmarks/results/<name>.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    command: str
    date: datetime.date
    machine: Machine
    source: str
    figures: dict[str, Figure]
    details: dict[str, JsonValue] = {}

    def figure(self, key: str) -> Figure:
        """``figures[key]``, with the file named when it is missing."""
        try:
            return self.figures[key]
        except KeyError:
            raise KeyError(f"{self.name}: no figure {key!r} (has {sorted(self.figures)})") from None

    @property
    def migrated(self) -> bool:
        return self.source != MEASURED


def measured(
    name: str,
    command: str,
    figures: Mapping[str, Figure],
    machine: Machine,
    details: Mapping[str, JsonValue] | None = None,
) -> Results:
    """The record of a run that just happened, dated today."""
    return Results(
        name=name,
        command=command,
        date=datetime.datetime.now(datetime.UTC).date(),
        machine=machine,
        source=MEASURED,
        figures=dict(figures),
        details=dict(details or {}),
    )


def default_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def add_results_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """``--results PATH`` (default ``benchmarks/results/<name>.json``): where the run's record goes."""
    parser.add_argument(
        "--results",
        type=Path,
        default=default_path(name),
        help=f"write the results file here (default: benchmarks/results/{name}.json)",
    )


def name_of(path: Path) -> str:
    """A results file's name is its file name without ``.json``."""
    return path.name.removesuffix(".json")


def command_line(argv: Sequence[str] | None = None, *, prefix: str = "") -> str:
    """The command as a reader would type it from the repository root: ``[prefix] .venv/bin/python
    benchmarks/x.py args...`` (the interpreter and script paths made repo-relative where they can be)."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve()
    shown = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else args[0]
    words = [".venv/bin/python", shown, *args[1:]]
    return (f"{prefix} " if prefix else "") + shlex.join(words)


def write_results(results: Results, path: Path | None = None) -> Path:
    """Write ``results`` as JSON to ``path`` (default ``benchmarks/results/<name>.json``), whose file name
    must be the results' name."""
    target = path or default_path(results.name)
    if name_of(target) != results.name:
        raise ValueError(f"results named {results.name!r} cannot go to {target.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(results.model_dump_json(indent=2, exclude_defaults=True) + "\n")
    print(f"results written to {target}", file=sys.stderr)
    return target


def load_results(path: Path) -> Results:
    """Read and validate one results file; its ``name`` must be its file name."""
    results = Results.model_validate_json(path.read_text())
    if results.name != name_of(path):
        raise ValueError(f"{path.name}: name is {results.name!r}, expected {name_of(path)!r}")
    return results


def load_all(directory: Path = RESULTS_DIR) -> dict[str, Results]:
    """Every results file in ``directory``, by name."""
    return {name_of(p): load_results(p) for p in sorted(directory.glob("*.json"))}
