"""``kvfleet plan`` through the real entry point, ``kvfleet_runtime.cli.main``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.cli import main

QWEN_EXAMPLE = [
    "plan",
    "--preset",
    "qwen2.5-72b",
    "--tensor-parallel",
    "8",
    "--gpu-memory",
    "141Gi",
    "--gpu-memory-utilization",
    "0.92",
    "--kv-dtype",
    "fp8_e5m2",
    "--replicas",
    "2",
    "--context",
    "128K",
    "--sessions",
    "64",
    "--cpu-tier",
    "256Gi",
    "--nvme-tier",
    "2Ti",
]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main([*argv, "--output", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    data = json.loads(captured.out)
    assert isinstance(data, dict)
    return data


def test_json_output_shape_is_stable(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, QWEN_EXAMPLE)
    assert list(data) == ["model", "engine", "kv_per_token", "capacity", "sessions", "workload", "restore"]
    model = data["model"]
    assert isinstance(model, dict)
    assert set(model) == {"name", "attention", "architecture"}
    assert set(model["architecture"]) == {
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "hidden_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "num_parameters",
        "weight_dtype",
        "num_experts",
        "num_experts_per_token",
    }
    assert data["engine"] == {
        "kv_cache_dtype": "fp8_e5m2",
        "kv_cache_dtype_requested": "fp8_e5m2",
        "kv_cache_dtype_bytes": 1,
        "block_size": 16,
        "tensor_parallel": 8,
        "pipeline_parallel": 1,
        "gpus_per_replica": 8,
        "replicas": 2,
        "gpu_memory_bytes": 141 * 2**30,
        "gpu_memory_utilization": 0.92,
    }
    assert data["kv_per_token"] == {
        "bytes": 163_840,
        "bytes_per_gpu": 20_480,
        "bytes_per_replica": 163_840,
        "offload_bytes": 163_840,
        "kv_heads_per_gpu": 1,
        "layers_per_gpu": 80,
    }
    capacity = data["capacity"]
    assert isinstance(capacity, dict)
    # hand computation in tests/unit/test_sizing.py::test_qwen_72b_fp8_on_8_h200_like_the_example
    assert capacity["blocks_per_replica"] == 363_042
    assert capacity["tokens_per_replica"] == 5_808_672
    assert capacity["tokens_pool"] == 11_617_344
    assert data["sessions"] == {
        "context_tokens": 131_072,
        "blocks_per_session": 8192,
        "per_replica": 44,
        "pool": 88,
    }
    workload = data["workload"]
    assert isinstance(workload, dict)
    assert set(workload) == {
        "sessions",
        "context_tokens",
        "tokens",
        "logical_bytes",
        "replicas_needed",
        "hbm",
        "cpu",
        "nvme",
    }
    # 64 x 131,072 x 163,840 B = 1.25 TiB
    assert workload["logical_bytes"] == 64 * 131_072 * 163_840
    assert workload["hbm"] == {
        "needed_bytes": 64 * 8192 * 16 * 163_840,
        "capacity_bytes": 2 * 363_042 * 16 * 163_840,
        "sessions_fit": 88,
        "fits": True,
    }
    assert workload["cpu"]["fits"] is False
    restore = data["restore"]
    assert isinstance(restore, dict)
    assert set(restore) == {
        "context_tokens",
        "bytes_per_gpu",
        "offload_bytes",
        "pcie_gbps",
        "nvme_gbps",
        "cpu_seconds",
        "nvme_seconds",
    }
    assert restore["pcie_gbps"] == 40 and restore["nvme_gbps"] == 12


def test_without_context_the_optional_sections_are_null(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, ["plan", "--preset", "llama-3.1-8b"])
    assert data["sessions"] is None and data["workload"] is None and data["restore"] is None
    # default GPU: 80 GiB at 0.9, 2 GiB reserve: floor(80 x 2^30 x 0.9) - 16,060,522,496 - 2^31
    cap = data["capacity"]
    assert isinstance(cap, dict)
    assert cap["kv_bytes_per_gpu"] == 77_309_411_328 - 8_030_261_248 * 2 - 2**31


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(QWEN_EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-72b (GQA)" in out
    assert "163,840 B" in out
    assert any(
        line.startswith("tokens per replica") and line.endswith(" 5,808,672") for line in out.splitlines()
    )
    assert "44 per replica, 88 in pool" in out
    assert "on CPU" in out and "does NOT fit" in out


def test_llama_70b_bytes_per_token_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys, ["plan", "--preset", "llama-3.3-70b", "--tensor-parallel", "8", "--gpu-memory", "141GB"]
    )
    assert data["kv_per_token"]["bytes"] == 327_680


def test_tiny_model_explicit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--num-layers", "2", "--num-attention-heads", "4", "--num-kv-heads", "2", "--hidden-size", "128",
        "--num-parameters", "1344128", "--weight-dtype", "bf16",
        "--gpu-memory", "1GiB", "--gpu-memory-utilization", "1", "--reserve", "0",
        "--weight-bytes-per-gpu", "0",
    ]  # fmt: skip
    data = _json(capsys, argv)
    assert data["model"]["name"] == "custom"
    assert data["kv_per_token"]["bytes"] == 512
    assert data["capacity"]["tokens_per_replica"] == 2_097_152


def test_deepseek_mla_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys, ["plan", "--preset", "deepseek-v3", "--gpus-per-replica", "8", "--gpu-memory", "141GB"]
    )
    assert data["model"]["attention"] == "MLA"
    assert data["engine"]["tensor_parallel"] == 8
    assert data["kv_per_token"]["bytes"] == 70_272
    assert data["capacity"]["tokens_per_replica"] == 581_648


def test_config_json_with_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = {
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": 4096, "model_type": "llama", "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = _json(capsys, ["plan", "--config-json", str(tmp_path), "--num-parameters", "5M", "--name", "tiny"])
    assert data["model"]["name"] == "tiny"
    assert data["model"]["architecture"]["num_parameters"] == 5_000_000


def test_pipeline_and_gpus_per_replica(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys, ["plan", "--preset", "llama-3.3-70b", "--gpus-per-replica", "16", "--pipeline-parallel", "2"]
    )
    assert data["engine"]["tensor_parallel"] == 8
    assert data["kv_per_token"]["layers_per_gpu"] == 40


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
        (["--preset", "llama-3.3-70b"], "model does not fit"),
        (["--preset", "tiny-llama", "--kv-dtype", "fp7"], "unknown KV cache dtype 'fp7'"),
        (["--preset", "tiny-llama", "--weight-dtype", "fp6"], "unknown weight dtype 'fp6'"),
        (["--preset", "tiny-llama", "--gpu-memory", "lots"], "bad byte quantity 'lots'"),
        (["--preset", "tiny-llama", "--num-attention-heads", "0"], "num_attention_heads must be at least 1"),
        (["--preset", "tiny-llama", "--num-kv-heads", "3"], "must divide num_attention_heads"),
        (["--num-layers", "2"], "no model"),
        (["--preset", "tiny-llama", "--config-json", "x"], "not both"),
        (["--config-json", "/nonexistent/config.json"], "no config.json"),
        (["--preset", "llama-3.3-70b", "--gpus-per-replica", "8", "--tensor-parallel", "4"], "must equal"),
        (["--preset", "llama-3.3-70b", "--tensor-parallel", "3"], "does not divide"),
        (["--preset", "tiny-llama", "--gpu-memory-utilization", "1.5"], "utilization must be in"),
        (["--preset", "tiny-llama", "--gpu-memory-utilization", "most"], "must be a number"),
        (["--preset", "tiny-llama", "--context", "0"], "--context must be at least 1"),
        (["--preset", "tiny-llama", "--sessions", "5"], "--sessions needs --context"),
        (["--preset", "tiny-llama", "--block-size", "x"], "bad count 'x'"),
        (["--preset", "tiny-llama", "--output", "yaml"], "--output must be table or json"),
    ],
)
def test_impossible_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvfleet plan: error: ")
    assert message in lines[0]
