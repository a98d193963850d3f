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

``--variants`` adds the current tree with what a fleet of gateways turns on, each counted the same way:
``store`` splits the limits through a real ``redis-server`` (``--shared-store``, ``--replicas 2``: its
sync runs beside the requests, every 0.2 s), ``precise`` routes by an index of KV blocks (a pool of two
replicas, the fake upstream under two addresses, whose KV events a ZMQ publisher in this process fills
with the tenant's blocks: every request is tokenized by the upstream, keyed, matched and routed to the
replica holding it; the upstream reports those tokens cached, so the index keeps them). Their figures,
``kvfleet+<variant>``, against ``kvfleet`` are the hot-path cost of each.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``) and, for ``store``, ``redis-server``. Run:
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
sys.path.insert(0, str(HERE.parents[1] / "hack"))  # devcluster: the shared store's server

import bench  # noqa: E402 - after the path it lives on
import msgspec  # noqa: E402
import zmq  # noqa: E402
from devcluster.shared_store import SharedStoreServer, start_shared_store  # noqa: E402
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
VARIANTS = ("store", "precise")
#: What the fake upstream's ``/tokenize`` answers for the bench request, and the index's block (the bench
#: table's ``block_size``).
TOKENIZE_TOKENS = 40
BLOCK = 16
#: The blocks the index predicts for it, reported cached by the upstream (else the index corrects itself).
CACHED_TOKENS = (TOKENIZE_TOKENS - 1) // BLOCK * BLOCK
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


class Variant:
    """What one measured gateway runs with besides the bench table: more flags and environment, and for
    ``precise`` a table of two replicas whose KV events this process publishes."""

    def __init__(self, name: str, store: SharedStoreServer | None = None) -> None:
        self.name = name
        self.flags: list[str] = []
        self.env: dict[str, str] = {}
        self.publisher: zmq.Socket[bytes] | None = None
        self.events_address = ""
        if name == "store":
            assert store is not None
            from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV  # noqa: PLC0415

            self.flags = ["--replicas", "2", "--shared-store", store.url]
            self.env = {PASSWORD_ENV: store.password}
        elif name == "precise":
            self.publisher = zmq.Context.instance().socket(zmq.PUB)
            port = self.publisher.bind_to_random_port("tcp://127.0.0.1")
            self.events_address = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def write_config(self, directory: Path, upstream: str) -> tuple[Path, Path]:
        """The bench table (by the current tree's schema), for ``precise`` with the upstream under two
        addresses and both replicas' events at this process's publisher."""
        config, keys, _ = bench.write_gateway_config(directory, upstream, KEY)
        if self.name == "precise":
            from kvfleet_runtime.config import TenantTable, dump_json  # noqa: PLC0415

            table = TenantTable.model_validate_json(config.read_text())
            pool = table.pools["shared"].model_copy(
                update={
                    "endpoints": [upstream, upstream.replace("127.0.0.1", "localhost")],
                    "kv_events_endpoints": [self.events_address] * 2,
                }
            )
            table = table.model_copy(update={"pools": {"shared": pool}})
            config.write_text(dump_json(table))
        return config, keys

    def publish_blocks(self, keys_path: Path) -> None:
        """One event batch: the bench tenant's first whole blocks of the upstream's tokens, stored."""
        from kvfleet_runtime.config import KeyFile, derive_cache_salt  # noqa: PLC0415

        assert self.publisher is not None
        salt = derive_cache_salt(KeyFile.model_validate_json(keys_path.read_text()).salt_key, "tenant-bench")
        tokens = list(range(1000, 1000 + TOKENIZE_TOKENS))
        whole = (TOKENIZE_TOKENS - 1) // BLOCK
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(1, whole + 1)),
            "parent_block_hash": None,
            "token_ids": tokens[: whole * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [[salt]] + [None] * (whole - 1),
        }
        payload = msgspec.msgpack.encode([time.time(), [event], 0])
        self.publisher.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


