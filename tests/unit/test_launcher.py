"""The pure command-line builders of kvfleet_runtime.engine.launcher."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvfleet_runtime.config import (
    EngineSettings,
    Isolation,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
)
from kvfleet_runtime.engine.launcher import (
    LMCacheConnection,
    LMCacheSettings,
    VllmSettings,
    build_kv_transfer_config,
    build_lmcache_args,
    build_plugin_env,
    build_pool_engine_settings,
    build_vllm_args,
    build_vllm_env,
    compute_max_model_len,
    read_model_max_len,
    remove_stale_lmcache_shm,
)
from kvfleet_runtime.engine.restore_bench import Sample, render_markdown, summarize


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_vllm_args_carry_the_flags_the_tests_rely_on() -> None:
    s = VllmSettings(
        model="/m", port=9000, served_model_name="tiny", num_gpu_blocks_override=64, max_model_len=2016
    )
    args = build_vllm_args(s, python="py")
    assert args[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(args, "--block-size") == "32"
    assert _flag(args, "--scheduling-policy") == "priority"
    assert _flag(args, "--num-gpu-blocks-override") == "64"
    assert _flag(args, "--max-model-len") == "2016"
    assert _flag(args, "--host") == "127.0.0.1"
    assert "--enable-prefix-caching" in args
    assert "--enable-prompt-tokens-details" in args
    assert "--kv-transfer-config" not in args


def test_vllm_args_connect_lmcache_in_lmcache_driven_mode() -> None:
    s = VllmSettings(model="/m", port=1, lmcache=LMCacheConnection("127.0.0.1", 5600))
    config = json.loads(_flag(build_vllm_args(s), "--kv-transfer-config"))
    assert config == build_kv_transfer_config(LMCacheConnection("127.0.0.1", 5600))
    assert config["kv_connector"] == "LMCacheMPConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["lmcache.mp.port"] == 5600
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1"
    assert extra["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"


def test_block_size_must_be_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmSettings(model="/m", port=1, block_size=16)


def test_vllm_env_isolates_caches(tmp_path: Path) -> None:
    s = VllmSettings(model="/m", port=1, cpu_kv_cache_gib=0.5, extra_env={"X": "1"})
    env = build_vllm_env(s, {"PATH": "/bin"}, tmp_path)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "0.5"
    for name in ("VLLM_CACHE_ROOT", "HF_HOME", "TMPDIR"):
        assert Path(env[name]).is_dir() and Path(env[name]).is_relative_to(tmp_path)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["X"] == "1" and env["PATH"] == "/bin"


def test_max_model_len_fits_the_block_override() -> None:
    assert compute_max_model_len(64, 32, 8192) == 63 * 32
    assert compute_max_model_len(10_000, 32, 8192) == 8192
    assert compute_max_model_len(1, 32, 8192) == 32


def test_lmcache_args_cpu_lru_and_nvme_isolated_lru() -> None:
    s = LMCacheSettings(port=5555, http_port=8080, cpu_size_gb=0.25, nvme_dir="/nvme")
    args = build_lmcache_args(s, python="py")
    assert args[:4] == ["py", "-m", "kvfleet_runtime.engine.lmcache_server", "server"]
    assert _flag(args, "--eviction-policy") == "LRU"  # L1 cannot run IsolatedLRU
    assert _flag(args, "--l1-size-gb") == "0.25"
    assert _flag(args, "--http-port") == "8080"
    adapter = json.loads(_flag(args, "--l2-adapter"))
    assert adapter["type"] == "fs" and adapter["base_path"] == "/nvme"
    assert adapter["eviction"]["eviction_policy"] == "IsolatedLRU"
    assert "--l2-adapter" not in build_lmcache_args(LMCacheSettings(port=1, http_port=2))


def _table(cpu: int, nvme: int) -> TenantTable:
    t = TenantEntry(
        name="a",
        tier=SlaTier.BASIC,
        priority=20,
        isolation=Isolation.SALTED,
        salt_id="a",
        pool="p",
        models=["m"],
        quota=KVQuota(hbm_blocks=1, hbm_burst_blocks=2),
    )
    pool = PoolEntry(
        name="p",
        block_size=64,
        hbm_blocks_per_replica=500,
        cpu_bytes_per_replica=cpu,
        nvme_bytes_per_replica=nvme,
    )
    return TenantTable(
        model_deployment="ns/m", served_model_name="m", pool_salt_id="x", pools={"p": pool}, tenants={"a": t}
    )


def test_pool_settings_follow_the_tenant_table() -> None:
    vllm, lmc = build_pool_engine_settings(
        _table(2 << 30, 8 << 30),
        "p",
        model="/m",
        vllm_port=1,
        lmcache_port=2,
        lmcache_http_port=3,
        nvme_dir="/n",
    )
    assert vllm.block_size == 64 and vllm.num_gpu_blocks_override == 500 and vllm.served_model_name == "m"
    assert lmc is not None and lmc.cpu_size_gb == 2.0 and lmc.nvme_dir == "/n"
    assert vllm.lmcache == LMCacheConnection("127.0.0.1", 2)
    assert vllm.max_model_len is None
    vllm, _ = build_pool_engine_settings(
        _table(0, 0),
        "p",
        model="/m",
        vllm_port=1,
        lmcache_port=2,
        lmcache_http_port=3,
        nvme_dir=None,
        model_max_len=8192,
    )
    assert vllm.max_model_len == 8192  # 499 usable blocks x 64 tokens > 8192
    vllm, lmc = build_pool_engine_settings(
        _table(0, 0), "p", model="/m", vllm_port=1, lmcache_port=2, lmcache_http_port=3, nvme_dir="/n"
    )
    assert lmc is None and vllm.lmcache is None


def test_read_model_max_len(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert read_model_max_len(str(tmp_path)) == 4096
    assert read_model_max_len(str(tmp_path / "missing")) is None


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


def test_stale_lmcache_shm_files_of_dead_workers_are_removed(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()
    (tmp_path / f"lmcache_kv_{finished.pid}_0").write_bytes(b"x")
    (tmp_path / f"lmcache_kv_{os.getpid()}_0").write_bytes(b"x")
    (tmp_path / "psm_abc").write_bytes(b"x")
    assert remove_stale_lmcache_shm(tmp_path) == [f"lmcache_kv_{finished.pid}_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"lmcache_kv_{os.getpid()}_0", "psm_abc"])


def test_pool_engine_settings_reach_the_vllm_command_line() -> None:
    engine = EngineSettings(
        model="/models/m",
        tensor_parallel_size=2,
        kv_cache_dtype="fp8_e5m2",
        max_num_batched_tokens=8192,
        enable_chunked_prefill=True,
        max_model_len=4096,
    )
    table = TenantTable(
        model_deployment="ns/md",
        served_model_name="m",
        pool_salt_id="pool",
        pools={"shared": PoolEntry(name="shared", block_size=32, hbm_blocks_per_replica=1000, engine=engine)},
        tenants={},
    )
    vllm, _ = build_pool_engine_settings(
        table, "shared", model="/models/m", vllm_port=8000, lmcache_port=1, lmcache_http_port=2, nvme_dir=None
    )
    argv = build_vllm_args(vllm)
    joined = " ".join(argv)
    assert "--kv-cache-dtype fp8_e5m2" in joined
    assert "--tensor-parallel-size 2" in joined
    assert "--max-num-batched-tokens 8192" in joined
    assert "--max-model-len 4096" in joined
    assert "--enable-chunked-prefill" in argv
    env = build_plugin_env(Path("/c/tenants.json"), Path("/k/keys.json"), "shared", 8001)
    assert env == {
        "KVFLEET_TENANT_TABLE": "/c/tenants.json",
        "KVFLEET_KEY_FILE": "/k/keys.json",
        "KVFLEET_POOL": "shared",
        "KVFLEET_PLUGIN_METRICS_PORT": "8001",
    }
