"""Architectures of well-known public models, from their published Hugging Face ``config.json``.

Parameter counts are the main model's (DeepSeek-V3's multi-token-prediction layer is not counted) and
equal :func:`kvfleet_runtime.kv.hfconfig.estimate_num_parameters` of the same config (a test checks it).
"""

from __future__ import annotations

from typing import NamedTuple

from kvfleet_runtime.kv.sizing import ModelArchitecture, SizingError, WeightDtype


class Preset(NamedTuple):
    """A named architecture and where its numbers come from."""

    name: str
    source: str
    architecture: ModelArchitecture


def _dense(layers: int, heads: int, kv_heads: int, hidden: int, params: int) -> ModelArchitecture:
    return ModelArchitecture(
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        hidden_size=hidden,
        num_parameters=params,
        weight_dtype=WeightDtype.BFLOAT16,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # hidden 4096, 32 layers, 32 heads, 8 KV heads, vocab 128256, intermediate 14336.
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", _dense(32, 32, 8, 4096, 8_030_261_248)),
        # hidden 8192, 80 layers, 64 heads, 8 KV heads, vocab 128256, intermediate 28672.
        Preset("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", _dense(80, 64, 8, 8192, 70_553_706_496)),
        # hidden 8192, 80 layers, 64 heads, 8 KV heads, vocab 152064, intermediate 29568, q/k/v biases.
        Preset("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", _dense(80, 64, 8, 8192, 72_706_203_648)),
        # hidden 6144, 56 layers, 48 heads, 8 KV heads, vocab 32000, 8 experts of 16384, top-2.
        Preset(
            "mixtral-8x22b",
            "mistralai/Mixtral-8x22B-v0.1",
            ModelArchitecture(
                num_layers=56,
                num_attention_heads=48,
                num_kv_heads=8,
                head_dim=128,
                hidden_size=6144,
                num_parameters=140_620_634_112,
                weight_dtype=WeightDtype.BFLOAT16,
                num_experts=8,
                num_experts_per_token=2,
            ),
        ),
        # hidden 7168, 61 layers (3 dense), 128 heads, MLA kv_lora_rank 512 + rope 64 (q/k head 128+64),
        # 256 routed experts of 2048 + 1 shared, top-8, vocab 129280, FP8 (e4m3, block-scaled) weights.
        Preset(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3",
            ModelArchitecture(
                num_layers=61,
                num_attention_heads=128,
                num_kv_heads=128,
                head_dim=192,
                hidden_size=7168,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                num_parameters=671_026_419_200,
                weight_dtype=WeightDtype.FP8,
                num_experts=256,
                num_experts_per_token=8,
            ),
        ),
        # The test model built locally with random weights: LlamaConfig(hidden 128, 2 layers, 4 heads,
        # 2 KV heads, intermediate 256, vocab 4096, untied; runtime/kvfleet_runtime/engine/tinymodel.py),
        # bf16: 512 B of KV per token.
        Preset("tiny-llama", "local test model (random weights)", _dense(2, 4, 2, 128, 1_344_128)),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive); :class:`SizingError` naming the known ones."""
    preset = PRESETS.get(name.strip().lower())
    if preset is None:
        raise SizingError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return preset
