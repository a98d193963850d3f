"""Fair queuing at fleet scale in the simulator: ``kvfleet simulate --fair-queuing fifo,vtc`` on 8 replicas
(one H200 each) x 256 engine slots, for each built-in scenario (``kv.simulate_cli.FAIR_SCENARIOS``: the VTC
paper's overloaded pair with one tenant at 5x, the same pair with the light tenant under its share,
four tenants of weights 1/1/2/4, a premium tenant above a standard pair; and the GAIE #1801 flow-control
guide's scenario 1, one tenant just past saturation, and scenario 3, eight tenants of one tier, with equal
and with skewed demand).

Per scenario and mode: each tenant's served tokens/s and weighted tokens/s, TTFT p50/p99 (the wait at the
gateway plus prefill; a request held past the gateway's 10 s queue timeout is refused and counted), and
Jain's index of the weighted service (and of the service against each tenant's weighted max-min fair
share, which is 1 when a tenant asking less than its share gets all it asks).

Run: ``.venv/bin/python benchmarks/fairness_simulate.py`` (results file:
``benchmarks/results/fairness_simulate.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the results format

from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.kv.simulate_cli import FAIR_SCENARIOS, run_simulate


def simulate(scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        "simulate",
        "--fair-queuing",
        "fifo,vtc",
        "--fair-scenario",
        scenario,
        "--gpus",
        str(args.gpus),
        "--slots-per-replica",
        str(args.slots_per_replica),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--output",
        "json",
    ]
    out, err = io.StringIO(), io.StringIO()
    if run_simulate(build_parser().parse_args(argv), out, err) != 0:
        raise SystemExit(err.getvalue())
    doc: dict[str, Any] = json.loads(out.getvalue())
    doc["command"] = "kvfleet " + " ".join(argv)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--slots-per-replica", type=int, default=256)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--scenarios", default=",".join(FAIR_SCENARIOS))
    add_results_argument(parser, "fairness_simulate")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    figures: dict[str, Figure] = {}
    details: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        t0 = time.perf_counter()
        doc = simulate(scenario, args)
        print(f"{scenario}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        details[scenario] = doc
        for result in doc["results"]:
            mode = result["mode"]
            figures[f"{scenario}.{mode}.jain"] = Figure.single(result["jain_weighted_service"], "index")
            figures[f"{scenario}.{mode}.jain_fair_share"] = Figure.single(result["jain_fair_share"], "index")
            for name, t in result["tenants"].items():
                key = f"{scenario}.{mode}.{name}"
                figures[f"{key}.tokens_per_s"] = Figure.single(t["tokens_per_s"], "tokens/s")
                figures[f"{key}.weighted_tokens_per_s"] = Figure.single(
                    t["weighted_tokens_per_s"], "tokens/s"
                )
                figures[f"{key}.ttft_p50"] = Figure.single(t["ttft_p50_ms"], "ms")
                figures[f"{key}.ttft_p99"] = Figure.single(t["ttft_p99_ms"], "ms")
                figures[f"{key}.refused"] = Figure.single(t["refused"], "requests")
    machine = Machine.here(load_at_start)
    write_results(measured(name_of(args.results), command_line(), figures, machine, details), args.results)


if __name__ == "__main__":
    main()
