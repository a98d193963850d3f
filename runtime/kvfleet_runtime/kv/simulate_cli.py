"""``kvfleet simulate``: replay a workload through the KV policy core and compare cache policies.

Capacities come from the planner (``--preset``/``--config-json`` with the same engine flags as
``kvfleet plan``: ``--gpus``, ``--gpus-per-replica``, ``--kv-dtype``, ``--cpu-tier``, ``--nvme-tier``...)
or directly from ``--hbm-tokens`` (per replica) with ``--replicas``. Tenants are ``--tenant
NAME:SLA:SHARE:SESSIONS`` (repeatable; SHARE is the quota as a fraction of every tier). The workload is a
built-in (``--workload rag-chat|multi-round-qa|noisy-neighbour``) or ``--trace FILE.jsonl`` (format in
:mod:`kvfleet_runtime.kv.workloads`). ``--tenant-table tenants.json`` (the runtime tenant table the
operator renders for a ModelDeployment) supplies both: the pool's capacities, burst cap and replicas, and
every tenant of the pool with its SLA tier, quotas and TTLs (planner flags, when given, set the
capacities instead). Output: a table per policy, or ``--output json``; ``--plot DIR`` writes PNG charts.

``--fair-queuing fifo,vtc`` replays instead the gateway's fair queue (``kv.fairness``) in front of
``replicas x --slots-per-replica`` engine slots (``simulate_fair_queuing``): tenants ``--fair-tenant
NAME:SLA:WEIGHT:LOAD`` (LOAD in multiples of the fleet's request capacity) or a ``--fair-scenario``, and
per mode each tenant's served tokens/s, TTFT p50/p99, refusals and Jain's fairness index.
Exit codes: 0, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from kvfleet_runtime.config import PoolEntry, SlaTier, TenantTable, TierTTLs
from kvfleet_runtime.kv.fairness import TokenCost
from kvfleet_runtime.kv.plan_cli import build_plan_request
from kvfleet_runtime.kv.presets import PRESETS
from kvfleet_runtime.kv.simulator import (
    POLICIES,
    ROUTINGS,
    FairQueuingResult,
    FairTenant,
    FleetSpec,
    RoutingSpec,
    SimulatedTenant,
    SimulationResult,
    build_fair_workload,
    simulate,
    simulate_fair_queuing,
)
from kvfleet_runtime.kv.sizing import (
    DEFAULT_NVME_GBPS,
    DEFAULT_PCIE_GBPS,
    SizingError,
    build_plan,
    format_validation_error,
    parse_byte_size,
    parse_token_count,
)
from kvfleet_runtime.kv.workloads import (
    Request,
    TenantLoad,
    build_multi_round_qa,
    build_noisy_neighbour,
    build_rag_chat,
    read_jsonl_trace,
)

EXIT_BAD_INPUT = 2
WORKLOADS = ("rag-chat", "multi-round-qa", "noisy-neighbour")


class SimulateError(ValueError):
    """Bad input; the message is one line for the user."""


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command to the ``kvfleet`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="Replay a workload through the KV policy core across HBM/CPU/NVMe and compare policies.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_simulate_arguments(parser)
    parser.set_defaults(func=run_simulate)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("capacity from the planner (as `kvfleet plan`)")
    model.add_argument("--preset", help=f"model architecture: {', '.join(PRESETS)}")
    model.add_argument("--config-json", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    model.add_argument("--weight-dtype", dest="weight_dtype", help="override the weights' dtype, e.g. fp8")
    model.add_argument("--kv-dtype", default="auto", help="auto|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2")
    model.add_argument("--block-size", default="16", help="vLLM tokens per KV block")
    model.add_argument("--gpus", help="GPUs in the pool; replicas = gpus / gpus-per-replica")
    model.add_argument("--gpus-per-replica", help="GPUs per replica (= tensor x pipeline parallel)")
    model.add_argument("--tensor-parallel", help="tensor-parallel size")
    model.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 141GB")
    model.add_argument("--gpu-memory-utilization", default="0.9", help="0..1")
    model.add_argument(
        "--reserve", default="2GiB", help="per-GPU memory beyond the weights (planner default)"
    )
    model.add_argument("--replicas", help="replicas (default: --gpus / --gpus-per-replica, else 1)")
    model.add_argument("--cpu-tier", help="LMCache CPU tier per replica, e.g. 64Gi")
    model.add_argument("--nvme-tier", help="LMCache NVMe tier per replica, e.g. 512Gi")
    model.add_argument("--pcie-gbps", default=str(DEFAULT_PCIE_GBPS), help="host-to-GPU GB/s per GPU")
    model.add_argument("--nvme-gbps", default=str(DEFAULT_NVME_GBPS), help="NVMe read GB/s per replica")
    table = parser.add_argument_group("capacity and tenants from a rendered tenant table")
    table.add_argument("--tenant-table", type=Path, metavar="PATH", help="tenants.json of a ModelDeployment")
    table.add_argument("--pool", help="pool of the tenant table (default: its only or first pool)")
    table.add_argument("--sessions-per-tenant", type=int, default=50, help="load of each table tenant")
    direct = parser.add_argument_group("capacity without a model (tokens per replica)")
    direct.add_argument("--hbm-tokens", help="HBM KV tokens per replica, e.g. 1M")
    direct.add_argument("--cpu-tokens", help="CPU tier tokens per replica")
    direct.add_argument("--nvme-tokens", help="NVMe tier tokens per replica")
    direct.add_argument("--kv-bytes-per-token", default="0", help="bytes per token (restore-time estimate)")
    speed = parser.add_argument_group("speeds (TTFT estimate)")
    speed.add_argument("--prefill-tps", type=float, default=20_000.0, help="prefill tokens/s per replica")
    speed.add_argument("--decode-tps", type=float, default=40.0, help="decode tokens/s per request")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", default="rag-chat", choices=WORKLOADS, help="built-in workload")
    work.add_argument("--trace", type=Path, help="replay a JSONL trace instead of a built-in workload")
    work.add_argument(
        "--tenant",
        action="append",
        metavar="NAME:SLA:SHARE:SESSIONS",
        help="a tenant (repeatable): SLA premium|standard|basic, SHARE its quota as a fraction of each "
        "tier, SESSIONS its concurrent sessions / users / repeated prompts",
    )
    work.add_argument("--noisy", help="noisy-neighbour: the flooding tenant's name (default 'noisy')")
    work.add_argument("--noisy-qps", type=float, default=5.0, help="noisy-neighbour: flood requests/s")
    work.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    work.add_argument("--warmup", type=float, default=600.0, help="seconds not measured at the start")
    work.add_argument("--think-seconds", type=float, default=60.0, help="mean idle gap between turns")
    work.add_argument("--rounds", type=int, default=10, help="multi-round-qa: rounds per user")
    work.add_argument("--qps", type=float, default=2.0, help="multi-round-qa: requests per second")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--hbm-ttl", type=float, default=TierTTLs().hbm_seconds, help="kvfleet: HBM TTL (s)")
    work.add_argument("--cpu-ttl", type=float, default=TierTTLs().cpu_seconds, help="kvfleet: CPU TTL (s)")
    work.add_argument("--nvme-ttl", type=float, default=TierTTLs().nvme_seconds, help="kvfleet: NVMe TTL (s)")
    fair = parser.add_argument_group("fair queuing at the gateway (instead of the KV replay)")
    fair.add_argument("--fair-queuing", metavar="MODES", help="comma-separated: fifo, vtc (e.g. fifo,vtc)")
    fair.add_argument("--fair-scenario", default="two-tenants-5x", choices=tuple(FAIR_SCENARIOS))
    fair.add_argument(
        "--fair-tenant",
        action="append",
        metavar="NAME:SLA:WEIGHT:LOAD",
        help="a tenant (repeatable, replaces the scenario): LOAD its requests/s as a multiple of the fleet's "
        "request capacity",
    )
    fair.add_argument("--slots-per-replica", type=int, default=256, help="the gateway's in-flight limit")
    fair.add_argument("--fair-max-wait", type=float, default=10.0, help="seconds held before a 429")
    fair.add_argument("--prompt-tokens", default="128-384", help="prompt length range, e.g. 128-384")
    fair.add_argument("--output-tokens", default="128-384", help="output length range, e.g. 128-384")
    sim = parser.add_argument_group("simulation and output")
    sim.add_argument(
        "--policy", default="lru,kvfleet", help=f"comma-separated, from: {', '.join(POLICIES)} (or 'all')"
    )
    sim.add_argument("--unit-tokens", type=int, default=256, help="tokens per simulated KV unit")
    sim.add_argument(
        "--routing",
        default="session",
        choices=ROUTINGS,
        help="how a request picks its replica: session (an ideal), affinity (the gateway's salted prefix "
        "hash within the load bound) or precise (affinity, unless another replica holds more of the "
        "prompt on its GPU)",
    )
    sim.add_argument(
        "--affinity-tokens", type=int, default=128, help="leading prompt tokens in the affinity key"
    )
    sim.add_argument("--sample-seconds", type=float, default=60.0, help="timeline resolution")
    sim.add_argument("--output", default="table", choices=("table", "json"))
    sim.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts into DIR")
    # Fields build_plan_request reads that `simulate` does not expose.
    parser.set_defaults(
        name=None,
        context=None,
        sessions=None,
        weight_bytes_per_gpu=None,
        pipeline_parallel=None,
        num_layers=None,
        num_attention_heads=None,
        num_kv_heads=None,
        head_dim=None,
        hidden_size=None,
        kv_lora_rank=None,
        qk_rope_head_dim=None,
        num_parameters=None,
        num_experts=None,
        num_experts_per_token=None,
    )


def build_fleet_spec(args: argparse.Namespace) -> FleetSpec:
    """Tier capacities (in units) and speeds from the planner flags or the direct token counts."""
    unit = args.unit_tokens
    if unit < 1:
        raise SimulateError("--unit-tokens must be at least 1")
    common = {"prefill_tokens_per_second": args.prefill_tps, "decode_tokens_per_second": args.decode_tps}
    if args.preset or args.config_json:
        if args.gpus and not args.replicas:
            per = int(args.gpus_per_replica or args.tensor_parallel or 1)
            if int(args.gpus) % per:
                raise SimulateError(f"--gpus {args.gpus} is not a multiple of {per} GPUs per replica")
            args.replicas = str(int(args.gpus) // per)
        args.replicas = args.replicas or "1"
        plan = build_plan(build_plan_request(args))
        per_token = plan.kv_per_token.offload_bytes
        cpu = parse_byte_size(args.cpu_tier) if args.cpu_tier else 0
        nvme = parse_byte_size(args.nvme_tier) if args.nvme_tier else 0
        return FleetSpec(
            replicas=plan.engine.replicas,
            unit_tokens=unit,
            hbm_units_per_replica=plan.capacity.tokens_per_replica // unit,
            cpu_units_per_replica=cpu // (per_token * unit),
            nvme_units_per_replica=nvme // (per_token * unit),
            kv_bytes_per_token_per_gpu=plan.kv_per_token.bytes_per_gpu,
            offload_bytes_per_token=per_token,
            pcie_gbps=float(args.pcie_gbps),
            nvme_gbps=float(args.nvme_gbps),
            **common,
        )
    per_token = parse_byte_size(args.kv_bytes_per_token)
    if args.tenant_table and not args.hbm_tokens:
        pool = _table_pool(args)
        if (pool.cpu_bytes_per_replica or pool.nvme_bytes_per_replica) and not per_token:
            raise SimulateError("the pool has CPU/NVMe tiers: give --kv-bytes-per-token (or --preset ...)")
        tier_unit = max(1, per_token) * unit
        return FleetSpec(
            replicas=int(args.replicas or len(pool.endpoints) or 1),
            unit_tokens=unit,
            hbm_units_per_replica=pool.hbm_blocks_per_replica * pool.block_size // unit,
            cpu_units_per_replica=pool.cpu_bytes_per_replica // tier_unit,
            nvme_units_per_replica=pool.nvme_bytes_per_replica // tier_unit,
            kv_bytes_per_token_per_gpu=per_token,
            offload_bytes_per_token=per_token,
            pcie_gbps=float(args.pcie_gbps),
            nvme_gbps=float(args.nvme_gbps),
            **common,
        )
    if not args.hbm_tokens:
        raise SimulateError(
            "no capacity: give --preset/--config-json (planner flags), --tenant-table or --hbm-tokens"
        )
    return FleetSpec(
        replicas=int(args.replicas or 1),
        unit_tokens=unit,
        hbm_units_per_replica=parse_token_count(args.hbm_tokens) // unit,
        cpu_units_per_replica=parse_token_count(args.cpu_tokens) // unit if args.cpu_tokens else 0,
        nvme_units_per_replica=parse_token_count(args.nvme_tokens) // unit if args.nvme_tokens else 0,
        kv_bytes_per_token_per_gpu=per_token,
        offload_bytes_per_token=per_token,
        pcie_gbps=float(args.pcie_gbps),
        nvme_gbps=float(args.nvme_gbps),
        **common,
    )


def parse_tenant(text: str, ttl: TierTTLs) -> tuple[SimulatedTenant, int]:
    """``NAME:SLA:SHARE:SESSIONS`` -> (spec, sessions)."""
    parts = text.split(":")
    if len(parts) != 4:
        raise SimulateError(f"--tenant {text!r}: want NAME:SLA:SHARE:SESSIONS, e.g. acme:premium:0.3:200")
    name, sla, share, sessions = parts
    try:
        spec = SimulatedTenant(name=name, sla=SlaTier(sla), share=float(share), ttl=ttl)
        count = int(sessions)
    except ValueError as exc:
        raise SimulateError(f"--tenant {text!r}: {exc}") from None
    if not 0 <= spec.share <= 1 or count < 0:
        raise SimulateError(f"--tenant {text!r}: SHARE must be in [0, 1] and SESSIONS >= 0")
    return spec, count


def _load_table(args: argparse.Namespace) -> TenantTable:
    try:
        return TenantTable.load(args.tenant_table)
    except OSError as exc:
        raise SimulateError(f"--tenant-table: {exc}") from None


def _table_pool(args: argparse.Namespace) -> PoolEntry:
    table = _load_table(args)
    name = args.pool or next(iter(table.pools), None)
    if name is None or name not in table.pools:
        raise SimulateError(f"--pool {name!r} is not one of the pools {sorted(table.pools)}")
    return table.pools[name]


def build_table_tenants(args: argparse.Namespace) -> list[SimulatedTenant]:
    """The pool's tenants with their tier, quotas (as shares of each tier), TTLs and salt group."""
    table = _load_table(args)
    pool = _table_pool(args)

    def ratio(part: int, whole: int) -> float:
        return min(1.0, part / whole) if whole else 0.0

    return [
        SimulatedTenant(
            name=t.name,
            sla=t.tier,
            share=ratio(t.quota.hbm_blocks, pool.hbm_blocks_per_replica),
            cpu_share=ratio(t.quota.cpu_bytes, pool.cpu_bytes_per_replica),
            nvme_share=ratio(t.quota.nvme_bytes, pool.nvme_bytes_per_replica),
            ttl=t.ttl,
            burst_cap=pool.burst_cap,
            salt=t.salt_id,
        )
        for t in table.tenants.values()
        if t.pool == pool.name
    ]


