"""Measure where a prompt's KV comes from and what it costs: ``kvfleet engine bench-restore``.

Starts a real LMCache server (L1 CPU + ``fs`` L2) and a real vLLM with a small KV cache connected to it,
then times the same kind of prompt in four states, each ``rounds`` times with fresh prompts:

* ``cold``: never seen; full prefill.
* ``hbm``: repeated at once; vLLM's own prefix cache.
* ``cpu``: evicted from vLLM by filler prompts; restored from LMCache L1.
* ``nvme``: additionally L1 cleared (``POST /cache/clear``); restored from the L2 (disk) tier.

Time-to-first-token is measured as the latency of a ``max_tokens=1`` completion on an idle server. The
pure part (``summarize``) turns samples into p50/mean rows; the rest is process plumbing.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_runtime.config import EngineSettings, LMCacheSettings
from kvfleet_runtime.engine.launcher import (
    GIB,
    EngineProcess,
    EngineReplica,
    build_lmcache_args,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
    remove_stale_lmcache_shm,
)
from kvfleet_runtime.engine.tinymodel import TinyModelSpec

STATES = ("cold", "hbm", "cpu", "nvme")
_WORDS = ("tenant", "cache", "prompt", "system", "quota", "memory", "tier", "engine", "policy", "block")


@dataclass(frozen=True)
class Sample:
    state: str
    seconds: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Row:
    state: str
    n: int
    p50_ms: float
    mean_ms: float
    cached_fraction: float


def summarize(samples: Sequence[Sample]) -> list[Row]:
    """One row per state, in ``STATES`` order (states without samples are left out)."""
    rows = []
    for state in STATES:
        mine = [s for s in samples if s.state == state]
        if not mine:
            continue
        ms = [s.seconds * 1000 for s in mine]
        cached = sum(s.cached_tokens for s in mine) / max(1, sum(s.prompt_tokens for s in mine))
        rows.append(Row(state, len(mine), statistics.median(ms), statistics.fmean(ms), cached))
    return rows


def render_markdown(rows: Sequence[Row]) -> str:
    lines = ["| KV source | n | TTFT p50 (ms) | TTFT mean (ms) | cached tokens |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.state} | {r.n} | {r.p50_ms:.0f} | {r.mean_ms:.0f} | {r.cached_fraction:.1%} |")
    return "\n".join(lines)


def _prompt(seed: int, n_words: int) -> str:
    rng = random.Random(seed)  # noqa: S311 - reproducible prompts, not secrets
    return f"Doc {seed}: " + " ".join(f"{rng.choice(_WORDS)}{rng.randint(0, 99)}" for _ in range(n_words))


def _http(method: str, url: str, body: Mapping[str, Any] | None = None) -> Any:
    """A JSON request to one of the loopback servers this module started."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)  # noqa: S310 - http only
    with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 - loopback servers we started
        raw = resp.read()
    return json.loads(raw) if raw else None


def run_bench(
    complete: Callable[[str, str], tuple[float, int, int]],
    clear_l1: Callable[[], None],
    put_quota: Callable[[str, int], None],
    *,
    rounds: int,
    n_words: int,
) -> list[Sample]:
    """The measurement protocol over a ``complete(prompt, salt) -> (seconds, prompt, cached)`` call."""
    salt = "bench"
    put_quota(salt, 1 << 30)
    put_quota("filler", 1 << 20)
    seed = 10_000
    samples: list[Sample] = []

    def flush() -> None:
        nonlocal seed
        for _ in range(2):
            seed += 1
            complete(_prompt(seed, n_words), "filler")

    complete(_prompt(1, 20), salt)  # warm-up
    for _ in range(rounds):
        seed += 1
        prompt = _prompt(seed, n_words)
        for state in STATES:
            if state == "cpu":
                flush()
                time.sleep(1.5)  # let LMCache finish storing the chunks
            if state == "nvme":
                flush()
                clear_l1()
            t, n, cached = complete(prompt, salt)
            samples.append(Sample(state, t, n, cached))
    return samples


def main_bench(model: str, rounds: int, n_words: int, out: Path | None) -> str:
    """Start the servers, run the protocol, stop everything; returns the markdown table."""
    work = Path(tempfile.mkdtemp(prefix="kvfleet-restore-bench-"))
    lmc = LMCacheSettings(
        port=_free_port(), http_port=_free_port(), cpu_bytes=GIB // 2, nvme_path=str(work / "nvme")
    )
    (work / "nvme").mkdir()
    blocks = 64
    vllm = EngineReplica(
        EngineSettings(
            model=model,
            port=_free_port(),
            num_gpu_blocks_override=blocks,
            max_model_len=compute_max_model_len(blocks, 32, TinyModelSpec().max_position_embeddings),
            lmcache=lmc,
            extra_args=["--enforce-eager"],
        ),
        served_model_name="tiny",
        block_size=32,
    )
    procs: list[EngineProcess] = []
    ok = False
    try:
        p = EngineProcess(
            "lmcache", build_lmcache_args(lmc), {**os.environ, "TMPDIR": str(work)}, work / "lmc.log"
        )
        procs.append(p)
        p.wait_ready(f"http://127.0.0.1:{lmc.http_port}/healthcheck", 600)
        p = EngineProcess(
            "vllm", build_vllm_args(vllm), build_vllm_env(vllm, os.environ, work), work / "vllm.log"
        )
        procs.append(p)
        p.wait_ready(f"{vllm.vllm_url}/health", 900)
        base, lbase = vllm.vllm_url, f"http://127.0.0.1:{lmc.http_port}"

        def complete(prompt: str, salt: str) -> tuple[float, int, int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
            start = time.perf_counter()
            usage = _http("POST", base + "/v1/completions", body)["usage"]
            return (
                time.perf_counter() - start,
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
            )

        def put_quota(salt: str, n_bytes: int) -> None:
            _http("PUT", f"{lbase}/quota/{salt}", {"limit_gb": n_bytes / (1 << 30)})

        samples = run_bench(
            complete,
            lambda: _http("POST", lbase + "/cache/clear", {}),
            put_quota,
            rounds=rounds,
            n_words=n_words,
        )
        ok = True
    finally:
        for proc in reversed(procs):
            proc.stop()
        remove_stale_lmcache_shm()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}", file=sys.stderr)
    table = render_markdown(summarize(samples))
    if out is not None:
        out.write_text(json.dumps([s.__dict__ for s in samples], indent=1) + "\n")
    return table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    print(main_bench(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5, 700, None))
