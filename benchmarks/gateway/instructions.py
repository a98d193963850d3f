"""CPU instructions per proxied request: the kvfleet gateway now against itself at a git ref, under callgrind.

The rate sweep of ``bench.py`` finds where a gateway stops keeping up on this machine, but on 2 shared
cores its steps are noisy: two runs of the same tree can land a step apart. This benchmark counts what
the gateway process executes per request instead, which does not depend on the machine's load: each
gateway runs under ``valgrind --tool=callgrind`` with instrumentation off until it is warm, then serves
``--requests`` non-streaming chat completions (``--concurrency`` at a time, from this process, on the fake
upstream of ``bench.py``) with instrumentation on, and the instructions callgrind counted in that window
(every thread of the process; user space only, so the kernel's share of socket I/O is not in it) are
divided by the requests. Repeating a tree gives the same count within about 0.5%.

The gateway at ``--baseline-ref`` is exported with ``git archive`` (as in ``bench.py``) and measured in
the same run; ``share_of_baseline`` (current / baseline, in percent) is the figure to compare. Both get
the tenant table of ``bench.py``: one tenant, rate limits far above the load, so the whole admission path
runs.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``). Run:
``.venv/bin/python benchmarks/gateway/instructions.py --baseline-ref d9f0308``
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the results format
sys.path.insert(0, str(HERE))  # bench.py: the fake upstream, the tenant table, the gateway's command

import bench  # noqa: E402 - after the path it lives on
from results_format import (  # noqa: E402
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

KEY = "sk-bench-" + "ab" * 16
#: Requests served before counting starts (connections opened, caches and code paths warm).
WARMUP_REQUESTS = 50


def callgrind_total(out_file: str) -> int:
    """The instructions in a callgrind dump (its ``summary:`` or ``totals:`` line)."""
    total = 0
    for path in glob.glob(out_file + "*"):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
    if not total:
        raise RuntimeError(f"callgrind wrote no totals to {out_file}*")
    return total


async def callgrind_control(*argv: str) -> None:
    """``callgrind_control ARGV`` (to the gateway under callgrind); raises when it fails."""
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(argv)} failed: {err.decode(errors='replace')}")


async def send(session: aiohttp.ClientSession, url: str, count: int, concurrency: int) -> None:
    """``count`` chat completions to ``url``, ``concurrency`` at a time; every one must answer 200."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def one() -> None:
        async with gate, session.post(url, data=bench.BODY, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"the gateway answered {resp.status}")

    await asyncio.gather(*(one() for _ in range(count)))


async def measure_tree(
    session: aiohttp.ClientSession,
    procs: bench.Processes,
    label: str,
    runtime: Path,
    upstream: str,
    workdir: Path,
    args: argparse.Namespace,
) -> float:
    """Instructions per request of the gateway in ``runtime`` (a fresh process under callgrind)."""
    config, keys = bench.write_baseline_config(workdir / label, upstream, KEY, runtime)
    port = bench.free_port()
    out_file = str(workdir / f"callgrind.{label}.out")
    argv = bench.gateway_argv(
        runtime, config, keys, port, separate_metrics_port=bench.has_metrics_port_option(runtime)
    )
    procs.start(
        label,
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *argv],
        env={"PYTHONPATH": str(runtime)},
    )
    pid = str(procs.procs[-1].pid)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    target = bench.Target(label, url, {"Authorization": f"Bearer {KEY}"})
    if not await bench.wait_ready(session, target, args.ready_timeout):
        raise RuntimeError(f"{label}: the gateway did not answer within {args.ready_timeout:g} s")
    await send(session, url, WARMUP_REQUESTS, args.concurrency)
    requests: int = args.requests
    await callgrind_control("-i", "on", pid)
    await send(session, url, requests, args.concurrency)
    await callgrind_control("-d", pid)  # dump what was counted since instrumentation went on
    await callgrind_control("-i", "off", pid)
    return callgrind_total(out_file) / requests


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    load_start = os.getloadavg()[0]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvfleet-instructions-") as tmp:
        workdir = Path(tmp)
        procs = bench.Processes(workdir)
        trees = {"kvfleet": bench.REPO / "runtime"}
        if args.baseline_ref:
            trees[bench.baseline_name(args.baseline_ref)] = bench.export_runtime(
                args.baseline_ref, workdir / "baseline"
            )
        up_port = bench.free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        procs.start("upstream", [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(up_port)])
        per_request: dict[str, list[float]] = {label: [] for label in trees}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for round_ in range(args.rounds):
                    order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                    for label in order:
                        count = await measure_tree(
                            session, procs, f"{label}-{round_}", trees[label], upstream, workdir, args
                        )
                        per_request[label].append(count)
                        print(f"{label}: {count / 1000:.1f} k instructions per request", flush=True)
        finally:
            procs.stop()
    return {
        "per_request": per_request,
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "baseline_ref": args.baseline_ref,
            "baseline_label": args.baseline_label,
        },
        "load_start": load_start,
        "seconds": round(time.time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="requests counted per gateway")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="fresh gateway processes per tree")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--baseline-ref", default="", help="also measure the gateway at this git ref")
    parser.add_argument("--baseline-label", default="", help="what the baseline is (e.g. pre-hardening)")
    add_results_argument(parser, "gateway_instructions")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    per_request = result["per_request"]
    figures = {
        f"{label}.instructions_per_request": Figure.of([v / 1000 for v in values], "k instructions")
        for label, values in per_request.items()
    }
    if args.baseline_ref:
        now = statistics.median(per_request["kvfleet"])
        before = statistics.median(per_request[bench.baseline_name(args.baseline_ref)])
        figures["share_of_baseline"] = Figure.single(round(100 * now / before, 1), "% of the baseline's")
        print(f"kvfleet / {args.baseline_ref}: x{now / before:.3f}")
    machine = Machine.here(result["load_start"])
    write_results(measured(name_of(args.results), command_line(), figures, machine, result), args.results)


if __name__ == "__main__":
    main()
