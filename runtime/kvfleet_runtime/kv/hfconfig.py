"""Read a model architecture from a local Hugging Face ``config.json``.

Understands the Llama, Mistral, Qwen2, Mixtral and DeepSeek-V2/V3 families (and multimodal configs that
nest them under ``text_config``). A config.json does not state the parameter count, so it is estimated
from the shapes (:func:`estimate_num_parameters`); the estimate is exact for these families (the tests
pin it against the published totals) and can be overridden by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfleet_runtime.kv.sizing import ModelArchitecture, SizingError, WeightDtype, build_model_architecture


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise SizingError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizingError(f"config.json {key!r} is not an integer: {value!r}")
    return value


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def _is_mla(config: Mapping[str, Any]) -> bool:
    return config.get("kv_lora_rank") is not None


def _num_experts(config: Mapping[str, Any]) -> int:
    # Mixtral: num_local_experts; DeepSeek: n_routed_experts; Qwen2-MoE/Qwen3-MoE: num_experts.
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        if config.get(key) is not None:
            return _int(config, key)
    return 1


def read_weight_dtype(config: Mapping[str, Any]) -> WeightDtype:
    """Weight dtype from ``quantization_config`` (fp8, 8/4-bit) or else ``torch_dtype``/``dtype``."""
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        bits = quant.get("bits", quant.get("w_bit"))
        if method == "fp8":
            return WeightDtype.FP8
        if bits == 8:
            return WeightDtype.INT8
        if bits == 4:
            return WeightDtype.INT4
    dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    try:
        return WeightDtype(str(dtype))
    except ValueError:
        raise SizingError(f"config.json has an unknown torch_dtype {dtype!r}") from None


def estimate_num_parameters(config: Mapping[str, Any]) -> int:
    """Parameter count implied by the shapes in a config.json (embeddings, attention, MLP/experts, norms).

    Covers Llama/Mistral (no biases), Qwen2 (q/k/v biases), Mixtral (``num_local_experts`` SwiGLU experts
    and a router), DeepSeek-V2/V3 (MLA projections, ``first_k_dense_replace`` dense layers, routed and
    shared experts of ``moe_intermediate_size``, router with score-correction bias). Multi-token-prediction
    layers are not counted (vLLM loads them only for speculative decoding).
    """
    cfg = _text_config(config)
    hidden = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    vocab = _int(cfg, "vocab_size")
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    final_norm = hidden
    norms_per_layer = 2 * hidden

    if _is_mla(cfg):
        rope = _int(cfg, "qk_rope_head_dim")
        nope = _int(cfg, "qk_nope_head_dim")
        v_dim = _int(cfg, "v_head_dim")
        rank = _int(cfg, "kv_lora_rank")
        q_rank = cfg.get("q_lora_rank")
        q_head = nope + rope
        # With a query LoRA: q_a_proj, q_a_layernorm, q_b_proj; without: one q_proj.
        q_proj = hidden * q_rank + q_rank + q_rank * heads * q_head if q_rank else hidden * heads * q_head
        attention = (
            q_proj
            + hidden * (rank + rope)  # kv_a_proj_with_mqa
            + rank  # kv_a_layernorm
            + rank * heads * (nope + v_dim)  # kv_b_proj
            + heads * v_dim * hidden  # o_proj
        )
    else:
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        head_dim = _int(cfg, "head_dim", hidden // heads)
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
        qkv_bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
        if qkv_bias:
            attention += q_out + 2 * kv_out

    experts = _num_experts(cfg)
    intermediate = _int(cfg, "intermediate_size")
    dense_mlp = 3 * hidden * intermediate  # gate, up, down (SwiGLU)
    if experts <= 1:
        mlp_layers = [dense_mlp] * layers
    else:
        moe_inter = _int(cfg, "moe_intermediate_size", intermediate)
        shared = cfg.get("n_shared_experts") or 0
        router = hidden * experts + (experts if cfg.get("topk_method") == "noaux_tc" else 0)
        moe_mlp = (experts + shared) * 3 * hidden * moe_inter + router
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        mlp_layers = [dense_mlp if i < first_dense else moe_mlp for i in range(layers)]
    return embeddings + final_norm + sum(attention + mlp + norms_per_layer for mlp in mlp_layers)


def build_architecture_from_hf_config(
    config: Mapping[str, Any], *, num_parameters: int | None = None
) -> ModelArchitecture:
    """:class:`ModelArchitecture` from a parsed config.json; ``num_parameters`` overrides the estimate."""
    cfg = _text_config(config)
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    experts = _num_experts(cfg)
    fields: dict[str, Any] = {
        "num_layers": _int(cfg, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_kv_heads": _int(cfg, "num_key_value_heads", heads),
        "hidden_size": hidden,
        "weight_dtype": read_weight_dtype({**cfg, **{k: v for k, v in config.items() if k != "text_config"}}),
        "num_experts": experts if experts > 1 else None,
        "num_experts_per_token": _int(cfg, "num_experts_per_tok") if experts > 1 else None,
    }
    if _is_mla(cfg):
        fields["kv_lora_rank"] = _int(cfg, "kv_lora_rank")
        fields["qk_rope_head_dim"] = _int(cfg, "qk_rope_head_dim")
        fields["head_dim"] = _int(cfg, "qk_nope_head_dim") + fields["qk_rope_head_dim"]
    else:
        if heads < 1:
            raise SizingError(f"config.json num_attention_heads must be at least 1, got {heads}")
        fields["head_dim"] = _int(cfg, "head_dim", hidden // heads)
    fields["num_parameters"] = (
        num_parameters if num_parameters is not None else estimate_num_parameters(config)
    )
    return build_model_architecture(**fields)


def read_hf_config(path: Path | str, *, num_parameters: int | None = None) -> tuple[str, ModelArchitecture]:
    """(model name, architecture) from a config.json file or a folder holding one.

    The name is ``_name_or_path`` when present, else the folder's name. Raises :class:`SizingError` for a
    missing/unreadable file or a config this module cannot interpret.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SizingError(f"no config.json at {file}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SizingError(f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise SizingError(f"{file} is not a JSON object")
    name = str(config.get("_name_or_path") or file.resolve().parent.name)
    return name, build_architecture_from_hf_config(config, num_parameters=num_parameters)
