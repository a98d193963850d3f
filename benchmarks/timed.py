"""Time a whole command and write its results file: for figures that are the wall time of a command.

    .venv/bin/python benchmarks/timed.py --name build_cluster_warm --runs 3 -- hack/build-cluster.sh
    PYTHONPATH=hack .venv/bin/python benchmarks/timed.py --name demo -- .venv/bin/python hack/demo.py

Runs the command after ``--`` ``--runs`` times from the repository root, one after the other, and writes
``benchmarks/results/<name>.json`` (or ``--results``) with the figure ``wall``: seconds per run, median,
min and max. A run that fails stops the benchmark and writes nothing: a failed build is not a figure.

``--lines-until TEXT`` also passes the command's output through and counts its lines up to the first line
that is exactly TEXT (figure ``lines``; e.g. ``make demo``'s output until its report, which must fit on
one screen) and the seconds until then (figure ``until``).

    PYTHONPATH=hack .venv/bin/python benchmarks/timed.py --name demo_warm \
        --lines-until "kvfleet demo report" -- make demo
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from results_format import REPO, Figure, Machine, command_line, default_path, measured, name_of, write_results


def _pass_through(command: list[str], marker: str) -> tuple[int, float | None, int]:
    """Run ``command``, echoing its output; (lines before ``marker``, when it came, exit code)."""
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    count, reached = 0, None
    for line in proc.stdout:
        sys.stdout.write(line)
        if reached is None:
            if line.rstrip("\n") == marker:
                reached = time.monotonic()
            else:
                count += 1
    return count, reached, proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--name", required=True, help="the results file's name (benchmarks/results/NAME.json)"
    )
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--results", type=Path, default=None, help="write the results file here instead")
    parser.add_argument(
        "--lines-until",
        default=None,
        metavar="TEXT",
        help="count the output's lines before the first line that is exactly TEXT, and the seconds until it",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to time, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to time (put it after --)")
    results = args.results or default_path(args.name)
    load_at_start = os.getloadavg()[0]
    seconds: list[float] = []
    lines: list[float] = []
    until: list[float] = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        if args.lines_until is None:
            code = subprocess.run(command, cwd=REPO, check=False).returncode
        else:
            count, reached, code = _pass_through(command, args.lines_until)
            if reached is None:
                print(f"run {run}: no line {args.lines_until!r} in the output", file=sys.stderr)
                return code or 1
            lines.append(count)
            until.append(reached - started)
        elapsed = time.monotonic() - started
        if code != 0:
            print(f"run {run}: exit code {code} after {elapsed:.1f} s; no results written", file=sys.stderr)
            return code
        seconds.append(elapsed)
        print(f"run {run}: {elapsed:.2f} s", file=sys.stderr)
    figures = {"wall": Figure.of(seconds, "s")}
    if lines:
        figures["lines"] = Figure.of(lines, "lines", note=f"output lines before {args.lines_until!r}")
        figures["until"] = Figure.of(until, "s", note=f"from start to {args.lines_until!r}")
    # A relative PYTHONPATH (the demo needs hack/) is part of the command; an absolute one is this machine's.
    pythonpath = os.environ.get("PYTHONPATH", "")
    prefix = f"PYTHONPATH={pythonpath}" if pythonpath and not pythonpath.startswith("/") else ""
    details = {"timed_command": command, "runs": args.runs}
    machine = Machine.here(load_at_start)
    write_results(measured(name_of(results), command_line(prefix=prefix), figures, machine, details), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