async def metric_total(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with session.get(url) as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def measure_tree(
    session: aiohttp.ClientSession,
    procs: bench.Processes,
    label: str,
    runtime: Path,
    upstream: str,
    workdir: Path,
    args: argparse.Namespace,
    variant: Variant | None = None,
) -> float:
    """Instructions per request of the gateway in ``runtime`` (a fresh process under callgrind)."""
    if variant is None:
        config, keys = bench.write_baseline_config(workdir / label, upstream, KEY, runtime)
    else:
        (workdir / label).mkdir(parents=True)
        config, keys = variant.write_config(workdir / label, upstream)
    port = bench.free_port()
    out_file = str(workdir / f"callgrind.{label}.out")
    argv = bench.gateway_argv(
        runtime, config, keys, port, separate_metrics_port=bench.has_metrics_port_option(runtime)
    )
    argv += variant.flags if variant is not None else []
    procs.start(
        label,
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *argv],
        env={"PYTHONPATH": str(runtime), **(variant.env if variant is not None else {})},
    )
    pid = str(procs.procs[-1].pid)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    target = bench.Target(label, url, {"Authorization": f"Bearer {KEY}"})
    if not await bench.wait_ready(session, target, args.ready_timeout):
        raise RuntimeError(f"{label}: the gateway did not answer within {args.ready_timeout:g} s")
    await send(session, url, WARMUP_REQUESTS, args.concurrency)
    if variant is not None and variant.publisher is not None:
        # Until the index has the blocks and routes by them (a subscriber misses what was published
        # before it joined); nothing is published while counting.
        metrics = f"http://{argv[argv.index('--metrics-listen') + 1]}/metrics"
        deadline = time.monotonic() + args.ready_timeout
        decisions = "kvfleet_gateway_route_decisions_total"
        while await metric_total(session, metrics, decisions, how="precise") < 10:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no precise routing decision within {args.ready_timeout:g} s")
            variant.publish_blocks(keys)
            await asyncio.sleep(0.5)
            await send(session, url, 10, args.concurrency)
        before = await metric_total(session, metrics, decisions, how="precise")
    requests: int = args.requests
    await callgrind_control("-i", "on", pid)
    await send(session, url, requests, args.concurrency)
    await callgrind_control("-d", pid)  # dump what was counted since instrumentation went on
    await callgrind_control("-i", "off", pid)
    if variant is not None and variant.publisher is not None:
        # Every counted request took the precise path (tokenized, keyed, matched, routed by the index).
        after = await metric_total(session, metrics, decisions, how="precise")
        if after - before != requests:
            raise RuntimeError(f"{label}: {after - before:g} of {requests} requests were routed precisely")
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
        store = start_shared_store() if "store" in args.variants else None
        variants = {f"kvfleet+{name}": Variant(name, store) for name in args.variants}
        for label in variants:
            trees[label] = bench.REPO / "runtime"
        up_port = bench.free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        # The upstream tokenizes the bench request (for ``precise``) and reports the blocks the index
        # predicts cached (for every tree alike).
        routing = ["--tokenize-tokens", str(TOKENIZE_TOKENS), "--cached-tokens", str(CACHED_TOKENS)]
        fake = [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(up_port), *routing]
        procs.start("upstream", fake)
        per_request: dict[str, list[float]] = {label: [] for label in trees}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for round_ in range(args.rounds):
                    order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                    for label in order:
                        count = await measure_tree(
                            session,
                            procs,
                            f"{label}-{round_}",
                            trees[label],
                            upstream,
                            workdir,
                            args,
                            variants.get(label),
                        )
                        per_request[label].append(count)
                        print(f"{label}: {count / 1000:.1f} k instructions per request", flush=True)
        finally:
            procs.stop()
            if store is not None:
                store.stop()
    return {
        "per_request": per_request,
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "baseline_ref": args.baseline_ref,
            "baseline_label": args.baseline_label,
            "variants": list(args.variants),
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
    parser.add_argument(
        "--variants", nargs="*", default=[], choices=VARIANTS, help="also the current tree with these on"
    )
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
    for name in args.variants:
        with_it = statistics.median(per_request[f"kvfleet+{name}"])
        plain = statistics.median(per_request["kvfleet"])
        figures[f"{name}.share_of_kvfleet"] = Figure.single(round(100 * with_it / plain, 1), "% of kvfleet's")
        print(f"kvfleet+{name} / kvfleet: x{with_it / plain:.3f}")
    machine = Machine.here(result["load_start"])
    write_results(measured(name_of(args.results), command_line(), figures, machine, result), args.results)


if __name__ == "__main__":
    main()