def build_tenants(args: argparse.Namespace) -> tuple[list[SimulatedTenant], list[TenantLoad]]:
    ttl = TierTTLs(hbm_seconds=args.hbm_ttl, cpu_seconds=args.cpu_ttl, nvme_seconds=args.nvme_ttl)
    specs: list[SimulatedTenant] = []
    loads: list[TenantLoad] = []
    if args.tenant_table:
        specs = build_table_tenants(args)
        loads = [TenantLoad(s.name, args.sessions_per_tenant, args.think_seconds) for s in specs]
    texts = args.tenant or ([] if specs else ["tenant-a:standard:0.5:100", "tenant-b:standard:0.5:100"])
    for text in texts:
        spec, sessions = parse_tenant(text, ttl)
        specs.append(spec)
        loads.append(TenantLoad(spec.name, sessions, args.think_seconds))
    if args.workload == "noisy-neighbour" and not args.trace:
        noisy = args.noisy or "noisy"
        if noisy not in {s.name for s in specs}:
            specs.append(SimulatedTenant(name=noisy, sla=SlaTier.BASIC, share=0.0, ttl=ttl))
    return specs, loads


def build_workload(args: argparse.Namespace, loads: list[TenantLoad]) -> list[Request]:
    if args.trace:
        return read_jsonl_trace(args.trace, args.unit_tokens)
    if args.workload == "rag-chat":
        return build_rag_chat(loads, args.duration, seed=args.seed)
    if args.workload == "multi-round-qa":
        return build_multi_round_qa(loads, rounds=args.rounds, qps=args.qps, seed=args.seed)
    noisy = args.noisy or "noisy"
    quiet = [load for load in loads if load.name != noisy]
    return build_noisy_neighbour(quiet, noisy, args.duration, noisy_qps=args.noisy_qps, seed=args.seed)


