"""KV-cache sizing math: pure functions shared by the planner, the operator, the gateway and the simulator.

Everything here is exact integer arithmetic (ratios go through :class:`fractions.Fraction`, never a
float), so a number printed by ``kvfleet plan`` is the number a test pins and the number the operator
writes into a tenant table.

Model of memory, following vLLM's v1 engine (``vllm/v1/core/kv_cache_utils.py``):

* Every GPU of a replica runs the same memory budget: ``usable = gpu_memory * gpu_memory_utilization``;
  the KV cache gets ``usable - weights - reserve``. ``reserve`` stands for what vLLM's profiling run
  finds on top of the weights (peak activations, CUDA graphs, NCCL/cuBLAS workspaces). It is an explicit
  parameter with a documented planning default (:data:`DEFAULT_RESERVE_BYTES_PER_GPU`), not a guess
  hidden in a formula.
* A replica is ``tensor_parallel * pipeline_parallel`` GPUs. Each GPU holds the KV of the layers of its
  pipeline stage (the largest stage, ``ceil(layers / pp)``, bounds the replica) for the KV heads of its
  tensor-parallel shard. The number of blocks is the same on every GPU of a replica (vLLM takes the
  minimum over workers), so ``blocks_per_replica = kv_bytes_per_gpu // bytes_per_block_per_gpu``.
* MHA/GQA/MQA: ``2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`` per token. KV heads are
  split across tensor-parallel ranks; when ``tp > kv_heads`` each rank keeps one full KV head (vLLM
  replicates KV heads, ``ModelConfig.get_num_kv_heads`` returns ``max(1, kv_heads // tp)``).
* MLA (DeepSeek-V2/V3): one compressed latent per token and layer, ``(kv_lora_rank + qk_rope_head_dim) *
  dtype_bytes``, no K/V pair and no heads. vLLM keeps that latent *replicated* on every tensor-parallel
  rank (the latent is shared by all heads, and each rank computes attention for its heads from the whole
  latent), so tensor parallelism does not divide MLA's per-token KV; only pipeline parallelism does.
* Offload tiers (LMCache CPU / NVMe) store what the ranks hold. For MLA LMCache saves the latent once
  (``save_only_first_rank``, its default for MLA), so the offloaded bytes per token are the model's
  logical bytes; for the other attention kinds every rank stores its own shard, so a replica stores the
  sum over its GPUs (which exceeds the logical size when KV heads are replicated).
* Restores: from CPU every GPU pulls its own shard over its own PCIe link in parallel, so the time is
  ``bytes_per_gpu / pcie_bandwidth``; from NVMe the node's drives feed the whole replica, so the time is
  ``offload_bytes / nvme_bandwidth``.

Weights: ``num_parameters * weight_dtype_bytes / (tp * pp)`` per GPU. For MoE models all experts are
resident: expert parallelism *inside* a replica spreads whole experts over the same ``tp * pp`` GPUs that
tensor parallelism would slice them over, so the per-GPU share is unchanged; wide expert parallelism across
data-parallel replicas is not modelled (pass ``weight_bytes_per_gpu`` to override).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from fractions import Fraction
from typing import Annotated, Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
GB = 10**9

#: Planning default for what vLLM's profiling run takes on each GPU beyond the weights: peak activations
#: of one ``max_num_batched_tokens`` step (≤ 8192 tokens), CUDA graphs and NCCL/cuBLAS workspaces. It is
#: a conservative planning constant, not a measurement; pass ``reserve_bytes_per_gpu`` (``--reserve``)
#: for larger batches or when a real engine's log ("Available KV cache memory") is known.
DEFAULT_RESERVE_BYTES_PER_GPU = 2 * GiB
DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = Fraction(9, 10)
#: Host-to-GPU restore bandwidth per GPU (PCIe Gen5 x16, effective), GB/s (10**9 bytes per second).
DEFAULT_PCIE_GBPS = Fraction(40)
#: NVMe read bandwidth available to one replica (one Gen5 drive), GB/s.
DEFAULT_NVME_GBPS = Fraction(12)


class SizingError(ValueError):
    """An input the sizing math cannot satisfy (model does not fit, bad quantity, inconsistent shape).

    The message is one line a user can act on; the CLI prints it and exits with code 2.
    """


# --------------------------------------------------------------------------------------------- dtypes


class WeightDtype(StrEnum):
    """How the checkpoint's weights are stored on the GPU."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"  # e4m3 with block or tensor scales (DeepSeek-V3, "FP8" checkpoints)
    INT8 = "int8"
    INT4 = "int4"


