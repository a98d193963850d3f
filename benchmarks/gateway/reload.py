"""Tenant-table reloads under load: does a gateway stall the requests it serves while it loads a new table?

For a table of N tenants (``--tenants``; by default 200, one ModelDeployment's share of 10,000 tenants over
50, and 10,000, all of them behind one gateway), a real ``kvfleet gateway`` in front of the fake upstream
(``fake_upstream.py``) serves one tenant's open-loop load (``--rate`` requests a second, sent on a fixed
schedule whatever the answers). Each repeat runs two phases of ``--duration`` seconds, in alternating
order: ``steady`` (the table untouched) and ``reloading`` (the table replaced every ``--every`` seconds, as
the kubelet swaps a mounted ConfigMap, with one other tenant's limit changed, so that every replacement is
a real reload: the gateway's ``kvfleet_gateway_config_reloads_total`` counts them). The figures are each
phase's p50, p99 and slowest request, and ``p99_ratio``: p99 reloading over p99 steady within the same
repeat; medians over the repeats, with their range. The tables are rendered before the phase starts, so the
load generator's own process writes bytes, never builds them, while it measures.

    .venv/bin/python benchmarks/gateway/reload.py          # benchmarks/results/gateway_reload.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the results format

from bench import MODEL, Processes, Target, free_port, run_load, wait_get_ok, wait_ready  # noqa: E402
from results_format import (  # noqa: E402
    Figure,
    Machine,
    Results,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.config import (  # noqa: E402
    KeyFile,
    KVQuota,
    PoolEntry,
    RateLimits,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)

PHASES = ("steady", "reloading")
RELOADS = re.compile(r"^kvfleet_gateway_config_reloads_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
#: Distinct tables a reloading phase cycles through (each differs from the one before it).
VARIANTS = 8


def _tenant(i: int, rpm: int) -> TenantEntry:
    return TenantEntry(
        name=f"t{i}",
        tier="premium" if i % 3 == 0 else "standard" if i % 3 == 1 else "basic",
        priority=i % 3,
        isolation="salted",
        salt_id=f"tenant-t{i}",
        pool="shared",
        models=[MODEL],
        quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=10**6),
        # Far above the offered load: admission runs, never throttles.
        rate_limits=RateLimits(requests_per_minute=rpm, tokens_per_minute=10**12, max_concurrent=10**6),
    )


def render_tables(tenants: int, upstream: str) -> tuple[list[bytes], bytes, str]:
    """``VARIANTS`` tenant tables of ``tenants`` tenants (variant k raises tenant k+1's limit), the key
    file, and tenant 0's key (the one under load)."""
    entries = {f"t{i}": _tenant(i, 10**9) for i in range(tenants)}
    pool = PoolEntry(name="shared", endpoints=[upstream], block_size=16, hbm_blocks_per_replica=10**6)
    tables = []
    for k in range(VARIANTS):
        changed = dict(entries)
        other = 1 + k % max(1, tenants - 1)
        changed[f"t{other}"] = _tenant(other, 10**9 - 1 - k)
        table = TenantTable(
            model_deployment="bench",
            served_model_name=MODEL,
            pool_salt_id="pool",
            pools={"shared": pool},
            tenants=changed,
        )
        tables.append(dump_json(table).encode())
    key = "sk-bench-" + secrets.token_hex(16)
    hashes = {"t0": [hash_api_key(key)]} | {
        f"t{i}": [hash_api_key(f"sk-other-{i}-{secrets.token_hex(8)}")] for i in range(1, tenants)
    }
    keys = dump_json(KeyFile(salt_key_hex=secrets.token_hex(32), key_hashes=hashes)).encode()
    return tables, keys, key


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path`` and rename it over ``path`` (atomic, as the kubelet swaps a
    ConfigMap's files)."""
    tmp = path.with_suffix(".next")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def reloads(session: aiohttp.ClientSession, metrics_url: str) -> float:
    async with session.get(metrics_url) as resp:
        text = await resp.text()
    found = RELOADS.search(text)
    return float(found.group(1)) if found else float("nan")


async def rewrite_every(path: Path, tables: list[bytes], every: float, stop: asyncio.Event) -> int:
    """Replace the table every ``every`` seconds until ``stop``; how many times."""
    count = 0
    while not stop.is_set():
        replace_file(path, tables[(count + 1) % len(tables)])
        count += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
    return count


async def one_size(args: argparse.Namespace, tenants: int, workdir: Path) -> list[dict[str, Any]]:
    procs = Processes(workdir)
    py = sys.executable
    up_port, gw_port, metrics_port = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    tables, keys_json, key = render_tables(tenants, upstream)
    table_path, keys_path = workdir / "tenants.json", workdir / "keys.json"
    replace_file(table_path, tables[0])
    replace_file(keys_path, keys_json)
    procs.start("upstream", [py, str(HERE / "fake_upstream.py"), "--port", str(up_port)])
    runtime = REPO / "runtime"
    argv = [py, "-m", "kvfleet_runtime", "gateway", "--config", str(table_path), "--keys", str(keys_path)]
    argv += ["--listen", f"127.0.0.1:{gw_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}"]
    argv += ["--log-level", "WARNING"]
    procs.start("gateway", argv, env={"PYTHONPATH": str(runtime)})
    target = Target(
        "kvfleet", f"http://127.0.0.1:{gw_port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}
    )
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    rows: list[dict[str, Any]] = []
    try:
        limits = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=limits, timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            await wait_get_ok(session, upstream + "/health")
            if not await wait_ready(session, target, 120):
                raise RuntimeError(
                    f"the gateway did not serve with {tenants} tenants; see {workdir}/gateway.log"
                )
            await run_load(session, target, args.rate, 3.0)  # warm: connections, first requests
            for repeat in range(args.repeats):
                order = PHASES if repeat % 2 == 0 else PHASES[::-1]
                row: dict[str, Any] = {"tenants": tenants, "repeat": repeat}
                for phase in order:
                    before = await reloads(session, metrics_url)
                    stop = asyncio.Event()
                    writer = (
                        asyncio.create_task(rewrite_every(table_path, tables, args.every, stop))
                        if phase == "reloading"
                        else None
                    )
                    result = await run_load(session, target, args.rate, args.duration)
                    stop.set()
                    written = await writer if writer is not None else 0
                    await asyncio.sleep(args.every + 1.5)  # the last replacement's reload, outside the load
                    row[phase] = {
                        "p50_ms": result.p50_ms,
                        "p99_ms": result.p99_ms,
                        "max_ms": result.max_ms,
                        "errors": result.errors,
                        "sent": result.sent,
                        "written": written,
                        "reloads": await reloads(session, metrics_url) - before,
                    }
                row["p99_ratio"] = row["reloading"]["p99_ms"] / row["steady"]["p99_ms"]
                print(
                    f"{tenants} tenants, repeat {repeat}: p99 steady {row['steady']['p99_ms']:.1f} ms, "
                    f"reloading {row['reloading']['p99_ms']:.1f} ms ({row['reloading']['reloads']:.0f} "
                    f"reloads), max {row['reloading']['max_ms']:.1f} ms",
                    flush=True,
                )
                rows.append(row)
    finally:
        procs.stop()
    return rows


def to_results(args: argparse.Namespace, rows: list[dict[str, Any]], load: float) -> Results:
    figures: dict[str, Figure] = {}
    for tenants in args.tenants:
        mine = [r for r in rows if r["tenants"] == tenants]
        for phase in PHASES:
            for stat in ("p50_ms", "p99_ms", "max_ms"):
                figures[f"{tenants}_tenants.{phase}.{stat}"] = Figure.of([r[phase][stat] for r in mine], "ms")
            figures[f"{tenants}_tenants.{phase}.errors"] = Figure.of(
                [r[phase]["errors"] for r in mine], "requests"
            )
        figures[f"{tenants}_tenants.reloads_per_phase"] = Figure.of(
            [r["reloading"]["reloads"] for r in mine], "reloads"
        )
        figures[f"{tenants}_tenants.p99_ratio"] = Figure.of([r["p99_ratio"] for r in mine], "x steady")
    return measured(
        name=name_of(args.results),
        command=command_line(),
        machine=Machine.here(load),
        figures=figures,
        details={
            "rate": args.rate,
            "duration_s": args.duration,
            "every_s": args.every,
            "repeats": args.repeats,
            "median_p99_ratio": {
                str(t): statistics.median(r["p99_ratio"] for r in rows if r["tenants"] == t)
                for t in args.tenants
            },
            "runs": rows,
        },
    )


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for tenants in args.tenants:
        with tempfile.TemporaryDirectory(prefix="kvfleet-reload-") as tmp:
            rows += await one_size(args, tenants, Path(tmp))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[200, 10_000])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second, open loop")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between table replacements")
    parser.add_argument("--repeats", type=int, default=3)
    add_results_argument(parser, "gateway_reload")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = asyncio.run(bench(args))
    print(f"results: {write_results(to_results(args, rows, load), args.results)}")


if __name__ == "__main__":
    main()