def parse_policies(text: str) -> list[str]:
    names = list(POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise SimulateError(f"--policy: unknown {unknown or text!r}; choose from {', '.join(POLICIES)}")
    return names


#: Built-in fair-queuing scenarios: (name, SLA, weight, load as a multiple of the request capacity).
#: ``two-tenants-5x``: the VTC paper's overloaded pair, both above their half (Jain's index of the service
#: is the measure); ``light-under-share``: the light tenant asks less than its half (its TTFT is);
#: ``weighted``: four tenants of weights 1, 1, 2, 4, each asking half the fleet; ``tiers``: a premium
#: tenant above the standard pair (strict priority, then VTC within standard). The ``gaie-*`` ones follow
#: the Gateway API Inference Extension's flow-control benchmarking guide (kubernetes-sigs/gateway-api-
#: inference-extension#1801): ``gaie-single-saturation`` (its scenario 1: one tenant just past
#: saturation; with one tenant VTC orders exactly as FIFO, so the pair checks that the fair queue costs
#: nothing there), ``gaie-8-tenants`` (its scenario 3: eight tenants of one tier and equal load, twice the
#: fleet) and ``gaie-8-tenants-skewed`` (scenario 3 with one tier but demands from 0.05 to 1.6 x capacity,
#: where FIFO follows the arrivals and VTC gives each its max-min fair share).
FAIR_SCENARIOS: dict[str, tuple[tuple[str, SlaTier, float, float], ...]] = {
    "two-tenants-5x": (("light", SlaTier.STANDARD, 1.0, 0.6), ("heavy", SlaTier.STANDARD, 1.0, 3.0)),
    "light-under-share": (("light", SlaTier.STANDARD, 1.0, 0.2), ("heavy", SlaTier.STANDARD, 1.0, 1.0)),
    "weighted": (
        ("w1-a", SlaTier.STANDARD, 1.0, 0.5),
        ("w1-b", SlaTier.STANDARD, 1.0, 0.5),
        ("w2", SlaTier.STANDARD, 2.0, 0.5),
        ("w4", SlaTier.STANDARD, 4.0, 0.5),
    ),
    "tiers": (
        ("premium", SlaTier.PREMIUM, 1.0, 0.3),
        ("light", SlaTier.STANDARD, 1.0, 0.6),
        ("heavy", SlaTier.STANDARD, 1.0, 3.0),
    ),
    "gaie-single-saturation": (("only", SlaTier.STANDARD, 1.0, 1.1),),
    "gaie-8-tenants": tuple((f"t{i}", SlaTier.STANDARD, 1.0, 0.25) for i in range(1, 9)),
    "gaie-8-tenants-skewed": tuple(
        (f"t{i}", SlaTier.STANDARD, 1.0, load)
        for i, load in enumerate((0.05, 0.05, 0.1, 0.1, 0.2, 0.4, 0.8, 1.6), start=1)
    ),
}


def _length_range(text: str, flag: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise SimulateError(f"{flag} {text!r}: want N or LOW-HIGH tokens") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise SimulateError(f"{flag} {text!r}: want 0 < LOW <= HIGH")
    return bounds


def _fair_tenants(args: argparse.Namespace) -> list[tuple[str, SlaTier, float, float]]:
    if not args.fair_tenant:
        return list(FAIR_SCENARIOS[args.fair_scenario])
    rows = []
    for text in args.fair_tenant:
        parts = text.split(":")
        if len(parts) != 4:
            raise SimulateError(
                f"--fair-tenant {text!r}: want NAME:SLA:WEIGHT:LOAD, e.g. acme:standard:2:0.5"
            )
        try:
            row = (parts[0], SlaTier(parts[1]), float(parts[2]), float(parts[3]))
        except ValueError as exc:
            raise SimulateError(f"--fair-tenant {text!r}: {exc}") from None
        if row[2] <= 0 or row[3] < 0:
            raise SimulateError(f"--fair-tenant {text!r}: WEIGHT must be > 0 and LOAD >= 0")
        rows.append(row)
    return rows


def run_fair_queuing(args: argparse.Namespace, out: TextIO) -> int:
    """``--fair-queuing``: the same workload through each mode; see the module docstring."""
    modes = [m.strip() for m in args.fair_queuing.split(",") if m.strip()]
    if not modes or any(m not in ("fifo", "vtc") for m in modes):
        raise SimulateError(f"--fair-queuing {args.fair_queuing!r}: choose from fifo, vtc")
    if args.slots_per_replica < 1:
        raise SimulateError("--slots-per-replica must be at least 1")
    if args.replicas:
        replicas = int(args.replicas)
    else:
        per = int(args.gpus_per_replica or args.tensor_parallel or 1)
        replicas = int(args.gpus) // per if args.gpus else 1
    if replicas < 1:
        raise SimulateError("the fleet needs at least one replica (--replicas or --gpus)")
    prompt = _length_range(args.prompt_tokens, "--prompt-tokens")
    output = _length_range(args.output_tokens, "--output-tokens")
    fleet = FleetSpec(
        replicas=replicas,
        unit_tokens=1,
        hbm_units_per_replica=0,
        prefill_tokens_per_second=args.prefill_tps,
        decode_tokens_per_second=args.decode_tps,
    )
    # Requests/s the fleet serves with every slot busy, for the mean request.
    seconds = sum(prompt) / 2 / args.prefill_tps + sum(output) / 2 / args.decode_tps
    capacity_rps = replicas * args.slots_per_replica / seconds
    rows = _fair_tenants(args)
    tenants = [FairTenant(name, sla, weight) for name, sla, weight, _ in rows]
    rates = {name: load * capacity_rps for name, _, _, load in rows}
    requests = build_fair_workload(rates, args.duration, prompt, output, seed=args.seed)
    warmup = min(args.warmup, args.duration / 2)
    results = [
        simulate_fair_queuing(
            requests,
            fleet,
            tenants,
            slots_per_replica=args.slots_per_replica,
            fair=mode == "vtc",
            cost=TokenCost(),
            warmup_seconds=warmup,
            max_wait_s=args.fair_max_wait,
        )
        for mode in modes
    ]
    if args.output == "json":
        doc = {
            "replicas": replicas,
            "slots_per_replica": args.slots_per_replica,
            "capacity_requests_per_s": capacity_rps,
            "requests": len(requests),
            "tenants": [
                {"name": n, "sla": s.value, "weight": w, "load": load, "requests_per_s": rates[n]}
                for n, s, w, load in rows
            ],
            "results": [r.as_dict() for r in results],
        }
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(render_fair_table(replicas, args.slots_per_replica, capacity_rps, len(requests), results))
    return 0


def render_fair_table(
    replicas: int, slots: int, capacity_rps: float, requests: int, results: list[FairQueuingResult]
) -> str:
    lines = [
        f"fleet: {replicas} replica(s) x {slots} slots, about {capacity_rps:,.0f} requests/s; "
        f"{requests:,} requests",
        "",
    ]
    for r in results:
        lines.append(
            f"fair queuing {r.mode}: Jain (weighted service) {r.jain_weighted_service:.3f}, "
            f"Jain (vs weighted max-min fair share) {r.jain_fair_share:.3f}"
        )
        lines.append(
            f"{'tenant':<12} {'weight':>6} {'tok/s':>9} {'wtok/s':>9} {'share':>9} {'ttft50':>8} "
            f"{'ttft99':>8} {'served':>7} {'refused':>7}"
        )
        for t in r.tenants.values():
            lines.append(
                f"{t.tenant:<12} {t.weight:>6g} {t.tokens_per_s:>9,.0f} {t.weighted_tokens_per_s:>9,.0f} "
                f"{t.fair_share_weighted_tokens_per_s:>9,.0f} {t.ttft_p50_ms:>6.0f}ms "
                f"{t.ttft_p99_ms:>6.0f}ms {t.served:>7} {t.refused:>7}"
            )
        lines.append("")
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    if args.fair_queuing:
        try:
            return run_fair_queuing(args, out)
        except (SimulateError, ValueError) as exc:
            print(f"kvfleet simulate: error: {exc}", file=err)
            return EXIT_BAD_INPUT
    try:
        policies = parse_policies(args.policy)
        routing = RoutingSpec(args.routing, affinity_tokens=args.affinity_tokens)
        fleet = build_fleet_spec(args)
        specs, loads = build_tenants(args)
        requests = build_workload(args, loads)
    except (SimulateError, SizingError, ValueError) as exc:
        message = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        print(f"kvfleet simulate: error: {message}", file=err)
        return EXIT_BAD_INPUT
    warmup = 0.0 if args.trace or args.workload == "multi-round-qa" else args.warmup
    results = [
        simulate(
            requests,
            fleet,
            POLICIES[name],
            specs,
            warmup_seconds=warmup,
            sample_seconds=args.sample_seconds,
            routing=routing,
        )
        for name in policies
    ]
    if args.plot:
        # Imported here: matplotlib takes a while to import and every kvfleet command loads this module.
        from kvfleet_runtime.kv.plot import write_charts  # noqa: PLC0415

        for path in write_charts(results, args.plot):
            print(f"wrote {path}", file=err)
    if args.output == "json":
        doc = {
            "fleet": {k: getattr(fleet, k) for k in fleet.__slots__},
            "requests": len(requests),
            "results": [r.as_dict() for r in results],
        }
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(render_table(fleet, len(requests), results))
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def render_table(fleet: FleetSpec, requests: int, results: list[SimulationResult]) -> str:
    """One block per policy: a row per tenant and a total."""
    unit = fleet.unit_tokens
    lines = [
        f"fleet: {fleet.replicas} replica(s); per replica HBM {fleet.hbm_units_per_replica * unit:,} "
        f"tokens, CPU {fleet.cpu_units_per_replica * unit:,}, NVMe "
        f"{fleet.nvme_units_per_replica * unit:,}; {requests:,} requests",
        "",
    ]
    header = (
        f"{'tenant':<14} {'reqs':>7} {'hit':>6} {'hbm':>6} {'cpu':>6} {'nvme':>6} {'recomp':>6} "
        f"{'ttft50':>8} {'ttft99':>8}  evictions (tier:reason=n)"
    )
    for result in results:
        lines.append(f"policy {result.policy}: {POLICIES[result.policy].description}")
        placed = ", ".join(f"{how} {n:,}" for how, n in sorted(result.route_decisions.items()))
        lines.append(f"requests placed by: {placed or 'none measured'}")
        lines.append(header)
        for report in [*result.tenants.values(), result.total]:
            prompt = report.prompt_tokens or 1
            ev = " ".join(
                f"{tier}:{reason}={n}"
                for tier, reasons in sorted(report.evictions.items())
                for reason, n in sorted(reasons.items())
            )
            lines.append(
                f"{report.tenant:<14} {report.requests:>7} {_pct(report.hit_rate)} "
                f"{_pct(report.hit_tokens['hbm'] / prompt)} {_pct(report.hit_tokens['cpu'] / prompt)} "
                f"{_pct(report.hit_tokens['nvme'] / prompt)} {_pct(report.recompute_rate)} "
                f"{report.ttft_p50_ms:7.0f}ms {report.ttft_p99_ms:7.0f}ms  {ev}"
            )
        lines.append("")
    return "\n".join(lines)
