"""Rate limits across gateway replicas: what a tenant whose traffic lands unevenly is admitted, with the
replicas splitting its limit through the shared store (Redis: gateway/shared_store.py) against today's
static split (each replica 1/N), in the same run; and the same shared run with the store killed.

For 2 and 4 gateway replicas (real ``kvfleet gateway`` processes on loopback, in front of the fake upstream:
the limits are the gateway's alone) one tenant with ``--rpm`` requests per minute offers ``--offered`` times
its limit, open loop (requests at a steady rate, whatever the answers), 90% of them to replica 0 and the
rest spread over the others. The load runs ``--warm`` seconds so the split settles, then each replica's
bucket is emptied (a burst until its first 429: what a bucket saved is not the rate the split sets), then
what the replicas admit (200s) is counted over ``--window`` seconds: ``admitted / limit`` is the figure, 1.0
being the whole limit. In the ``store-killed`` mode the store is killed when the window starts (the replicas
fall back to 1/N within a second: ``fallback_s``).

    .venv/bin/python benchmarks/gateway/shared_limits.py --runs 3    # benchmarks/results/shared_limits.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the results format
sys.path.insert(0, str(REPO / "hack"))  # devcluster: the shared store's server

from bench import Processes, free_port, wait_get_ok  # noqa: E402
from devcluster.shared_store import SharedStoreServer, start_shared_store  # noqa: E402
from results_format import Figure, Machine, Results, add_results_argument, measured, write_results  # noqa: E402

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
from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV  # noqa: E402

MODEL = "tiny"
MODES = ("static", "shared", "store-killed")
BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'


def write_config(directory: Path, upstream: str, rpm: int) -> str:
    key = "sk-bench-" + secrets.token_hex(16)
    table = TenantTable(
        model_deployment="bench/shared-limits",
        served_model_name=MODEL,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[upstream], block_size=16, hbm_blocks_per_replica=10**6
            )
        },
        tenants={
            "bench": TenantEntry(
                name="bench",
                tier="premium",
                priority=0,
                isolation="salted",
                salt_id="tenant-bench",
                pool="shared",
                models=[MODEL],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=10**6),
                rate_limits=RateLimits(requests_per_minute=rpm),
            )
        },
    )
    (directory / "tenants.json").write_text(dump_json(table))
    keys = KeyFile(salt_key_hex=secrets.token_hex(32), key_hashes={"bench": [hash_api_key(key)]})
    (directory / "keys.json").write_text(dump_json(keys))
    return key


async def shared_store_up(http: aiohttp.ClientSession, metrics_url: str) -> float:
    async with http.get(metrics_url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("kvfleet_gateway_shared_store_up "):
                return float(line.split()[1])
    return 0.0


@contextlib.asynccontextmanager
async def replicas(
    workdir: Path, n: int, upstream: str, store: SharedStoreServer | None
) -> AsyncIterator[list[tuple[str, str]]]:
    """``n`` gateway replicas: (public URL, metrics URL) each."""
    children = Processes(workdir)
    urls: list[tuple[str, str]] = []
    try:
        for i in range(n):
            port, metrics = free_port(), free_port()
            argv = [
                sys.executable, "-m", "kvfleet_runtime", "gateway",
                "--config", str(workdir / "tenants.json"), "--keys", str(workdir / "keys.json"),
                "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}",
                "--replicas", str(n), "--parse-workers", "0",
            ]  # fmt: skip
            env = {}
            if store is not None:
                argv += ["--shared-store", store.url]
                env[PASSWORD_ENV] = store.password
            children.start(f"gateway-{n}-{i}", argv, env)
            urls.append((f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"))
        async with aiohttp.ClientSession() as http:
            for url, _ in urls:
                await wait_get_ok(http, url + "/readyz")
        yield urls
    finally:
        children.stop()


class OpenLoop:
    """Requests at a steady rate to each replica, each on its own task; statuses counted per replica."""

    def __init__(self, http: aiohttp.ClientSession, key: str, rates: list[float], urls: list[str]) -> None:
        self.http, self.key, self.rates, self.urls = http, key, rates, urls
        self.statuses: list[Counter[int]] = [Counter() for _ in urls]
        self._inflight: set[asyncio.Task[None]] = set()

    async def _one(self, i: int) -> None:
        try:
            async with self.http.post(
                self.urls[i] + "/v1/chat/completions",
                data=BODY,
                headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            ) as r:
                await r.read()
                self.statuses[i][r.status] += 1
        except (aiohttp.ClientError, OSError):
            self.statuses[i][0] += 1

    async def _replica(self, i: int) -> None:
        if self.rates[i] <= 0:
            return
        interval, next_at = 1.0 / self.rates[i], time.monotonic()
        while True:
            next_at += interval
            task = asyncio.create_task(self._one(i))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def admitted(self) -> int:
        return sum(c[200] for c in self.statuses)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[OpenLoop]:
        tasks = [asyncio.create_task(self._replica(i)) for i in range(len(self.urls))]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, *self._inflight, return_exceptions=True)


async def drain(http: aiohttp.ClientSession, key: str, url: str) -> int:
    """Empty one replica's bucket: requests until the first 429; how many were admitted."""
    admitted = 0
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    while True:
        async with http.post(url + "/v1/chat/completions", data=BODY, headers=headers) as r:
            await r.read()
            if r.status == 429:
                return admitted
            admitted += 1


