"""Time a whole command and write its results file: for figures that are the wall time of a command.

    .venv/bin/python benchmarks/timed.py --name build_cluster_warm --runs 3 -- hack/build-cluster.sh
    PYTHONPATH=hack .venv/bin/python benchmarks/timed.py --name demo -- .venv/bin/python hack/demo.py

Runs the command after ``--`` ``--runs`` times from the repository root, one after the other, and writes
``benchmarks/results/<name>.json`` (or ``--results``) with the figure ``wall``: seconds per run, median,
min and max. A run that fails stops the benchmark and writes nothing: a failed build is not a figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from results_format import REPO, Figure, Machine, command_line, default_path, measured, name_of, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--name", required=True, help="the results file's name (benchmarks/results/NAME.json)"
    )
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--results", type=Path, default=None, help="write the results file here instead")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to time, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to time (put it after --)")
    results = args.results or default_path(args.name)
    load_at_start = os.getloadavg()[0]
    seconds = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        code = subprocess.run(command, cwd=REPO, check=False).returncode
        elapsed = time.monotonic() - started
        if code != 0:
            print(f"run {run}: exit code {code} after {elapsed:.1f} s; no results written", file=sys.stderr)
            return code
        seconds.append(elapsed)
        print(f"run {run}: {elapsed:.2f} s", file=sys.stderr)
    figures = {"wall": Figure.of(seconds, "s")}
    # A relative PYTHONPATH (the demo needs hack/) is part of the command; an absolute one is this machine's.
    pythonpath = os.environ.get("PYTHONPATH", "")
    prefix = f"PYTHONPATH={pythonpath}" if pythonpath and not pythonpath.startswith("/") else ""
    details = {"timed_command": command, "runs": args.runs}
    machine = Machine.here(load_at_start)
    write_results(measured(name_of(results), command_line(prefix=prefix), figures, machine, details), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
