"""The pure half of kvfleet_runtime.engine.launcher: config models -> vLLM/LMCache command lines.

The tables below name every field of ``EngineSettings`` and ``LMCacheSettings``; a test fails when a field
is added without a flag (or without a reason it has none), so a setting the operator renders cannot be
dropped on the way to vLLM or LMCache (as ``chunk_size`` once was).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine_fixtures import TINY_MODEL_DEPLOYMENT, load_manifest, render_engine
from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import (
    DEFAULT_LMCACHE_CHUNK_TOKENS,
    ENGINE_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    EngineSettings,
    LMCacheSettings,
    SlaTier,
    TenantTable,
)
from kvfleet_runtime.engine.cli import resolve_launch
from kvfleet_runtime.engine.launcher import (
    GIB,
    MIN_L1_BYTES,
    EngineReplica,
    ReplicaSite,
    build_kv_transfer_config,
    build_lmcache_args,
    build_plugin_env,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
    read_model_max_len,
    resolve_replica,
)
from kvfleet_runtime.engine.restore_bench import Sample, render_markdown, summarize


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _has_run(args: list[str], run: list[str]) -> bool:
    """``run`` appears in ``args`` as consecutive items."""
    return any(args[i : i + len(run)] == run for i in range(len(args) - len(run) + 1))


def _replica(**engine: Any) -> EngineReplica:
    return EngineReplica(EngineSettings(**{"model": "/m", **engine}), served_model_name="tiny", block_size=32)


# --- every field reaches a flag ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldCase:
    """Setting the field ``name`` to ``value`` (on top of ``base``) makes ``check(argv)`` true, and its
    default does not."""

    name: str
    value: Any
    check: Callable[[list[str]], bool]
    base: dict[str, Any] = field(default_factory=dict)


def _run(*run: str) -> Callable[[list[str]], bool]:
    return lambda argv: _has_run(argv, list(run))


def _kv_transfer_port(port: int) -> Callable[[list[str]], bool]:
    def check(argv: list[str]) -> bool:
        if "--kv-transfer-config" not in argv:
            return False
        extra = json.loads(_flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
        return bool(extra["lmcache.mp.port"] == port)

    return check


def _resp_adapter(key: str, expected: Any) -> Callable[[list[str]], bool]:
    """The shared KV tier's ``resp`` L2 adapter carries ``key`` = ``expected``."""

    def check(argv: list[str]) -> bool:
        adapters = [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--l2-adapter"]
        return any(a["type"] == "resp" and a[key] == expected for a in adapters)

    return check


def _kv_events_port(port: int) -> Callable[[list[str]], bool]:
    def check(argv: list[str]) -> bool:
        if "--kv-events-config" not in argv:
            return False
        config = json.loads(_flag(argv, "--kv-events-config"))
        return bool(config["enable_kv_cache_events"] and config["endpoint"] == f"tcp://*:{port}")

    return check


def _l2_adapter(key: str, expected: Any) -> Callable[[list[str]], bool]:
    def check(argv: list[str]) -> bool:
        if "--l2-adapter" not in argv:
            return False
        adapter = json.loads(_flag(argv, "--l2-adapter"))
        value = adapter["eviction"][key] if key == "eviction_policy" else adapter[key]
        return bool(value == expected)

    return check


ENGINE_FIELD_CASES = [
    FieldCase("model", "/models/other", _run("--model", "/models/other")),
    FieldCase("revision", "abc123", _run("--revision", "abc123")),
    FieldCase("tensor_parallel_size", 2, _run("--tensor-parallel-size", "2")),
    FieldCase("pipeline_parallel_size", 3, _run("--pipeline-parallel-size", "3")),
    FieldCase("data_parallel_size", 4, _run("--data-parallel-size", "4")),
    FieldCase("enable_expert_parallel", True, _run("--enable-expert-parallel")),
    FieldCase("max_model_len", 4096, _run("--max-model-len", "4096")),
    FieldCase("gpu_memory_utilization", 0.75, _run("--gpu-memory-utilization", "0.75")),
    FieldCase("kv_cache_dtype", "fp8_e5m2", _run("--kv-cache-dtype", "fp8_e5m2")),
    FieldCase("enable_prefix_caching", False, _run("--no-enable-prefix-caching")),
    FieldCase("enable_chunked_prefill", False, _run("--no-enable-chunked-prefill")),
    FieldCase("max_num_batched_tokens", 8192, _run("--max-num-batched-tokens", "8192")),
    FieldCase("scheduling_policy", "fcfs", _run("--scheduling-policy", "fcfs")),
    FieldCase("num_gpu_blocks_override", 77, _run("--num-gpu-blocks-override", "77")),
    FieldCase("extra_args", ["--max-num-seqs", "3"], lambda argv: argv[-2:] == ["--max-num-seqs", "3"]),
    FieldCase("port", 9123, _run("--port", "9123")),
    FieldCase("kv_events_port", 5558, _kv_events_port(5558)),
    FieldCase("lmcache", LMCacheSettings(cpu_bytes=GIB, port=5601), _kv_transfer_port(5601)),
]
#: Fields that are deliberately no vLLM flag, and who reads them instead.
ENGINE_FIELDS_WITHOUT_FLAG = {"plugin_metrics_port": "the engine plugin reads it from the tenant table"}

LMCACHE_FIELD_CASES = [
    FieldCase("cpu_bytes", 3 * GIB, _run("--l1-size-gb", "3")),
    FieldCase("nvme_path", "/nvme", _l2_adapter("base_path", "/nvme")),
    FieldCase("chunk_size", 128, _run("--chunk-size", "128")),
    FieldCase("eviction_policy", "LRU", _l2_adapter("eviction_policy", "LRU"), base={"nvme_path": "/n"}),
    FieldCase("port", 5601, _run("--port", "5601")),
    FieldCase("http_port", 5602, _run("--http-port", "5602")),
    FieldCase("shared_host", "tier.ns.svc", _resp_adapter("host", "tier.ns.svc")),
    FieldCase("shared_port", 7000, _resp_adapter("port", 7000), base={"shared_host": "tier"}),
]
LMCACHE_FIELDS_WITHOUT_FLAG = {
    "nvme_bytes": "LMCache's fs L2 adapter has no capacity; the quota sync bounds it"
}


def test_every_engine_settings_field_has_a_flag_or_a_reason() -> None:
    covered = {c.name for c in ENGINE_FIELD_CASES} | set(ENGINE_FIELDS_WITHOUT_FLAG)
    assert covered == set(EngineSettings.model_fields)


def test_every_lmcache_settings_field_has_a_flag_or_a_reason() -> None:
    covered = {c.name for c in LMCACHE_FIELD_CASES} | set(LMCACHE_FIELDS_WITHOUT_FLAG)
    assert covered == set(LMCacheSettings.model_fields)


@pytest.mark.parametrize("case", ENGINE_FIELD_CASES, ids=lambda c: c.name)
def test_engine_settings_field_reaches_vllm_argv(case: FieldCase) -> None:
    assert not case.check(build_vllm_args(_replica(**case.base)))
    assert case.check(build_vllm_args(_replica(**case.base, **{case.name: case.value})))


@pytest.mark.parametrize("case", LMCACHE_FIELD_CASES, ids=lambda c: c.name)
def test_lmcache_settings_field_reaches_lmcache_argv(case: FieldCase) -> None:
    base = {"cpu_bytes": GIB, **case.base}
    assert not case.check(build_lmcache_args(LMCacheSettings(**base)))
    assert case.check(build_lmcache_args(LMCacheSettings(**{**base, case.name: case.value})))


def test_replica_names_and_site_reach_argv_and_env(tmp_path: Path) -> None:
    site = ReplicaSite(host="0.0.0.0", cpu_kv_cache_gib=2, env={"X": "1"})
    replica = EngineReplica(
        EngineSettings(model="/m"), served_model_name="tiny-llama", block_size=64, site=site
    )
    argv = build_vllm_args(replica, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--served-model-name") == "tiny-llama"
    assert _flag(argv, "--block-size") == "64"
    assert _flag(argv, "--host") == "0.0.0.0"
    assert "--enable-prompt-tokens-details" in argv  # the gateway reads cached tokens from usage
    env = build_vllm_env(replica, {"PATH": "/bin"}, tmp_path)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["X"] == "1" and env["PATH"] == "/bin"
    for name in ("VLLM_CACHE_ROOT", "HF_HOME", "TMPDIR"):
        assert Path(env[name]).is_dir() and Path(env[name]).is_relative_to(tmp_path)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_vllm_env(
        EngineReplica(replica.engine, "t", 32, ReplicaSite(cpu_kv_cache_gib=None)), {}
    )


def test_defaults_are_vllms_and_lmcaches_defaults_and_the_pod_ports() -> None:
    argv = build_vllm_args(_replica())
    assert _flag(argv, "--port") == str(ENGINE_PORT)
    assert _flag(argv, "--scheduling-policy") == "priority"
    assert _flag(argv, "--gpu-memory-utilization") == "0.9"
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert "--kv-transfer-config" not in argv and "--tensor-parallel-size" not in argv
    lmc = build_lmcache_args(LMCacheSettings(cpu_bytes=GIB // 4), python="py")
    assert lmc[:4] == ["py", "-m", "kvfleet_runtime.engine.lmcache_server", "server"]
    assert (_flag(lmc, "--port"), _flag(lmc, "--http-port")) == (str(LMCACHE_PORT), str(LMCACHE_HTTP_PORT))
    assert _flag(lmc, "--chunk-size") == str(DEFAULT_LMCACHE_CHUNK_TOKENS)
    assert _flag(lmc, "--l1-size-gb") == "0.25"
    assert _flag(lmc, "--eviction-policy") == "LRU"  # L1 cannot run IsolatedLRU
    assert "--l2-adapter" not in lmc
    adapter = json.loads(
        _flag(build_lmcache_args(LMCacheSettings(cpu_bytes=GIB, nvme_path="/n")), "--l2-adapter")
    )
    assert adapter == {
        "type": "fs",
        "base_path": "/n",
        "eviction": {"eviction_policy": "IsolatedLRU", "trigger_watermark": 1.0, "eviction_ratio": 0.2},
    }


def test_vllm_connects_lmcache_in_lmcache_driven_mode() -> None:
    lmc = LMCacheSettings(cpu_bytes=GIB, port=5600)
    config = json.loads(_flag(build_vllm_args(_replica(lmcache=lmc)), "--kv-transfer-config"))
    assert config == build_kv_transfer_config(lmc, "127.0.0.1")
    assert config["kv_connector"] == "LMCacheMPConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["lmcache.mp.port"] == 5600
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1"
    assert extra["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"


def test_block_size_must_be_a_multiple_of_32_on_the_cpu_build_only() -> None:
    """vLLM's CPU attention backend refuses other sizes; GPU builds take 16 (the CRD's default)."""
    with pytest.raises(ValueError, match="multiple of 32 on vLLM's CPU build"):
        EngineReplica(EngineSettings(model="/m"), served_model_name="t", block_size=16)
    gpu = EngineReplica(EngineSettings(model="/m"), "t", 16, ReplicaSite(cpu_kv_cache_gib=None))
    assert _flag(build_vllm_args(gpu), "--block-size") == "16"
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_vllm_env(gpu, {})
    with pytest.raises(ValueError, match="positive"):
        EngineReplica(EngineSettings(model="/m"), "t", 0, ReplicaSite(cpu_kv_cache_gib=None))


@pytest.mark.parametrize("gib", [0, -1, 1.5, True])
def test_cpu_kv_space_is_a_whole_number_of_gib(gib: Any) -> None:
    """vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer: 1.5 would stop it at start-up."""
    with pytest.raises(ValueError, match="whole number of GiB"):
        ReplicaSite(cpu_kv_cache_gib=gib)


def test_max_model_len_fits_the_block_override() -> None:
    assert compute_max_model_len(64, 32, 8192) == 63 * 32
    assert compute_max_model_len(10_000, 32, 8192) == 8192
    assert compute_max_model_len(1, 32, 8192) == 32


# --- resolve_replica: the one place the table meets the launching process ----------------------------------


def _table(engine: EngineSettings | None, *, blocks: int = 500) -> TenantTable:
    t = tenant_entry("a", tier=SlaTier.BASIC, priority=20, salt_id="a", pool="p", hbm=1, hbm_burst=2)
    pool = pool_entry("p", block_size=64, hbm_blocks=blocks, engine=engine)
    return tenant_table(t, pools=[pool], pool_salt_id="x")


@dataclass(frozen=True)
class ResolveCase:
    name: str
    engine: EngineSettings | None
    kwargs: dict[str, Any]
    expect: dict[str, Any]  # attribute path on the replica -> value
    blocks: int = 500


_LMC = LMCacheSettings(cpu_bytes=2 * GIB, nvme_bytes=8 * GIB, nvme_path="/var/nvme", chunk_size=128)

RESOLVE_CASES = [
    ResolveCase(
        "table values",
        EngineSettings(model="/models/m", lmcache=_LMC),
        {},
        {
            "served_model_name": "m",
            "block_size": 64,
            "engine.model": "/models/m",
            "engine.port": ENGINE_PORT,
            # The pool's 500 blocks are not forced onto vLLM: it sizes its own cache.
            "engine.num_gpu_blocks_override": None,
            "engine.max_model_len": None,
            "engine.lmcache": _LMC,
        },
    ),
    ResolveCase(
        "launcher overrides",
        EngineSettings(model="/models/m", extra_args=["--a"], lmcache=_LMC),
        {
            "model": "/local/m",
            "vllm_port": 1,
            "lmcache_port": 2,
            "lmcache_http_port": 3,
            "nvme_dir": "/tmp/n",
            "extra_vllm_args": ["--b"],
        },
        {
            "engine.model": "/local/m",
            "engine.port": 1,
            "engine.lmcache.port": 2,
            "engine.lmcache.http_port": 3,
            "engine.lmcache.nvme_path": "/tmp/n",
            "engine.lmcache.chunk_size": 128,
            "engine.extra_args": ["--a", "--b"],
            "lmcache_url": "http://127.0.0.1:3",
            "vllm_url": "http://127.0.0.1:1",
        },
    ),
    ResolveCase(
        "no NVMe tier: nvme_dir is ignored",
        EngineSettings(model="/m", lmcache=LMCacheSettings(cpu_bytes=GIB)),
        {"nvme_dir": "/tmp/n"},
        {"engine.lmcache.nvme_path": None},
    ),
    ResolveCase(
        "an NVMe-only pool still gets a small L1",
        EngineSettings(model="/m", lmcache=LMCacheSettings(cpu_bytes=1, nvme_path="/n")),
        {},
        {"engine.lmcache.cpu_bytes": MIN_L1_BYTES},
    ),
    ResolveCase("no lmcache section: no LMCache", EngineSettings(model="/m"), {}, {"lmcache_url": None}),
    ResolveCase(
        "an explicit block override (tests, tiny demo caches) reaches vLLM",
        EngineSettings(model="/m", num_gpu_blocks_override=64),
        {},
        {"engine.num_gpu_blocks_override": 64},
    ),
    ResolveCase(
        "a pool sized to 0 blocks leaves vLLM to size its cache",
        EngineSettings(model="/m"),
        {},
        {"engine.num_gpu_blocks_override": None},
        blocks=0,
    ),
    ResolveCase(
        "max_model_len capped to the cache and the model",
        EngineSettings(model="/m"),
        {"model_limit_of": lambda _m: 100_000},
        {"engine.max_model_len": 499 * 64},
    ),
    ResolveCase(
        "max_model_len capped to an explicit override's cache",
        EngineSettings(model="/m", num_gpu_blocks_override=10),
        {"model_limit_of": lambda _m: 100_000},
        {"engine.max_model_len": 9 * 64, "engine.num_gpu_blocks_override": 10},
    ),
    ResolveCase(
        "max_model_len: the table's when smaller",
        EngineSettings(model="/m", max_model_len=4096),
        {"model_limit_of": lambda _m: 100_000},
        {"engine.max_model_len": 4096},
    ),
    ResolveCase(
        "no engine settings: the given model with vLLM's defaults",
        None,
        {"model": "/local/m"},
        {"engine.model": "/local/m", "engine.lmcache": None, "engine.num_gpu_blocks_override": None},
    ),
]


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("case", RESOLVE_CASES, ids=lambda c: c.name)
def test_resolve_replica(case: ResolveCase) -> None:
    replica = resolve_replica(_table(case.engine, blocks=case.blocks), "p", **case.kwargs)
    assert {path: _get(replica, path) for path in case.expect} == case.expect


def test_resolve_replica_refuses_what_it_cannot_launch() -> None:
    with pytest.raises(ValueError, match="not one of the table's pools"):
        resolve_replica(_table(EngineSettings(model="/m")), "q")
    with pytest.raises(ValueError, match="no engine settings"):
        resolve_replica(_table(None), "p")


# --- spec.kvCache.chunkSize reaches LMCache ----------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [64, 128, 512])
def test_model_deployment_chunk_size_reaches_lmcache_argv(chunk_size: int) -> None:
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["kvCache"]["chunkSize"] = chunk_size
    rendered = render_engine(doc)
    table, command = rendered.table, rendered.command
    assert command[:3] == ["kvfleet", "engine", "launch"]
    # The pod's own command line, parsed by the real `kvfleet` parser, resolved as `engine launch` does.
    args = build_parser().parse_args(command[1:])
    _, replica = resolve_launch(args, table)
    assert replica.engine.lmcache is not None
    argv = build_lmcache_args(replica.engine.lmcache, replica.site.host)
    assert _flag(argv, "--chunk-size") == str(chunk_size)
    assert _flag(argv, "--http-port") == str(LMCACHE_HTTP_PORT)  # the pod's port, from the command line
    assert _flag(argv, "--l1-size-gb") == "0.25"  # the example's cpuSize: 256Mi
    vllm = build_vllm_args(replica)
    assert _flag(vllm, "--gpu-memory-utilization") == "0.5"  # the example's gpuMemoryUtilization
    assert _flag(vllm, "--served-model-name") == "tiny-llama"
    extra = json.loads(_flag(vllm, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert str(extra["lmcache.mp.port"]) == _flag(argv, "--port")  # vLLM dials the LMCache it starts


@pytest.mark.parametrize("space", ["1Gi", "3Gi"])
def test_model_deployment_cpu_kv_space_reaches_vllm_env(space: str) -> None:
    """The known bug: the pod command never passed spec.pool.cpuKvCacheSpace, so every CPU engine ran with
    the launcher's 1 GiB whatever the operator had sized quotas against."""
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["pool"]["cpuKvCacheSpace"] = space
    rendered = render_engine(doc)
    _, replica = resolve_launch(build_parser().parse_args(rendered.command[1:]), rendered.table)
    assert build_vllm_env(replica, {})["VLLM_CPU_KVCACHE_SPACE"] == space.removesuffix("Gi")


def test_gpu_model_deployment_launches_the_gpu_build_with_block_size_16() -> None:
    """A GPU pool (blockSize 16, the CRD's default) resolves through the pod's real command line: no
    CPU KV space, and the block size the CPU build would refuse is passed to vLLM."""
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["pool"] = {"replicas": 1, "gpusPerReplica": 1, "gpuMemory": "24Gi"}
    doc["spec"]["engine"]["blockSize"] = 16
    rendered = render_engine(doc)
    assert "--gpu" in rendered.command and "--cpu-kv-gib" not in rendered.command
    _, replica = resolve_launch(build_parser().parse_args(rendered.command[1:]), rendered.table)
    assert not replica.site.is_cpu_build
    assert _flag(build_vllm_args(replica), "--block-size") == "16"
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_vllm_env(replica, {})


def test_model_deployment_without_offload_tiers_runs_no_lmcache() -> None:
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["kvCache"]["cpuSize"] = "0"
    rendered = render_engine(doc)
    _, replica = resolve_launch(build_parser().parse_args(rendered.command[1:]), rendered.table)
    assert replica.engine.lmcache is None and replica.lmcache_url is None
    assert "--kv-transfer-config" not in build_vllm_args(replica)


# --- the rest of the launcher's pure half ------------------------------------------------------------------


def test_read_model_max_len(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert read_model_max_len(str(tmp_path)) == 4096
    assert read_model_max_len(str(tmp_path / "missing")) is None


def test_plugin_env() -> None:
    env = build_plugin_env(Path("/c/tenants.json"), Path("/k/keys.json"), "shared", 8001)
    assert env == {
        "KVFLEET_TENANT_TABLE": "/c/tenants.json",
        "KVFLEET_KEY_FILE": "/k/keys.json",
        "KVFLEET_POOL": "shared",
        "KVFLEET_PLUGIN_METRICS_PORT": "8001",
    }
    assert "KVFLEET_PLUGIN_METRICS_PORT" not in build_plugin_env(Path("/c"), Path("/k"), "shared")


def test_restore_bench_summary_orders_states_and_counts_cached_tokens() -> None:
    samples = [
        Sample("cpu", 0.02, 100, 96),
        Sample("cold", 0.10, 100, 0),
        Sample("cold", 0.30, 100, 0),
        Sample("hbm", 0.01, 100, 96),
    ]
    rows = summarize(samples)
    assert [r.state for r in rows] == ["cold", "hbm", "cpu"]
    assert rows[0].p50_ms == 200.0 and rows[0].cached_fraction == 0.0
    assert rows[1].cached_fraction == 0.96
    assert "| cold | 2 | 200 |" in render_markdown(rows)
