"""Reading Hugging Face config.json files (their published contents, written to tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.kv.hfconfig import estimate_num_parameters, read_hf_config
from kvfleet_runtime.kv.presets import PRESETS
from kvfleet_runtime.kv.sizing import SizingError, WeightDtype, compute_kv_bytes_per_token

LLAMA_3_1_8B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

LLAMA_3_3_70B: dict[str, Any] = {
    **LLAMA_3_1_8B,
    "_name_or_path": "meta-llama/Llama-3.3-70B-Instruct",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}

QWEN2_5_72B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 70,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

MIXTRAL_8X22B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 6144,
    "intermediate_size": 16384,
    "max_position_embeddings": 65536,
    "model_type": "mixtral",
    "num_attention_heads": 48,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 56,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# The local test model (runtime/kvfleet_runtime/engine/tinymodel.py writes this shape).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 4096,
    "model_type": "llama",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _write(tmp_path: Path, config: dict[str, Any], folder: str = "model") -> Path:
    path = tmp_path / folder
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("config", "preset"),
    [
        (LLAMA_3_1_8B, "llama-3.1-8b"),
        (LLAMA_3_3_70B, "llama-3.3-70b"),
        (QWEN2_5_72B, "qwen2.5-72b"),
        (MIXTRAL_8X22B, "mixtral-8x22b"),
        (DEEPSEEK_V3, "deepseek-v3"),
        (TINY_LLAMA, "tiny-llama"),
    ],
)
def test_config_json_reads_to_the_preset(tmp_path: Path, config: dict[str, Any], preset: str) -> None:
    """Every field, the estimated parameter count included, equals the preset built from the model card."""
    _name, arch = read_hf_config(_write(tmp_path, config) / "config.json")
    assert arch == PRESETS[preset].architecture


def test_published_parameter_counts() -> None:
    # The totals Hugging Face shows for these checkpoints (DeepSeek-V3: 671B main model, MTP excluded).
    assert estimate_num_parameters(LLAMA_3_1_8B) == 8_030_261_248
    assert estimate_num_parameters(LLAMA_3_3_70B) == 70_553_706_496
    assert estimate_num_parameters(QWEN2_5_72B) == 72_706_203_648
    assert round(estimate_num_parameters(MIXTRAL_8X22B) / 1e9) == 141
    assert round(estimate_num_parameters(DEEPSEEK_V3) / 1e9) == 671


def test_qwen2_counts_its_qkv_biases() -> None:
    # Qwen2 has q/k/v biases: 8192 + 1024 + 1024 = 10,240 per layer x 80 layers = 819,200
    no_bias = {**QWEN2_5_72B, "attention_bias": False}
    assert estimate_num_parameters(QWEN2_5_72B) - estimate_num_parameters(no_bias) == 819_200


def test_name_and_folder(tmp_path: Path) -> None:
    name, arch = read_hf_config(_write(tmp_path, LLAMA_3_1_8B))
    assert name == "meta-llama/Llama-3.1-8B-Instruct"
    assert compute_kv_bytes_per_token(arch) == 131_072  # 2 x 32 x 8 x 128 x 2
    name, _ = read_hf_config(_write(tmp_path, QWEN2_5_72B, folder="qwen72"))
    assert name == "qwen72"


def test_parameter_override_and_quantized_weights(tmp_path: Path) -> None:
    awq = {**QWEN2_5_72B, "torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4}}
    _name, arch = read_hf_config(_write(tmp_path, awq), num_parameters=1234)
    assert arch.weight_dtype is WeightDtype.INT4
    assert arch.num_parameters == 1234


def test_multimodal_text_config(tmp_path: Path) -> None:
    nested = {"model_type": "llava", "text_config": LLAMA_3_1_8B, "vision_config": {"hidden_size": 1024}}
    _name, arch = read_hf_config(_write(tmp_path, nested))
    assert arch == PRESETS["llama-3.1-8b"].architecture


def test_unreadable_configs_are_sizing_errors(tmp_path: Path) -> None:
    with pytest.raises(SizingError, match=r"no config\.json"):
        read_hf_config(tmp_path / "absent")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SizingError, match="cannot read"):
        read_hf_config(bad)
    missing = {k: v for k, v in LLAMA_3_1_8B.items() if k != "num_hidden_layers"}
    with pytest.raises(SizingError, match="no 'num_hidden_layers'"):
        read_hf_config(_write(tmp_path, missing, folder="missing"))
    odd = {**LLAMA_3_1_8B, "torch_dtype": "float8_e8m0"}
    with pytest.raises(SizingError, match="unknown torch_dtype"):
        read_hf_config(_write(tmp_path, odd, folder="odd"))
    zero = {**LLAMA_3_1_8B, "num_attention_heads": 0}
    with pytest.raises(SizingError, match="num_attention_heads must be at least 1"):
        read_hf_config(_write(tmp_path, zero, folder="zero"))