class KVCacheDtype(StrEnum):
    """vLLM's ``--kv-cache-dtype`` values the planner understands (``fp8`` means E4M3 in vLLM)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


WEIGHT_DTYPE_BYTES: dict[WeightDtype, Fraction] = {
    WeightDtype.FLOAT32: Fraction(4),
    WeightDtype.FLOAT16: Fraction(2),
    WeightDtype.BFLOAT16: Fraction(2),
    WeightDtype.FP8: Fraction(1),
    WeightDtype.INT8: Fraction(1),
    WeightDtype.INT4: Fraction(1, 2),
}

KV_CACHE_DTYPE_BYTES: dict[KVCacheDtype, int] = {
    KVCacheDtype.BFLOAT16: 2,
    KVCacheDtype.FLOAT16: 2,
    KVCacheDtype.FP8: 1,
    KVCacheDtype.FP8_E4M3: 1,
    KVCacheDtype.FP8_E5M2: 1,
}

_WEIGHT_ALIASES: dict[str, WeightDtype] = {
    "fp32": WeightDtype.FLOAT32,
    "float": WeightDtype.FLOAT32,
    "fp16": WeightDtype.FLOAT16,
    "half": WeightDtype.FLOAT16,
    "bf16": WeightDtype.BFLOAT16,
    "fp8_e4m3": WeightDtype.FP8,
    "float8_e4m3fn": WeightDtype.FP8,
    "e4m3": WeightDtype.FP8,
}

_KV_ALIASES: dict[str, KVCacheDtype] = {
    "bf16": KVCacheDtype.BFLOAT16,
    "fp16": KVCacheDtype.FLOAT16,
    "half": KVCacheDtype.FLOAT16,
}


_E = TypeVar("_E", bound=StrEnum)


def _parse_dtype(value: str | _E, enum: type[_E], aliases: dict[str, _E], what: str) -> _E:
    if isinstance(value, enum):
        return value
    name = str(value).strip().lower()
    if name in aliases:
        return aliases[name]
    try:
        return enum(name)
    except ValueError:
        known = ", ".join(d.value for d in enum)
        raise SizingError(f"unknown {what} {value!r} (expected one of: {known})") from None


def parse_weight_dtype(value: str | WeightDtype) -> WeightDtype:
    """Canonical weight dtype for a name or alias (``bf16``, ``fp16``...); :class:`SizingError` if unknown."""
    return _parse_dtype(value, WeightDtype, _WEIGHT_ALIASES, "weight dtype")


def parse_kv_cache_dtype(value: str | KVCacheDtype) -> KVCacheDtype:
    """Canonical KV-cache dtype for a name or alias; :class:`SizingError` if unknown."""
    return _parse_dtype(value, KVCacheDtype, _KV_ALIASES, "KV cache dtype")


def resolve_kv_cache_dtype(
    kv_cache_dtype: str | KVCacheDtype, weight_dtype: str | WeightDtype
) -> KVCacheDtype:
    """The concrete dtype vLLM stores KV in.

    ``auto`` follows the model's activation dtype, as vLLM does: bf16 for bf16 and for quantized (fp8,
    int8, int4) checkpoints, whose activations are bf16; fp16 for fp16 and fp32 checkpoints (vLLM serves
    fp32 checkpoints in fp16 by default).
    """
    kv = parse_kv_cache_dtype(kv_cache_dtype)
    if kv is not KVCacheDtype.AUTO:
        return kv
    weight = parse_weight_dtype(weight_dtype)
    if weight in (WeightDtype.FLOAT16, WeightDtype.FLOAT32):
        return KVCacheDtype.FLOAT16
    return KVCacheDtype.BFLOAT16


def kv_cache_dtype_bytes(kv_cache_dtype: str | KVCacheDtype, weight_dtype: str | WeightDtype) -> int:
    """Bytes per KV element after resolving ``auto`` (bf16/fp16 → 2, fp8 → 1)."""
    return KV_CACHE_DTYPE_BYTES[resolve_kv_cache_dtype(kv_cache_dtype, weight_dtype)]


# ---------------------------------------------------------------------------------------- architecture


class AttentionKind(StrEnum):
    MHA = "MHA"
    GQA = "GQA"
    MQA = "MQA"
    MLA = "MLA"


class ModelArchitecture(BaseModel):
    """What the sizing math needs to know about a model. The CRD's explicit architecture mirrors it.

    MLA models set both ``kv_lora_rank`` and ``qk_rope_head_dim``; MoE models set ``num_experts`` > 1 and
    ``num_experts_per_token``. ``head_dim`` is the attention head dimension (for MLA models the query/key
    head dim, ``qk_nope_head_dim + qk_rope_head_dim``; it does not enter MLA's KV size).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: Annotated[int, Field(description="Transformer layers (num_hidden_layers).")]
    num_attention_heads: Annotated[int, Field(description="Query heads per layer.")]
    num_kv_heads: Annotated[int, Field(description="Key/value heads per layer (num_key_value_heads).")]
    head_dim: Annotated[int, Field(description="Dimension of one attention head.")]
    hidden_size: Annotated[int, Field(description="Model (residual stream) width.")]
    kv_lora_rank: Annotated[int | None, Field(description="MLA latent rank; None unless MLA.")] = None
    qk_rope_head_dim: Annotated[int | None, Field(description="MLA rope key dim; None unless MLA.")] = None
    num_parameters: Annotated[int, Field(description="Total parameters, all experts included.")]
    weight_dtype: Annotated[WeightDtype, Field(description="Dtype the weights occupy on the GPU.")]
    num_experts: Annotated[
        int | None, Field(description="Routed experts per MoE layer; None/1 if dense.")
    ] = None
    num_experts_per_token: Annotated[int | None, Field(description="Experts each token is routed to.")] = None

    @field_validator("weight_dtype", mode="before")
    @classmethod
    def _weight_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_weight_dtype(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.num_parameters < 1:
            raise ValueError(f"num_parameters must be at least 1, got {self.num_parameters}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("kv_lora_rank and qk_rope_head_dim are set together (MLA) or not at all")
        if self.kv_lora_rank is not None and self.kv_lora_rank < 1:
            raise ValueError(f"kv_lora_rank must be at least 1, got {self.kv_lora_rank}")
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim must not be negative, got {self.qk_rope_head_dim}")
        experts = self.num_experts or 1
        if experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        per_token = self.num_experts_per_token
        if experts > 1:
            if per_token is None or not 1 <= per_token <= experts:
                raise ValueError(
                    f"num_experts_per_token must be between 1 and num_experts ({experts}), got {per_token}"
                )
        elif per_token not in (None, 1):
            raise ValueError(f"num_experts_per_token is {per_token} but the model has no experts")
        return self

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return (self.num_experts or 1) > 1

    @property
    def attention_kind(self) -> AttentionKind:
        if self.is_mla:
            return AttentionKind.MLA
        if self.num_kv_heads == self.num_attention_heads:
            return AttentionKind.MHA
        if self.num_kv_heads == 1:
            return AttentionKind.MQA
        return AttentionKind.GQA


def build_model_architecture(**fields: Any) -> ModelArchitecture:
    """:class:`ModelArchitecture` from keyword fields, raising :class:`SizingError` with one readable line."""
    try:
        return ModelArchitecture(**fields)
    except ValidationError as exc:
        raise SizingError(f"invalid model architecture: {format_validation_error(exc)}") from None


def format_validation_error(exc: ValidationError) -> str:
    """Pydantic errors as ``field: message; field: message`` on one line."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ quantities

_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "ki": KiB,
    "kib": KiB,
    "mi": MiB,
    "mib": MiB,
    "gi": GiB,
    "gib": GiB,
    "ti": TiB,
    "tib": TiB,
    "pi": 2**50,
    "pib": 2**50,
}
# Context lengths are conventionally binary ("128K context" = 131,072 tokens); parameter counts decimal.
_TOKEN_UNITS: dict[str, int] = {"": 1, "k": 1024, "m": 1024**2}
_COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _parse_scaled(text: str | int, units: dict[str, int], what: str, example: str) -> int:
    if isinstance(text, int):
        if text < 0:
            raise SizingError(f"{what} must not be negative, got {text}")
        return text
    match = _QUANTITY.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        raise SizingError(f"bad {what} {text!r} (expected e.g. {example})")
    value = Fraction(match.group(1)) * units[unit]
    if value.denominator != 1 and what != "byte quantity":
        raise SizingError(f"bad {what} {text!r}: not a whole number")
    return math.floor(value)


def parse_byte_size(text: str | int) -> int:
    """Bytes for ``141GB``, ``80GiB``, ``256Gi``, ``2Ti``, ``1.5T``, ``1073741824`` (floored to a byte).

    The sizes people write on command lines and spec sheets: decimal suffixes (K, M, G, T, P with or
    without B) are powers of 1000; binary ones (Ki..Pi, KiB..PiB) powers of 1024; any case. Not the CRDs'
    grammar: Kubernetes quantities in a manifest (``256Gi``, case-sensitive, rounded up) are the operator's
    ``api.units.parse_quantity``.
    """
    return _parse_scaled(text, _BYTE_UNITS, "byte quantity", "141GB, 80GiB, 256Gi, 2Ti")


def parse_token_count(text: str | int) -> int:
    """Tokens for ``131072``, ``128K`` (= 131,072: context lengths are binary) or ``1M`` (= 1,048,576)."""
    return _parse_scaled(text, _TOKEN_UNITS, "token count", "131072 or 128K")


def parse_count(text: str | int) -> int:
    """A plain count with decimal suffixes: ``70.6B`` parameters, ``256``, ``8K``."""
    return _parse_scaled(text, _COUNT_UNITS, "count", "671B, 70553706496")


def parse_share(value: str | float | Fraction) -> Fraction:
    """A share of a pool as an exact fraction in [0, 1] from ``0.25``, ``"25%"`` or ``Fraction(1, 4)``.

    Floats are read through their shortest decimal repr, so ``0.29`` is exactly 29/100 (a float product
    ``0.29 * 100`` would floor to 28).
    """
    if isinstance(value, Fraction):
        share = value
    elif isinstance(value, str):
        text = value.strip()
        try:
            share = Fraction(text[:-1].strip()) / 100 if text.endswith("%") else Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise SizingError(f"bad share {value!r} (expected e.g. 0.25 or 25%)") from None
    else:
        share = Fraction(repr(float(value)))
    if not 0 <= share <= 1:
        raise SizingError(f"share {value!r} is outside 0..100%")
    return share


def _as_fraction(value: float | Fraction | str, what: str) -> Fraction:
    try:
        return (
            value
            if isinstance(value, Fraction)
            else Fraction(repr(value) if isinstance(value, float) else value)
        )
    except (ValueError, ZeroDivisionError):
        raise SizingError(f"bad {what} {value!r}") from None


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``10.00 TiB``, ``320.00 KiB``, ``512 B``."""
    for unit, size in (("PiB", 2**50), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# -------------------------------------------------------------------------------------------- per token


def _check_parallel(arch: ModelArchitecture, tensor_parallel: int, pipeline_parallel: int) -> None:
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise SizingError(
            f"tensor parallel ({tensor_parallel}) and pipeline parallel ({pipeline_parallel}) "
            "must be at least 1"
        )
    if arch.num_attention_heads % tensor_parallel != 0:
        raise SizingError(
            f"tensor parallel {tensor_parallel} does not divide the "
            f"{arch.num_attention_heads} attention heads"
        )
    kv = arch.num_kv_heads
    if not arch.is_mla and kv % tensor_parallel != 0 and tensor_parallel % kv != 0:
        raise SizingError(
            f"tensor parallel {tensor_parallel} and {kv} KV heads: one must divide the other "
            "(vLLM splits or replicates whole KV heads)"
        )
    if pipeline_parallel > arch.num_layers:
        raise SizingError(f"pipeline parallel {pipeline_parallel} exceeds the {arch.num_layers} layers")


def compute_kv_heads_per_gpu(arch: ModelArchitecture, tensor_parallel: int = 1) -> int:
    """KV heads each tensor-parallel rank stores: ``max(1, kv_heads // tp)``; 1 latent "head" for MLA."""
    _check_parallel(arch, tensor_parallel, 1)
    if arch.is_mla:
        return 1
    return max(1, arch.num_kv_heads // tensor_parallel)


def compute_layers_per_gpu(arch: ModelArchitecture, pipeline_parallel: int = 1) -> int:
    """Layers on the largest pipeline stage, ``ceil(layers / pp)``: it bounds the replica's block count."""
    _check_parallel(arch, 1, pipeline_parallel)
    return -(-arch.num_layers // pipeline_parallel)


def _per_layer_token_elements(arch: ModelArchitecture, kv_heads: int) -> int:
    if arch.is_mla:
        assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
        return arch.kv_lora_rank + arch.qk_rope_head_dim
    return 2 * kv_heads * arch.head_dim


def compute_kv_bytes_per_token(arch: ModelArchitecture, kv_cache_dtype: str | KVCacheDtype = "auto") -> int:
    """Logical KV bytes per token for the whole model (all layers, all KV heads, stored once).

    MHA/GQA/MQA: ``2 * layers * kv_heads * head_dim * dtype_bytes``;
    MLA: ``layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``.
    """
    dtype_bytes = kv_cache_dtype_bytes(kv_cache_dtype, arch.weight_dtype)
    return arch.num_layers * _per_layer_token_elements(arch, arch.num_kv_heads) * dtype_bytes


def compute_kv_bytes_per_token_per_gpu(
    arch: ModelArchitecture,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """KV bytes per token on one GPU of the largest pipeline stage (what bounds a replica's capacity)."""
    _check_parallel(arch, tensor_parallel, pipeline_parallel)
    dtype_bytes = kv_cache_dtype_bytes(kv_cache_dtype, arch.weight_dtype)
    heads = compute_kv_heads_per_gpu(arch, tensor_parallel)
    layers = compute_layers_per_gpu(arch, pipeline_parallel)
    return layers * _per_layer_token_elements(arch, heads) * dtype_bytes


def compute_kv_bytes_per_token_per_replica(
    arch: ModelArchitecture,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """KV bytes per token summed over a replica's GPUs (replicated KV heads and MLA latents count per GPU)."""
    _check_parallel(arch, tensor_parallel, pipeline_parallel)
    dtype_bytes = kv_cache_dtype_bytes(kv_cache_dtype, arch.weight_dtype)
    heads = compute_kv_heads_per_gpu(arch, tensor_parallel)
    return arch.num_layers * _per_layer_token_elements(arch, heads) * dtype_bytes * tensor_parallel


def compute_offload_bytes_per_token(
    arch: ModelArchitecture,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """Bytes per token a replica writes to an LMCache tier (CPU or NVMe).

    MLA: the logical bytes (LMCache stores the latent from the first rank only); otherwise every rank
    stores its shard, i.e. :func:`compute_kv_bytes_per_token_per_replica`.
    """
    if arch.is_mla:
        _check_parallel(arch, tensor_parallel, pipeline_parallel)
        return compute_kv_bytes_per_token(arch, kv_cache_dtype)
    return compute_kv_bytes_per_token_per_replica(arch, kv_cache_dtype, tensor_parallel, pipeline_parallel)


def compute_bytes_per_block_per_gpu(
    arch: ModelArchitecture,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """Bytes one KV block (``block_size`` tokens, all of the GPU's layers) takes on one GPU."""
    if block_size < 1:
        raise SizingError(f"block size must be at least 1, got {block_size}")
    return block_size * compute_kv_bytes_per_token_per_gpu(
        arch, kv_cache_dtype, tensor_parallel, pipeline_parallel
    )


# ------------------------------------------------------------------------------------------ conversions


def compute_blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens (ceil: a partly filled block is a whole block)."""
    if tokens < 0 or block_size < 1:
        raise SizingError(f"bad tokens/block size: {tokens}/{block_size}")
    return -(-tokens // block_size)


def compute_tokens_for_blocks(blocks: int, block_size: int) -> int:
    """Token slots in ``blocks`` blocks."""
    return blocks * block_size


def compute_blocks_for_kv_bytes(kv_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in ``kv_bytes`` (floor), as vLLM sizes its block pool."""
    if bytes_per_block < 1:
        raise SizingError(f"bytes per block must be positive, got {bytes_per_block}")
    return max(0, kv_bytes) // bytes_per_block


def compute_tokens_for_kv_bytes(
    kv_bytes: int, bytes_per_token: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Tokens a KV space holds, in whole blocks: what vLLM reports as "GPU KV cache size: N tokens"."""
    blocks = compute_blocks_for_kv_bytes(kv_bytes, bytes_per_token * block_size)
    return compute_tokens_for_blocks(blocks, block_size)


def compute_bytes_for_tokens(tokens: int, bytes_per_token: int) -> int:
    """Bytes ``tokens`` tokens take at ``bytes_per_token``."""
    return tokens * bytes_per_token


def compute_tokens_for_bytes(nbytes: int, bytes_per_token: int) -> int:
    """Whole tokens that fit in ``nbytes`` (floor)."""
    if bytes_per_token < 1:
        raise SizingError(f"bytes per token must be positive, got {bytes_per_token}")
    return max(0, nbytes) // bytes_per_token


def compute_blocks_for_share(share: str | float | Fraction, pool_blocks: int) -> int:
    """Blocks a share of a pool is worth (floor), e.g. a tenant's HBM quota of ``25%`` of 10,000 blocks."""
    return math.floor(parse_share(share) * pool_blocks)


# ------------------------------------------------------------------------------------------- capacity


def compute_weight_bytes_per_gpu(
    arch: ModelArchitecture, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> int:
    """``ceil(num_parameters * weight_dtype_bytes / (tp * pp))``; MoE: all experts resident (module doc)."""
    _check_parallel(arch, tensor_parallel, pipeline_parallel)
    total = arch.num_parameters * WEIGHT_DTYPE_BYTES[arch.weight_dtype]
    return math.ceil(total / (tensor_parallel * pipeline_parallel))


class ReplicaCapacity(BaseModel):
    """How the memory of one GPU splits, and what KV a replica (and the pool of replicas) holds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usable_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    kv_bytes_per_gpu: int
    bytes_per_block_per_gpu: int
    bytes_per_block_per_replica: int
    blocks_per_replica: int
    tokens_per_replica: int
    kv_bytes_per_replica: int
    replicas: int
    blocks_pool: int
    tokens_pool: int
    kv_bytes_pool: int


def compute_replica_capacity(
    arch: ModelArchitecture,
    *,
    gpu_memory_bytes: int,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    gpu_memory_utilization: float | Fraction | str = DEFAULT_GPU_MEMORY_UTILIZATION,
    reserve_bytes_per_gpu: int = DEFAULT_RESERVE_BYTES_PER_GPU,
    weight_bytes_per_gpu: int | None = None,
    replicas: int = 1,
) -> ReplicaCapacity:
    """KV blocks and tokens per replica and per pool.

    Raises :class:`SizingError` when the weights plus the reserve leave no room for one block ("model
    does not fit"), naming the numbers and what to change.
    """
    utilization = _as_fraction(gpu_memory_utilization, "GPU memory utilization")
    if not 0 < utilization <= 1:
        raise SizingError(f"GPU memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    if gpu_memory_bytes < 1:
        raise SizingError(f"GPU memory must be positive, got {gpu_memory_bytes}")
    if reserve_bytes_per_gpu < 0:
        raise SizingError(f"reserve must not be negative, got {reserve_bytes_per_gpu}")
    if replicas < 1:
        raise SizingError(f"replicas must be at least 1, got {replicas}")
    usable = math.floor(gpu_memory_bytes * utilization)
    weights = (
        compute_weight_bytes_per_gpu(arch, tensor_parallel, pipeline_parallel)
        if weight_bytes_per_gpu is None
        else weight_bytes_per_gpu
    )
    block_bytes = compute_bytes_per_block_per_gpu(
        arch, kv_cache_dtype, block_size, tensor_parallel, pipeline_parallel
    )
    kv_bytes = usable - weights - reserve_bytes_per_gpu
    blocks = compute_blocks_for_kv_bytes(kv_bytes, block_bytes)
    if blocks < 1:
        gpus = tensor_parallel * pipeline_parallel
        raise SizingError(
            f"model does not fit: {format_bytes(weights)} of weights + {format_bytes(reserve_bytes_per_gpu)} "
            f"reserve per GPU leave {format_bytes(max(kv_bytes, 0))} of the {format_bytes(usable)} usable "
            f"({format_bytes(gpu_memory_bytes)} x {float(utilization):g}) for KV, less than one "
            f"{format_bytes(block_bytes)} block; use more GPUs per replica (now {gpus}), larger GPUs or "
            "quantized weights"
        )
    tokens = compute_tokens_for_blocks(blocks, block_size)
    block_bytes_replica = block_size * compute_kv_bytes_per_token_per_replica(
        arch, kv_cache_dtype, tensor_parallel, pipeline_parallel
    )
    return ReplicaCapacity(
        usable_bytes_per_gpu=usable,
        weight_bytes_per_gpu=weights,
        reserve_bytes_per_gpu=reserve_bytes_per_gpu,
        kv_bytes_per_gpu=kv_bytes,
        bytes_per_block_per_gpu=block_bytes,
        bytes_per_block_per_replica=block_bytes_replica,
        blocks_per_replica=blocks,
        tokens_per_replica=tokens,
        kv_bytes_per_replica=blocks * block_bytes_replica,
        replicas=replicas,
        blocks_pool=blocks * replicas,
        tokens_pool=tokens * replicas,
        kv_bytes_pool=blocks * block_bytes_replica * replicas,
    )


def compute_sessions_that_fit(blocks: int, context_tokens: int, block_size: int) -> int:
    """Sessions of ``context_tokens`` each that fit in ``blocks`` blocks (a session rounds up to blocks)."""
    if context_tokens < 1:
        raise SizingError(f"context must be at least 1 token, got {context_tokens}")
    return blocks // compute_blocks_for_tokens(context_tokens, block_size)


class TierNeed(BaseModel):
    """What a workload needs on one tier against what the tier has (``capacity_bytes`` None: no tier)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    needed_bytes: int
    capacity_bytes: int | None
    sessions_fit: int | None
    fits: bool | None


class WorkloadNeeds(BaseModel):
    """``sessions`` concurrent sessions of ``context_tokens`` each, on every tier of the pool.

    HBM counts whole blocks on every GPU (replicated heads included); CPU and NVMe count what LMCache
    stores (:func:`compute_offload_bytes_per_token`). Tier capacities are per replica * replicas.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sessions: int
    context_tokens: int
    tokens: int
    logical_bytes: int
    replicas_needed: int
    hbm: TierNeed
    cpu: TierNeed
    nvme: TierNeed


def compute_workload_needs(
    arch: ModelArchitecture,
    capacity: ReplicaCapacity,
    *,
    sessions: int,
    context_tokens: int,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    cpu_tier_bytes_per_replica: int | None = None,
    nvme_tier_bytes_per_replica: int | None = None,
) -> WorkloadNeeds:
    """HBM / CPU / NVMe bytes to keep ``sessions * context_tokens`` cached, and whether each tier holds it."""
    if sessions < 0:
        raise SizingError(f"sessions must not be negative, got {sessions}")
    blocks_per_session = compute_blocks_for_tokens(context_tokens, block_size)
    per_replica = compute_sessions_that_fit(capacity.blocks_per_replica, context_tokens, block_size)
    hbm_fit = per_replica * capacity.replicas
    hbm = TierNeed(
        needed_bytes=sessions * blocks_per_session * capacity.bytes_per_block_per_replica,
        capacity_bytes=capacity.kv_bytes_pool,
        sessions_fit=hbm_fit,
        fits=sessions <= hbm_fit,
    )
    offload_session = context_tokens * compute_offload_bytes_per_token(
        arch, kv_cache_dtype, tensor_parallel, pipeline_parallel
    )

    def _tier(per_replica_bytes: int | None) -> TierNeed:
        if per_replica_bytes is None:
            return TierNeed(
                needed_bytes=sessions * offload_session, capacity_bytes=None, sessions_fit=None, fits=None
            )
        fit = (per_replica_bytes // offload_session) * capacity.replicas
        return TierNeed(
            needed_bytes=sessions * offload_session,
            capacity_bytes=per_replica_bytes * capacity.replicas,
            sessions_fit=fit,
            fits=sessions <= fit,
        )

    return WorkloadNeeds(
        sessions=sessions,
        context_tokens=context_tokens,
        tokens=sessions * context_tokens,
        logical_bytes=sessions * context_tokens * compute_kv_bytes_per_token(arch, kv_cache_dtype),
        replicas_needed=-(-sessions // per_replica) if per_replica else 0,
        hbm=hbm,
        cpu=_tier(cpu_tier_bytes_per_replica),
        nvme=_tier(nvme_tier_bytes_per_replica),
    )


class RestoreTimes(BaseModel):
    """Seconds to bring one session's KV back to the GPUs from each offload tier."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_tokens: int
    bytes_per_gpu: int
    offload_bytes: int
    pcie_gbps: float
    nvme_gbps: float
    cpu_seconds: float
    nvme_seconds: float


def compute_restore_times(
    arch: ModelArchitecture,
    *,
    context_tokens: int,
    kv_cache_dtype: str | KVCacheDtype = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    pcie_gbps: float | Fraction | str = DEFAULT_PCIE_GBPS,
    nvme_gbps: float | Fraction | str = DEFAULT_NVME_GBPS,
) -> RestoreTimes:
    """CPU restore: each GPU loads its shard over its own PCIe link (``bytes_per_gpu / pcie``); NVMe
    restore: the node's drives deliver what the replica stored (``offload_bytes / nvme``). GB/s = 10**9 B/s.
    """
    pcie = _as_fraction(pcie_gbps, "PCIe bandwidth")
    nvme = _as_fraction(nvme_gbps, "NVMe bandwidth")
    if pcie <= 0 or nvme <= 0:
        raise SizingError(f"bandwidths must be positive, got PCIe {pcie_gbps} GB/s and NVMe {nvme_gbps} GB/s")
    per_gpu = context_tokens * compute_kv_bytes_per_token_per_gpu(
        arch, kv_cache_dtype, tensor_parallel, pipeline_parallel
    )
    offload = context_tokens * compute_offload_bytes_per_token(
        arch, kv_cache_dtype, tensor_parallel, pipeline_parallel
    )
    return RestoreTimes(
        context_tokens=context_tokens,
        bytes_per_gpu=per_gpu,
        offload_bytes=offload,
        pcie_gbps=float(pcie),
        nvme_gbps=float(nvme),
        cpu_seconds=float(Fraction(per_gpu) / (pcie * GB)),
        nvme_seconds=float(Fraction(offload) / (nvme * GB)),
    )


# ------------------------------------------------------------------------------------------------ plan


class PlanRequest(BaseModel):
    """Everything ``kvfleet plan`` (and the operator's status computation) asks of the sizing math."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str
    architecture: ModelArchitecture
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    block_size: int = DEFAULT_BLOCK_SIZE
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpu_memory_bytes: int
    gpu_memory_utilization: Fraction = DEFAULT_GPU_MEMORY_UTILIZATION
    reserve_bytes_per_gpu: int = DEFAULT_RESERVE_BYTES_PER_GPU
    weight_bytes_per_gpu: int | None = None
    replicas: int = 1
    context_tokens: int | None = None
    sessions: int | None = None
    cpu_tier_bytes_per_replica: int | None = None
    nvme_tier_bytes_per_replica: int | None = None
    pcie_gbps: Fraction = DEFAULT_PCIE_GBPS
    nvme_gbps: Fraction = DEFAULT_NVME_GBPS

    @field_validator("gpu_memory_utilization", "pcie_gbps", "nvme_gbps", mode="before")
    @classmethod
    def _exact_ratio(cls, value: Any) -> Any:
        # 0.92 must mean 92/100, not the binary float's 0.9200000000000000399..., or floors drift.
        if isinstance(value, float | str):
            return _as_fraction(value, "ratio")
        return value


class PlanModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    attention: AttentionKind
    architecture: ModelArchitecture


class PlanEngine(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_cache_dtype: KVCacheDtype
    kv_cache_dtype_requested: KVCacheDtype
    kv_cache_dtype_bytes: int
    block_size: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus_per_replica: int
    replicas: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float


class PlanPerToken(BaseModel):
    """KV bytes of one token: logical (model-wide, once), on one GPU, summed over a replica, offloaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bytes: int
    bytes_per_gpu: int
    bytes_per_replica: int
    offload_bytes: int
    kv_heads_per_gpu: int
    layers_per_gpu: int


class PlanSessions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    context_tokens: int
    blocks_per_session: int
    per_replica: int
    pool: int


class Plan(BaseModel):
    """The planner's answer. ``model_dump(mode="json")`` is ``kvfleet plan --output json`` (stable keys)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: PlanModel
    engine: PlanEngine
    kv_per_token: PlanPerToken
    capacity: ReplicaCapacity
    sessions: PlanSessions | None
    workload: WorkloadNeeds | None
    restore: RestoreTimes | None


def build_plan(request: PlanRequest) -> Plan:
    """Run every sizing computation for one deployment shape; :class:`SizingError` on impossible input."""
    arch = request.architecture
    tp, pp = request.tensor_parallel, request.pipeline_parallel
    kv = request.kv_cache_dtype
    _check_parallel(arch, tp, pp)
    capacity = compute_replica_capacity(
        arch,
        gpu_memory_bytes=request.gpu_memory_bytes,
        kv_cache_dtype=kv,
        block_size=request.block_size,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        gpu_memory_utilization=request.gpu_memory_utilization,
        reserve_bytes_per_gpu=request.reserve_bytes_per_gpu,
        weight_bytes_per_gpu=request.weight_bytes_per_gpu,
        replicas=request.replicas,
    )
    sessions: PlanSessions | None = None
    restore: RestoreTimes | None = None
    workload: WorkloadNeeds | None = None
    context = request.context_tokens
    if request.sessions is not None and context is None:
        raise SizingError("--sessions needs --context (tokens per session)")
    if context is not None:
        per_replica = compute_sessions_that_fit(capacity.blocks_per_replica, context, request.block_size)
        sessions = PlanSessions(
            context_tokens=context,
            blocks_per_session=compute_blocks_for_tokens(context, request.block_size),
            per_replica=per_replica,
            pool=per_replica * request.replicas,
        )
        restore = compute_restore_times(
            arch,
            context_tokens=context,
            kv_cache_dtype=kv,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            pcie_gbps=request.pcie_gbps,
            nvme_gbps=request.nvme_gbps,
        )
        if request.sessions is not None:
            workload = compute_workload_needs(
                arch,
                capacity,
                sessions=request.sessions,
                context_tokens=context,
                kv_cache_dtype=kv,
                block_size=request.block_size,
                tensor_parallel=tp,
                pipeline_parallel=pp,
                cpu_tier_bytes_per_replica=request.cpu_tier_bytes_per_replica,
                nvme_tier_bytes_per_replica=request.nvme_tier_bytes_per_replica,
            )
    return Plan(
        model=PlanModel(name=request.model_name, attention=arch.attention_kind, architecture=arch),
        engine=PlanEngine(
            kv_cache_dtype=resolve_kv_cache_dtype(kv, arch.weight_dtype),
            kv_cache_dtype_requested=kv,
            kv_cache_dtype_bytes=kv_cache_dtype_bytes(kv, arch.weight_dtype),
            block_size=request.block_size,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            gpus_per_replica=tp * pp,
            replicas=request.replicas,
            gpu_memory_bytes=request.gpu_memory_bytes,
            gpu_memory_utilization=float(request.gpu_memory_utilization),
        ),
        kv_per_token=PlanPerToken(
            bytes=compute_kv_bytes_per_token(arch, kv),
            bytes_per_gpu=compute_kv_bytes_per_token_per_gpu(arch, kv, tp, pp),
            bytes_per_replica=compute_kv_bytes_per_token_per_replica(arch, kv, tp, pp),
            offload_bytes=compute_offload_bytes_per_token(arch, kv, tp, pp),
            kv_heads_per_gpu=compute_kv_heads_per_gpu(arch, tp),
            layers_per_gpu=compute_layers_per_gpu(arch, pp),
        ),
        capacity=capacity,
        sessions=sessions,
        workload=workload,
        restore=restore,
    )