def spread_rates(total: float, n: int, skew: float) -> list[float]:
    """``skew`` of ``total`` to replica 0, the rest evenly over the others."""
    return [total * skew] + [total * (1 - skew) / (n - 1)] * (n - 1)


async def run_one(args: argparse.Namespace, n: int, mode: str, upstream: str) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvfleet-shared-limits-{n}-{mode}-"))
    key = write_config(workdir, upstream, args.rpm)
    store = start_shared_store() if mode != "static" else None
    try:
        async with replicas(workdir, n, upstream, store) as urls, aiohttp.ClientSession() as http:
            rates = spread_rates(args.rpm / 60 * args.offered, n, args.skew)
            load = OpenLoop(http, key, rates, [u for u, _ in urls])
            async with load.running():
                await asyncio.sleep(args.warm)
                # Whatever a bucket saved while the split settled is spent now, so the window counts what
                # the buckets refill: the rates the split sets, not a burst saved before it.
                await asyncio.gather(*(drain(http, key, url) for url, _ in urls))
                fallback_s = 0.0
                start_admitted, start = load.admitted(), time.monotonic()
                if mode == "store-killed":
                    assert store is not None
                    store.kill()
                    while True:
                        if await shared_store_up(http, urls[0][1]) == 0:
                            break
                        await asyncio.sleep(0.05)
                    fallback_s = time.monotonic() - start
                await asyncio.sleep(args.window - (time.monotonic() - start))
                admitted = load.admitted() - start_admitted
                elapsed = time.monotonic() - start
            failed = sum(c[s] for c in load.statuses for s in c if s not in (200, 429))
        limit = args.rpm * elapsed / 60
        row = {
            "admitted_of_limit": admitted / limit,
            "admitted": admitted,
            "failed": failed,
            "fallback_s": fallback_s,
        }
        print(f"{n} replicas, {mode}: {row}", flush=True)
        return row
    finally:
        if store is not None:
            store.stop()


@contextlib.contextmanager
def fake_upstream(logdir: Path) -> Iterator[str]:
    children = Processes(logdir)
    port = free_port()
    children.start("upstream", [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(port)])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        children.stop()


async def bench(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, float]]]]:
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    with fake_upstream(Path(tempfile.mkdtemp(prefix="kvfleet-shared-limits-"))) as upstream:
        async with aiohttp.ClientSession() as http:
            await wait_get_ok(http, upstream + "/health")
        for _ in range(args.runs):
            for n in args.replicas:
                for mode in MODES:
                    out.setdefault(f"{n}", {}).setdefault(mode, []).append(
                        await run_one(args, n, mode, upstream)
                    )
    return out


def to_results(
    args: argparse.Namespace, rows: dict[str, dict[str, list[dict[str, float]]]], load: float
) -> Results:
    figures: dict[str, Figure] = {}
    for n, modes in rows.items():
        for mode, runs in modes.items():
            figures[f"{n}_replicas.{mode}.admitted_of_limit"] = Figure.of(
                [r["admitted_of_limit"] for r in runs], "of the limit"
            )
            if mode == "store-killed":
                figures[f"{n}_replicas.{mode}.fallback_s"] = Figure.of([r["fallback_s"] for r in runs], "s")
            figures[f"{n}_replicas.{mode}.failed"] = Figure.of([r["failed"] for r in runs], "requests")
    argv = sys.argv[1:]
    if "--results" in argv:  # where the file went is not part of what was measured
        i = argv.index("--results")
        argv = argv[:i] + argv[i + 2 :]
    command = ".venv/bin/python benchmarks/gateway/shared_limits.py " + shlex.join(argv)
    return measured(
        name="shared_limits",
        command=command.strip(),
        machine=Machine.here(load),
        figures=figures,
        details={
            "rpm": args.rpm,
            "offered": args.offered,
            "skew": args.skew,
            "warm_s": args.warm,
            "window_s": args.window,
            "runs": {n: {m: list(map(dict, r)) for m, r in modes.items()} for n, modes in rows.items()},
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rpm", type=int, default=600, help="the tenant's requests per minute")
    parser.add_argument("--offered", type=float, default=1.5, help="offered load, in times the limit")
    parser.add_argument("--skew", type=float, default=0.9, help="the part of the load on replica 0")
    parser.add_argument("--warm", type=float, default=20.0, help="seconds of load before the window")
    parser.add_argument("--window", type=float, default=60.0, help="seconds over which admissions count")
    parser.add_argument("--runs", type=int, default=1)
    add_results_argument(parser, "shared_limits")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = asyncio.run(bench(args))
    print(f"results: {write_results(to_results(args, rows, load), args.results)}")


if __name__ == "__main__":
    main()
