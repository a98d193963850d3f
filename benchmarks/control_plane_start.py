"""Time starts of the local control plane (hack/devcluster) and write the results file.

    PYTHONPATH=hack .venv/bin/python benchmarks/control_plane_start.py --tier api --runs 5
    PYTHONPATH=hack .venv/bin/python benchmarks/control_plane_start.py --tier full --runs 3
    PYTHONPATH=hack .venv/bin/python benchmarks/control_plane_start.py --tier node --runs 3   # as root

Each run starts a fresh plane of ``--tier`` with ``devcluster.start_control_plane`` (as ``python -m
devcluster bench`` does) and stops it. Figures, in seconds over the runs: ``start`` (call to ready: the
API server's ``/readyz`` for ``api``; nodes Ready and the default service account for ``full``) and, for
``full``, ``api_phase`` (until the API server was ready) and ``extend_to_full`` (controller manager,
scheduler, kwok and nodes on top of it, what the test fixtures' ``full_cluster`` adds to ``api_cluster``).
For ``node`` (warm: binaries built, images already in the node's containerd), ``start`` is until the real
node is Ready with kube-proxy, CoreDNS and kube-router healthy; ``node`` is the real node's part of it
and ``containerd_and_images`` containerd's start plus the check that every kvfleet image is imported.
Results file: ``--results`` (default ``benchmarks/results/control_plane_start_<tier>.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from devcluster import start_control_plane
from results_format import Figure, Machine, command_line, default_path, measured, name_of, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tier", choices=["api", "full", "node"], default="api")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--results", type=Path, default=None, help="write the results file here instead")
    args = parser.parse_args(argv)
    results = args.results or default_path(f"control_plane_start_{args.tier}")
    load_at_start = os.getloadavg()[0]
    phases: dict[str, list[float]] = {
        "start": [],
        "api_phase": [],
        "extend_to_full": [],
        "node": [],
        "containerd_and_images": [],
    }
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        plane = start_control_plane(args.tier, timeout=args.timeout)
        elapsed = time.monotonic() - started
        if plane.node is not None:
            phases["node"].append(plane.node.started_in["node"])
            phases["containerd_and_images"].append(plane.node.started_in["containerd+images"])
        plane.stop()
        phases["start"].append(elapsed)
        phases["api_phase"].append(plane.started_in["api"])
        if "full" in plane.started_in:
            phases["extend_to_full"].append(plane.started_in["full"])
        print(f"run {run}: {args.tier} tier ready in {elapsed:.2f} s", file=sys.stderr)
    figures = {key: Figure.of(values, "s") for key, values in phases.items() if values}
    details = {"tier": args.tier, "runs": args.runs}
    machine = Machine.here(load_at_start)
    write_results(
        measured(name_of(results), command_line(prefix="PYTHONPATH=hack"), figures, machine, details),
        results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
