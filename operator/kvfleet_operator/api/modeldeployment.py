"""``ModelDeployment`` (kvfleet.io/v1alpha1, short name ``md``): a model and how to serve it.

The architecture block maps one to one onto ``kvfleet_runtime.kv.sizing.ModelArchitecture`` (same
field names in camelCase), so the operator can size the KV cache with the runtime's planner.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from kvfleet_operator.api.common import (
    DNS_SUBDOMAIN_PATTERN,
    GPU_GROUP_LABEL,
    CelRule,
    Conditions,
    CrdModel,
    ObjectName,
    cel_rules_schema,
)
from kvfleet_operator.api.units import (
    Duration,
    PositiveDuration,
    Quantity,
    ResourceQuantity,
    parse_duration,
    parse_quantity,
)

KIND_MODEL_DEPLOYMENT = "ModelDeployment"


class ArchitecturePreset(StrEnum):
    """Well-known public architectures the planner knows by name."""

    LLAMA_3_1_8B = "llama-3.1-8b"
    LLAMA_3_3_70B = "llama-3.3-70b"
    QWEN2_5_72B = "qwen2.5-72b"
    MIXTRAL_8X22B = "mixtral-8x22b"
    DEEPSEEK_V3 = "deepseek-v3"
    TINY_LLAMA = "tiny-llama"


class WeightDtype(StrEnum):
    """Data type of the model weights (sets weight bytes per parameter).

    Same values as ``kvfleet_runtime.kv.sizing.WeightDtype``.
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"


class KvCacheDtype(StrEnum):
    """vLLM ``--kv-cache-dtype``."""

    AUTO = "auto"
    FP8_E5M2 = "fp8_e5m2"
    FP8_E4M3 = "fp8_e4m3"


class SchedulingPolicy(StrEnum):
    """vLLM ``--scheduling-policy``."""

    PRIORITY = "priority"
    FCFS = "fcfs"


class TolerationOperator(StrEnum):
    """Kubernetes toleration operator."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    """Kubernetes taint effect."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


PosInt = Annotated[int, Field(ge=1)]

#: spec.pool.reservePerGpu: the planner's default
#: (``kvfleet_runtime.kv.sizing.DEFAULT_RESERVE_BYTES_PER_GPU``) as a quantity. Written out because the
#: API may not import the runtime's KV code; a unit test keeps the two equal.
DEFAULT_RESERVE_PER_GPU = "2Gi"
#: The extended resource a GPU engine requests unless spec.pool.gpuResource says otherwise.
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
#: spec.pool.cpuKvCacheSpace: whole GiB, because vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer.
CPU_KV_CACHE_SPACE_PATTERN = r"^[1-9][0-9]{0,4}Gi$"

# --- model --------------------------------------------------------------------------------------------


class LocalName(CrdModel):
    """A reference by name to an object in this namespace."""

    name: ObjectName = Field(description="Its name.")


class PvcSource(CrdModel):
    """Model files on a PersistentVolumeClaim in this namespace."""

    claim_name: ObjectName = Field(description="Name of the PersistentVolumeClaim that holds the model.")
    path: Annotated[
        str,
        Field(
            max_length=1024,
            pattern=r"^/?[^\x00]*$",
            description="Folder inside the claim that contains config.json and the weights, e.g. "
            "/models/qwen2.5-72b. Empty means the claim's root.",
        ),
    ] = ""


RULE_ONE_SOURCE = CelRule(
    rule="(has(self.huggingFace) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1",
    message="spec.model.source must set exactly one of huggingFace, pvc or uri",
)
#: vLLM loads object storage only by streaming it (``--load-format runai_streamer``), which reads s3:// and
#: gs://; https://, oci:// and file:// were accepted once and went to ``vllm --model`` as they were.
STREAMABLE_URI_SCHEMES = ("s3://", "gs://")
RULE_URI_STREAMABLE = CelRule(
    rule="!has(self.uri) || " + " || ".join(f"self.uri.startsWith('{s}')" for s in STREAMABLE_URI_SCHEMES),
    message="spec.model.source.uri must be s3://bucket/path or gs://bucket/path (vLLM streams those with "
    "its runai_streamer load format); for other places copy the weights to a PVC or use huggingFace",
    field_path=".uri",
)
RULE_CACHE_CLAIM_HF_ONLY = CelRule(
    rule="!has(self.cacheClaimName) || has(self.huggingFace)",
    message="spec.model.source.cacheClaimName is the cache of a huggingFace download: pvc and uri sources "
    "are read in place",
    field_path=".cacheClaimName",
)


class ModelSource(CrdModel):
    """Where the weights come from: exactly one of huggingFace, pvc, uri (docs/operations.md, "Model
    sources")."""

    model_config = {
        "json_schema_extra": cel_rules_schema(RULE_ONE_SOURCE, RULE_URI_STREAMABLE, RULE_CACHE_CLAIM_HF_ONLY)
    }

    hugging_face: Annotated[
        str | None,
        Field(
            max_length=256,
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
            description="Hugging Face model id, e.g. Qwen/Qwen2.5-72B-Instruct, at spec.model.revision. An "
            "init container downloads it into the model cache before the engine starts (vLLM then runs "
            "offline); the revision is resolved to a commit once and every replica sharing the cache "
            "serves that commit.",
        ),
    ] = None
    pvc: PvcSource | None = Field(default=None, description="Model files on a PersistentVolumeClaim.")
    uri: Annotated[
        str | None,
        Field(
            max_length=2048,
            pattern=r"^[a-z0-9]+://.+$",
            description="Object storage vLLM streams the safetensors from (load format runai_streamer): "
            "s3://bucket/path (S3 or an S3-compatible store) or gs://bucket/path.",
        ),
    ] = None
    credentials_secret_ref: LocalName | None = Field(
        default=None,
        description="Secret with the credentials to read the source, as environment variables of the step "
        "that reads it: HF_TOKEN (and optionally HF_ENDPOINT, a mirror) for huggingFace; AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and optionally AWS_ENDPOINT_URL, AWS_REGION for s3://; for gs:// the key "
        "credentials.json (a service account key), mounted as GOOGLE_APPLICATION_CREDENTIALS.",
    )
    cache_claim_name: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=253,
            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            description="huggingFace only: a ReadWriteMany PersistentVolumeClaim the pool's replicas share "
            "as the model cache, so the model is downloaded once for the pool. Without it each replica "
            "downloads into its own emptyDir (sized by the node's ephemeral storage).",
        ),
    ] = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if sum(x is not None for x in (self.hugging_face, self.pvc, self.uri)) != 1:
            raise ValueError(RULE_ONE_SOURCE.message)
        if self.uri is not None and not self.uri.startswith(STREAMABLE_URI_SCHEMES):
            raise ValueError(RULE_URI_STREAMABLE.message)
        if self.cache_claim_name is not None and self.hugging_face is None:
            raise ValueError(RULE_CACHE_CLAIM_HF_ONLY.message)
        return self


#: ``fromConfig`` is gone from the API (it was accepted and could never be admitted: the operator sizes the
#: pool before any engine starts). A manifest that still sets it is refused as an unknown field under
#: strict field validation (kubectl's default); a client that lets the API server prune it alone lands
#: here, so the message says what replaces it.
RULE_ARCH_ONE_WAY = CelRule(
    rule="(has(self.preset) ? 1 : 0) + (has(self.numLayers) ? 1 : 0) == 1",
    message="spec.model.architecture must use exactly one of preset or explicit fields (numLayers, "
    "numAttentionHeads, numKvHeads, headDim, hiddenSize); fromConfig is no longer a field: "
    "kvfleet plan --config-json config.json prints the explicit fields",
)
RULE_ARCH_EXPLICIT_COMPLETE = CelRule(
    rule="!has(self.numLayers) || (has(self.numAttentionHeads) && has(self.numKvHeads)"
    " && has(self.headDim) && has(self.hiddenSize) && has(self.numParameters) && has(self.weightDtype))",
    message="spec.model.architecture given explicitly needs numLayers, numAttentionHeads, numKvHeads, "
    "headDim, hiddenSize, numParameters and weightDtype",
)
RULE_ARCH_KV_HEADS = CelRule(
    rule="!has(self.numKvHeads) || !has(self.numAttentionHeads) || "
    "(self.numKvHeads <= self.numAttentionHeads && self.numAttentionHeads % self.numKvHeads == 0)",
    message="spec.model.architecture.numKvHeads must divide numAttentionHeads (1 for MQA, equal for MHA)",
    field_path=".numKvHeads",
)
RULE_ARCH_MLA_PAIR = CelRule(
    rule="has(self.kvLoraRank) == has(self.qkRopeHeadDim)",
    message="spec.model.architecture.kvLoraRank and qkRopeHeadDim go together (MLA): set both or neither",
    field_path=".kvLoraRank",
)
RULE_ARCH_EXPERTS = CelRule(
    rule="!has(self.numExpertsPerToken) || (has(self.numExperts) && "
    "self.numExpertsPerToken <= self.numExperts)",
    message="spec.model.architecture.numExpertsPerToken needs numExperts and must not exceed it",
    field_path=".numExpertsPerToken",
)
_EXPLICIT_FIELDS = (
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "num_parameters",
    "weight_dtype",
)


class ArchitectureSpec(CrdModel):
    """The model architecture, for KV sizing: a preset or explicit fields.

    Field names match ``kvfleet_runtime.kv.sizing.ModelArchitecture`` one to one.
    """

    model_config = {
        "json_schema_extra": cel_rules_schema(
            RULE_ARCH_ONE_WAY,
            RULE_ARCH_EXPLICIT_COMPLETE,
            RULE_ARCH_KV_HEADS,
            RULE_ARCH_MLA_PAIR,
            RULE_ARCH_EXPERTS,
        )
    }

    preset: ArchitecturePreset | None = Field(
        default=None,
        description="Name of a well-known architecture: llama-3.1-8b, llama-3.3-70b, qwen2.5-72b, "
        "mixtral-8x22b, deepseek-v3 or tiny-llama.",
    )
    num_layers: Annotated[
        int | None, Field(ge=1, le=1024, description="Number of transformer layers (num_hidden_layers).")
    ] = None
    num_attention_heads: Annotated[
        int | None, Field(ge=1, le=1024, description="Number of query attention heads.")
    ] = None
    num_kv_heads: Annotated[
        int | None,
        Field(ge=1, le=1024, description="Number of key/value heads (num_key_value_heads; 1 for MQA)."),
    ] = None
    head_dim: Annotated[int | None, Field(ge=1, le=4096, description="Size of one attention head.")] = None
    hidden_size: Annotated[int | None, Field(ge=1, le=1048576, description="Model hidden size.")] = None
    kv_lora_rank: Annotated[
        int | None,
        Field(
            ge=1, le=65536, description="MLA only: rank of the compressed KV latent (512 for DeepSeek-V3)."
        ),
    ] = None
    qk_rope_head_dim: Annotated[
        int | None,
        Field(ge=1, le=4096, description="MLA only: rotary part of the key per layer (64 for DeepSeek-V3)."),
    ] = None
    num_parameters: Annotated[
        int | None,
        Field(ge=1, description="Total parameter count, e.g. 72700000000; sets the weight memory."),
    ] = None
    weight_dtype: WeightDtype | None = Field(
        default=None,
        description="Data type of the weights: bfloat16, float16, float32, fp8, int8 or int4.",
    )
    num_experts: Annotated[
        int | None, Field(ge=1, le=4096, description="MoE only: number of routed experts per layer.")
    ] = None
    num_experts_per_token: Annotated[
        int | None, Field(ge=1, le=4096, description="MoE only: experts each token is routed to.")
    ] = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if int(self.preset is not None) + int(self.num_layers is not None) != 1:
            raise ValueError(RULE_ARCH_ONE_WAY.message)
        if self.num_layers is not None and any(getattr(self, name) is None for name in _EXPLICIT_FIELDS):
            raise ValueError(RULE_ARCH_EXPLICIT_COMPLETE.message)
        heads, kv_heads = self.num_attention_heads, self.num_kv_heads
        if heads is not None and kv_heads is not None and (kv_heads > heads or heads % kv_heads):
            raise ValueError(RULE_ARCH_KV_HEADS.message)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(RULE_ARCH_MLA_PAIR.message)
        if self.num_experts_per_token is not None and (
            self.num_experts is None or self.num_experts_per_token > self.num_experts
        ):
            raise ValueError(RULE_ARCH_EXPERTS.message)
        return self

    def to_sizing_fields(self) -> dict[str, Any]:
        """The explicit fields in snake_case, ready for ``kvfleet_runtime.kv.sizing.ModelArchitecture``
        (empty for preset architectures)."""
        fields = self.model_dump(exclude={"preset"}, exclude_none=True, mode="json")
        return fields if self.num_layers is not None else {}


class ModelSpec(CrdModel):
    """Which model to serve and under which name."""

    served_name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
            description="Model name clients put in the OpenAI request's model field, e.g. qwen2.5-72b.",
        ),
    ]
    source: ModelSource = Field(description="Where the weights come from.")
    revision: Annotated[
        str | None,
        Field(max_length=128, description="Revision (branch, tag or commit) of a Hugging Face model."),
    ] = None
    architecture: ArchitectureSpec = Field(
        description="Architecture for KV sizing: a preset or explicit fields."
    )


# --- engine -------------------------------------------------------------------------------------------

RULE_CHUNKED_PREFILL = CelRule(
    rule="(has(self.enableChunkedPrefill) && self.enableChunkedPrefill) || !has(self.maxNumBatchedTokens)"
    " || !has(self.maxModelLen) || self.maxNumBatchedTokens >= self.maxModelLen",
    message="spec.engine.maxNumBatchedTokens must be at least maxModelLen when chunked prefill is "
    "disabled: raise it or set enableChunkedPrefill: true",
    field_path=".maxNumBatchedTokens",
)
RULE_EXTRA_ARGS = CelRule(
    rule="self.all(a, a.startsWith('--') || !a.startsWith('-'))",
    message="spec.engine.extraArgs: long options only (--flag or --flag=value) and their values",
)


class EngineSpec(CrdModel):
    """How vLLM runs the model."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_CHUNKED_PREFILL)}

    image: Annotated[
        str | None,
        Field(
            max_length=512,
            pattern=r"^[^\s]+$",
            description="Container image of the engine (vLLM with the kvfleet plugin); it also runs the "
            "model download. Empty: the operator's default image. Another image must start with a prefix "
            "the platform allows (the chart's guardrails.images), else the ModelDeployment is refused "
            "(GuardrailRefused).",
        ),
    ] = None
    tensor_parallel_size: Annotated[
        int, Field(ge=1, le=64, description="GPUs that split each layer (vLLM --tensor-parallel-size).")
    ] = 1
    pipeline_parallel_size: Annotated[
        int, Field(ge=1, le=64, description="Pipeline stages (vLLM --pipeline-parallel-size).")
    ] = 1
    expert_parallel_size: Annotated[
        int, Field(ge=1, le=64, description="GPUs that split MoE experts; 1 disables expert parallelism.")
    ] = 1
    data_parallel_size: Annotated[
        int,
        Field(
            ge=1, le=64, description="Data-parallel attention ranks per replica (vLLM --data-parallel-size)."
        ),
    ] = 1
    max_model_len: Annotated[
        int | None,
        Field(ge=16, le=16777216, description="Longest context in tokens; empty: the model's own limit."),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="Fraction of each GPU's memory vLLM may use for weights, activations and KV cache.",
        ),
    ] = 0.9
    kv_cache_dtype: KvCacheDtype = Field(
        default=KvCacheDtype.AUTO,
        description="KV cache data type: auto (the model dtype), fp8_e5m2 (half the memory; recommended "
        "for long context) or fp8_e4m3 (half the memory; for code and math).",
    )
    block_size: Literal[16, 32, 64, 128] = Field(
        default=16,
        description="Tokens per KV block: 16, 32, 64 or 128 (CPU engines need a multiple of 32).",
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV of common prompt prefixes.")
    enable_chunked_prefill: bool = Field(
        default=True, description="Split long prompts into chunks scheduled with decode steps."
    )
    max_num_batched_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            le=16777216,
            description="Most tokens per scheduler step (e.g. 8192); empty: vLLM's default.",
        ),
    ] = None
    max_num_seqs: Annotated[
        int | None,
        Field(ge=1, le=65536, description="Most sequences per scheduler step; empty: vLLM's default."),
    ] = None
    scheduling_policy: SchedulingPolicy = Field(
        default=SchedulingPolicy.PRIORITY,
        description="priority (tenant tier sets request priority; the default) or fcfs.",
    )
    extra_args: Annotated[
        list[Annotated[str, Field(max_length=256)]],
        Field(
            max_length=64,
            description="More vLLM command-line arguments, appended verbatim, e.g. [--enforce-eager]. Only "
            "tuning flags (--max-num-seqs, --enforce-eager, --swap-space, --dtype, --quantization, "
            "--tool-call-parser, ... the list is in docs/security.md) and those the platform adds (the "
            "chart's guardrails.engineArgs); never a flag the operator sets (vLLM keeps the last). Others "
            "refuse the ModelDeployment (GuardrailRefused).",
            json_schema_extra={"x-kubernetes-list-type": "atomic", **cel_rules_schema(RULE_EXTRA_ARGS)},
        ),
    ] = []

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (
            not self.enable_chunked_prefill
            and self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(RULE_CHUNKED_PREFILL.message)
        if any(arg.startswith("-") and not arg.startswith("--") for arg in self.extra_args):
            raise ValueError(RULE_EXTRA_ARGS.message)
        return self


# --- KV cache tiers -----------------------------------------------------------------------------------

RULE_NVME_ONE_STORAGE = CelRule(
    rule="has(self.storageClassName) != has(self.hostPath)",
    message="spec.kvCache.nvme must set exactly one of storageClassName or hostPath",
)


class NvmeTier(CrdModel):
    """LMCache's NVMe (local disk) tier."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_NVME_ONE_STORAGE)}

    size: Quantity = Field(description="Disk space per replica for KV, e.g. 2Ti.")
    storage_class_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            description="StorageClass of the per-replica volume (local NVMe), e.g. local-nvme. The volumes "
            "are deleted with their pool: no KV outlives it.",
        ),
    ] = None
    host_path: Annotated[
        str | None,
        Field(
            max_length=1024,
            pattern=r"^/.*$",
            description="Absolute node path to an NVMe mount, e.g. /mnt/nvme: one of the roots the platform "
            "allows, or a folder under one (the chart's guardrails.hostPathRoots; none by default, and then "
            "the ModelDeployment is refused: GuardrailRefused). Each pool mounts only "
            "<hostPath>/<namespace>/<modelDeployment>/<pool> (created if missing), each replica writes in "
            "its <pod> folder there. A hostPath volume needs the privileged Pod Security level (baseline "
            "and restricted refuse it), and its files stay on the node when the pool or tenant is deleted: "
            "prefer storageClassName, whose volumes go with the pool.",
        ),
    ] = None

    @model_validator(mode="after")
    def _one_storage(self) -> Self:
        if (self.storage_class_name is None) == (self.host_path is None):
            raise ValueError(RULE_NVME_ONE_STORAGE.message)
        return self


#: An enabled shared tier needs a size: a quantity with a non-zero digit (``0``, ``0Gi``, ``0.0`` have none).
RULE_SHARED_TIER_SIZE = CelRule(
    rule="!self.enabled || string(self.size).matches('[1-9]')",
    message="spec.kvCache.shared.size must be more than 0 when the shared tier is enabled, e.g. 512Gi",
    field_path=".size",
)


class SharedTier(CrdModel):
    """A KV tier all replicas of the shared pool reach: one server for the pool (``kvfleet engine
    shared-tier``), every replica's LMCache stores its chunks there and reads from there what its own tiers
    miss. Per-salt quotas and TTLs are the tenants' CPU-tier ones; dedicated pools never use it."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_SHARED_TIER_SIZE)}

    enabled: bool = Field(default=False, description="true: run one shared KV tier server for the pool.")
    size: Quantity = Field(
        default="0", description="Memory of the shared tier (the server's memory request), e.g. 512Gi."
    )

    @model_validator(mode="after")
    def _sized_when_enabled(self) -> Self:
        if self.enabled and parse_quantity(self.size) <= 0:
            raise ValueError(RULE_SHARED_TIER_SIZE.message)
        return self


RULE_TTL_ORDER = CelRule(
    rule="!has(self.hbm) || !has(self.cpu) || !has(self.nvme) || "
    "(duration(self.hbm) <= duration(self.cpu) && duration(self.cpu) <= duration(self.nvme))",
    message="spec.kvCache.ttl must satisfy hbm <= cpu <= nvme (KV moves to slower tiers as it ages)",
)


class DefaultTtls(CrdModel):
    """Default idle time after which KV on a tier becomes the first eviction candidate."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_TTL_ORDER)}

    hbm: PositiveDuration = Field(default="30s", description="GPU memory TTL, e.g. 30s.")
    cpu: PositiveDuration = Field(default="10m", description="CPU memory (LMCache L1) TTL, e.g. 10m.")
    nvme: PositiveDuration = Field(default="24h", description="NVMe (LMCache L2) TTL, e.g. 24h.")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        hbm, cpu, nvme = (parse_duration(x) for x in (self.hbm, self.cpu, self.nvme))
        if not hbm <= cpu <= nvme:
            raise ValueError(RULE_TTL_ORDER.message)
        return self


class KvCacheSpec(CrdModel):
    """LMCache tiers behind vLLM's GPU KV cache, and default TTLs per tier."""

    cpu_size: Quantity = Field(
        default="0", description="LMCache CPU memory tier per replica, e.g. 256Gi; 0 disables it."
    )
    nvme: NvmeTier | None = Field(default=None, description="LMCache NVMe tier; omit for none.")
    shared: SharedTier | None = Field(
        default=None, description="A KV tier shared by all replicas of the shared pool; omit for none."
    )
    chunk_size: Annotated[
        int, Field(ge=16, le=4096, description="Tokens per LMCache chunk (LMCache chunk_size), e.g. 256.")
    ] = 256
    ttl: DefaultTtls = Field(
        default_factory=DefaultTtls,
        description="Default TTLs per tier; a Tenant may override them.",
        json_schema_extra={"default": {}},
    )


# --- pool and gateway ---------------------------------------------------------------------------------


class Toleration(CrdModel):
    """A Kubernetes toleration for the engine pods."""

    key: Annotated[str, Field(max_length=316, description="Taint key, e.g. nvidia.com/gpu.")] = ""
    operator: TolerationOperator = Field(default=TolerationOperator.EQUAL, description="Exists or Equal.")
    value: Annotated[str, Field(max_length=63, description="Taint value (Equal only).")] = ""
    effect: TaintEffect | None = Field(
        default=None, description="NoSchedule, PreferNoSchedule or NoExecute; empty matches all."
    )
    toleration_seconds: Annotated[
        int | None, Field(ge=0, description="NoExecute only: how long the pod stays after the taint appears.")
    ] = None


# --- engine pod template ------------------------------------------------------------------------------
# What a user may add to the engine pods, merged over what the operator builds (build/engine.py). The
# fields that carry isolation or security are refused here, by CEL in the CRD and by the same check in
# pydantic (and again in the builder): each refusal names the field and why. One place for each list.

#: Label prefixes the operator owns: the NetworkPolicies, Services, PDBs and the operator's own lists
#: select engine pods by these labels, so a pod template may not set or change them.
RESERVED_LABEL_PREFIXES = ("kvfleet.io/", "app.kubernetes.io/")
#: Annotation prefixes that change a pod's security profile (legacy seccomp and AppArmor annotations) or
#: that the operator owns.
RESERVED_ANNOTATION_PREFIXES = (
    "kvfleet.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
    "container.apparmor.security.beta.kubernetes.io/",
)
#: Environment a pod template may not set: what the operator and the launcher own (the tenant table, keys
#: and pool of the tenant-aware block pool, KVFLEET_*; whether that plugin loads at all, VLLM_PLUGINS;
#: LMCache's settings, bind addresses and tiers, LMCACHE_*; the CPU KV space, spec.pool.cpuKvCacheSpace),
#: and what makes the engine run other code or act otherwise than the operator set it up: the dynamic
#: loader (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT: LD_*), the interpreter (PYTHONPATH, PYTHONSTARTUP,
#: PYTHONWARNINGS and PYTHONBREAKPOINT import modules: PYTHON*), PATH and BASH_ENV, going online for the
#: model (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE: the engine serves the commit fetched before it started)
#: and vLLM's switches for development endpoints, a logging config file (which can instantiate any class),
#: insecure deserialisation, runtime LoRA loading, another model hub, profiler traces and logged responses.
RESERVED_ENV_NAMES = (
    "VLLM_PLUGINS",
    "VLLM_CPU_KVCACHE_SPACE",
    "PATH",
    "BASH_ENV",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_USE_MODELSCOPE",
    "VLLM_TORCH_PROFILER_DIR",
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "VLLM_HOST_IP",
    "VLLM_PORT",
)
RESERVED_ENV_PREFIXES = ("KVFLEET_", "LMCACHE_", "LD_", "PYTHON")
#: Pod fields a template may never set, and why (the message of each refusal).
FORBIDDEN_POD_FIELDS: dict[str, str] = {
    "securityContext": "engine pods run under the restricted Pod Security level (non-root, no "
    "privilege escalation, all capabilities dropped, RuntimeDefault seccomp)",
    "hostNetwork": "a pod on the host network bypasses the NetworkPolicies that keep everyone but the "
    "gateway off the engines",
    "hostPID": "the host's processes would see the engine's memory, which holds every tenant's KV",
    "hostIPC": "the host's shared memory would expose LMCache's KV segments of every tenant",
    "serviceAccountName": "engine pods hold no Kubernetes API credentials",
    "automountServiceAccountToken": "engine pods hold no Kubernetes API credentials",
    "volumes": "the operator mounts the tenant table and the salt key; more volumes could expose or "
    "replace them (use envFrom for settings, spec.model.source for weights)",
    "nodeName": "a pod bound to a node skips the scheduler and so the dedicated GPU groups' taints",
}


def _prefix_rule(var: str, prefixes: tuple[str, ...]) -> str:
    return " && ".join(f"!{var}.startsWith('{p}')" for p in prefixes)


RULE_POD_LABELS = CelRule(
    rule="self.all(k, " + _prefix_rule("k", RESERVED_LABEL_PREFIXES) + ")",
    message="spec.pool.podTemplate.labels may not use the kvfleet.io/ or app.kubernetes.io/ prefixes: the "
    "NetworkPolicies and Services select engine pods by those labels (isolation)",
)
RULE_POD_ANNOTATIONS = CelRule(
    rule="self.all(k, " + _prefix_rule("k", RESERVED_ANNOTATION_PREFIXES) + ")",
    message="spec.pool.podTemplate.annotations may not use kvfleet.io/ or the seccomp/AppArmor annotation "
    "prefixes: they would change the engine pods' security profile",
)
_ENV_NAMES_CEL = ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES)
RULE_POD_ENV = CelRule(
    rule=f"self.all(e, !(e.name in [{_ENV_NAMES_CEL}]) && "
    + _prefix_rule("e.name", RESERVED_ENV_PREFIXES)
    + ")",
    message="spec.pool.podTemplate.env may not set "
    + ", ".join(RESERVED_ENV_NAMES)
    + " or names starting with "
    + ", ".join(RESERVED_ENV_PREFIXES)
    + ": they carry the tenant table, the tenant-aware block pool and LMCache's isolation, or load other "
    "code into the engine (set the CPU KV space with spec.pool.cpuKvCacheSpace)",
)
_RESERVED_CEL = ", ".join(f"'{n}'" for n in (*RESERVED_ENV_NAMES, *RESERVED_ENV_PREFIXES))
#: envFrom's keys are known only when the pod starts, so nothing can check them here: every entry needs a
#: prefix under which no reserved name can be spelled.
RULE_POD_ENV_FROM = CelRule(
    rule="self.all(e, has(e.prefix) && e.prefix != '' && "
    f"[{_RESERVED_CEL}].all(r, !r.startsWith(e.prefix)) && "
    + _prefix_rule("e.prefix", RESERVED_ENV_PREFIXES)
    + ")",
    message="spec.pool.podTemplate.envFrom: every entry needs a prefix (e.g. APP_) that no reserved "
    "environment name starts with and that starts with none of "
    + ", ".join(RESERVED_ENV_PREFIXES)
    + ": the keys of a ConfigMap or Secret are known only when the pod starts, and one named like a "
    "reserved variable (LMCACHE_*, LD_PRELOAD) would reach the engine",
)


def env_from_prefix_ok(prefix: str | None) -> bool:
    """Whether an envFrom ``prefix`` keeps every key it brings off the reserved names
    (``RULE_POD_ENV_FROM``)."""
    return (
        bool(prefix)
        and not any(r.startswith(prefix or "") for r in (*RESERVED_ENV_NAMES, *RESERVED_ENV_PREFIXES))
        and not (prefix or "").startswith(RESERVED_ENV_PREFIXES)
    )


RULES_FORBIDDEN_POD_FIELDS = tuple(
    CelRule(
        rule=f"!has(self.{name})",
        message=f"spec.pool.podTemplate.{name} cannot be set: {why}",
        field_path=f".{name}",
        reason="FieldValueForbidden",
    )
    for name, why in FORBIDDEN_POD_FIELDS.items()
)


def _gpu_group_expressions_rule(var: str) -> str:
    return f"!has({var}.matchExpressions) || {var}.matchExpressions.all(e, e.key != '{GPU_GROUP_LABEL}')"


RULE_AFFINITY_NO_GPU_GROUP = CelRule(
    rule="(!has(self.requiredDuringSchedulingIgnoredDuringExecution) || "
    "self.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.all(t, "
    + _gpu_group_expressions_rule("t")
    + ")) && (!has(self.preferredDuringSchedulingIgnoredDuringExecution) || "
    "self.preferredDuringSchedulingIgnoredDuringExecution.all(p, "
    + _gpu_group_expressions_rule("p.preference")
    + "))",
    message=f"spec.pool.podTemplate.affinity.nodeAffinity may not name {GPU_GROUP_LABEL}: the operator "
    "places engine pods on or off the dedicated GPU groups (a group belongs to one Tenant)",
)

EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]


class KeySelector(CrdModel):
    """A key of a Secret or ConfigMap in this namespace."""

    name: ObjectName = Field(description="Name of the Secret or ConfigMap.")
    key: Annotated[str, Field(min_length=1, max_length=253, description="The key to read.")]
    optional: bool | None = Field(default=None, description="true: the pod starts without it.")


class FieldSelector(CrdModel):
    """A field of the pod (downward API)."""

    field_path: Annotated[str, Field(min_length=1, max_length=253, description="e.g. status.podIP.")]


def _exactly_one_rule(path: str, fields: tuple[str, ...]) -> CelRule:
    count = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)
    return CelRule(rule=f"{count} == 1", message=f"{path} must set exactly one of {', '.join(fields)}")


RULE_ENV_SOURCE_ONE = _exactly_one_rule(
    "spec.pool.podTemplate.env[].valueFrom", ("secretKeyRef", "configMapKeyRef", "fieldRef")
)
RULE_ENV_VALUE_OR_FROM = CelRule(
    rule="!(has(self.value) && has(self.valueFrom))",
    message="spec.pool.podTemplate.env[]: set value or valueFrom, not both",
)
RULE_ENV_FROM_ONE = _exactly_one_rule("spec.pool.podTemplate.envFrom[]", ("configMapRef", "secretRef"))


class EnvVarSource(CrdModel):
    """Where an environment variable's value comes from: exactly one of the fields."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ENV_SOURCE_ONE)}

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")

    @model_validator(mode="after")
    def _one(self) -> Self:
        if sum(x is not None for x in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError(RULE_ENV_SOURCE_ONE.message)
        return self


class EnvVar(CrdModel):
    """One environment variable of the engine container (same shape as in a pod spec)."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ENV_VALUE_OR_FROM)}

    name: EnvName = Field(description="Variable name, e.g. HF_HUB_ENABLE_HF_TRANSFER.")
    value: Annotated[str | None, Field(max_length=32768, description="Literal value.")] = None
    value_from: EnvVarSource | None = Field(
        default=None, description="Value from a Secret, ConfigMap or field."
    )

    @model_validator(mode="after")
    def _value_or_from(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError(RULE_ENV_VALUE_OR_FROM.message)
        return self


class NameReference(CrdModel):
    """A Secret or ConfigMap in this namespace."""

    name: ObjectName = Field(description="Its name.")
    optional: bool | None = Field(default=None, description="true: the pod starts without it.")


class EnvFromSource(CrdModel):
    """All keys of a Secret or ConfigMap as environment variables (same shape as in a pod spec). The
    variables the operator sets win over these (Kubernetes gives env precedence over envFrom)."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ENV_FROM_ONE)}

    prefix: Annotated[
        str | None,
        Field(
            max_length=128,
            pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
            description="Prefix for every variable name, e.g. APP_; required, and no reserved name may start "
            "with it.",
        ),
    ] = None
    config_map_ref: NameReference | None = Field(default=None, description="A ConfigMap.")
    secret_ref: NameReference | None = Field(default=None, description="A Secret.")

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError(RULE_ENV_FROM_ONE.message)
        return self


class NodeSelectorRequirement(CrdModel):
    """A node label requirement (Kubernetes NodeSelectorRequirement)."""

    key: Annotated[str, Field(min_length=1, max_length=316, description="Node label key.")]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt."
    )
    values: Annotated[
        list[Annotated[str, Field(max_length=63)]],
        Field(max_length=64, description="Values for In, NotIn, Gt and Lt."),
    ] = []


class NodeSelectorTerm(CrdModel):
    """Requirements that must all hold (Kubernetes NodeSelectorTerm)."""

    match_expressions: Annotated[
        list[NodeSelectorRequirement], Field(max_length=32, description="Node label requirements.")
    ] = []
    match_fields: Annotated[
        list[NodeSelectorRequirement], Field(max_length=32, description="Node field requirements.")
    ] = []


class NodeSelector(CrdModel):
    """Terms of which at least one must hold (Kubernetes NodeSelector)."""

    node_selector_terms: Annotated[
        list[NodeSelectorTerm], Field(min_length=1, max_length=16, description="The terms (ORed).")
    ]


class PreferredSchedulingTerm(CrdModel):
    """A weighted preference (Kubernetes PreferredSchedulingTerm)."""

    weight: Annotated[int, Field(ge=1, le=100, description="Weight of this preference, 1-100.")]
    preference: NodeSelectorTerm = Field(description="The preferred nodes.")


class NodeAffinity(CrdModel):
    """Node affinity (Kubernetes NodeAffinity). The operator's own required terms (GPU groups) are added
    to every required term given here."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_AFFINITY_NO_GPU_GROUP)}

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes the pods must run on (combined with the operator's terms)."
    )
    preferred_during_scheduling_ignored_during_execution: Annotated[
        list[PreferredSchedulingTerm], Field(max_length=16, description="Nodes the pods prefer.")
    ] = []

    @model_validator(mode="after")
    def _no_gpu_group(self) -> Self:
        required = self.required_during_scheduling_ignored_during_execution
        terms = [*(required.node_selector_terms if required else [])]
        terms += [p.preference for p in self.preferred_during_scheduling_ignored_during_execution]
        if any(e.key == GPU_GROUP_LABEL for t in terms for e in t.match_expressions):
            raise ValueError(RULE_AFFINITY_NO_GPU_GROUP.message)
        return self


_OPEN_OBJECT: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


class Affinity(CrdModel):
    """Scheduling affinity of the engine pods (Kubernetes Affinity)."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: dict[str, Any] | None = Field(
        default=None,
        description="Pod affinity (Kubernetes PodAffinity), as in a pod spec.",
        json_schema_extra=_OPEN_OBJECT,
    )
    pod_anti_affinity: dict[str, Any] | None = Field(
        default=None,
        description="Pod anti-affinity (Kubernetes PodAntiAffinity), e.g. one replica per node.",
        json_schema_extra=_OPEN_OBJECT,
    )


ResourceMap = Annotated[
    dict[str, ResourceQuantity],
    Field(max_length=16, description="Resource name -> quantity, e.g. cpu: '8', memory: 64Gi."),
]


class EngineResources(CrdModel):
    """Requests and limits of the engine container, over the operator's defaults. Memory is the engine's
    own: the operator adds the LMCache CPU tier (spec.kvCache.cpuSize) and, on a CPU engine,
    spec.pool.cpuKvCacheSpace to the memory request (and to a memory limit when one is set), so the
    scheduler sees them. The GPU count comes from spec.pool.gpusPerReplica."""

    requests: ResourceMap = {}
    limits: ResourceMap = {}

    @model_validator(mode="after")
    def _memory_in_bytes(self) -> Self:
        # The operator adds the tiers to memory: it must be a byte count (no milli suffix).
        for amounts in (self.requests, self.limits):
            if "memory" in amounts:
                parse_quantity(amounts["memory"])
        return self


def _template_fields_rules() -> dict[str, Any]:
    return cel_rules_schema(*RULES_FORBIDDEN_POD_FIELDS)


class PodTemplate(CrdModel):
    """Settings merged over the engine pods the operator builds (the KServe-like subset of a pod spec).

    nodeSelector and tolerations are spec.pool's (additions to the operator's own). Fields that carry
    isolation or security (securityContext, hostNetwork, hostPID, hostIPC, serviceAccountName,
    automountServiceAccountToken, volumes, nodeName, kvfleet labels, the dedicated groups' node
    affinity) are refused with the reason.
    """

    model_config = {"json_schema_extra": _template_fields_rules()}

    labels: Annotated[
        dict[str, Annotated[str, Field(max_length=63)]],
        Field(
            max_length=32,
            description="More labels on the engine pods (not kvfleet.io/ or app.kubernetes.io/).",
            json_schema_extra=cel_rules_schema(RULE_POD_LABELS),
        ),
    ] = {}
    annotations: Annotated[
        dict[str, Annotated[str, Field(max_length=4096)]],
        Field(
            max_length=32,
            description="More annotations on the engine pods (not kvfleet.io/, seccomp or AppArmor).",
            json_schema_extra=cel_rules_schema(RULE_POD_ANNOTATIONS),
        ),
    ] = {}
    resources: EngineResources = Field(
        default_factory=EngineResources,
        description="Requests and limits of the engine container (defaults: 4 CPUs and 32Gi on GPU "
        "engines, 1 CPU and 4Gi on CPU engines, plus the LMCache CPU tier).",
        json_schema_extra={"default": {}},
    )
    env: Annotated[
        list[EnvVar],
        Field(
            max_length=64,
            description="More environment of the engine container; not the reserved names ("
            + ", ".join(RESERVED_ENV_NAMES)
            + ") nor names starting with "
            + ", ".join(RESERVED_ENV_PREFIXES)
            + ".",
            json_schema_extra={"x-kubernetes-list-type": "atomic", **cel_rules_schema(RULE_POD_ENV)},
        ),
    ] = []
    env_from: Annotated[
        list[EnvFromSource],
        Field(
            max_length=16,
            description="Secrets or ConfigMaps whose keys become environment variables, each under a "
            "prefix (e.g. APP_) that no reserved name starts with: the keys are known only when the pod "
            "starts.",
            json_schema_extra={"x-kubernetes-list-type": "atomic", **cel_rules_schema(RULE_POD_ENV_FROM)},
        ),
    ] = []
    runtime_class_name: Annotated[
        str | None,
        Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="RuntimeClass, e.g. nvidia."),
    ] = None
    priority_class_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=DNS_SUBDOMAIN_PATTERN,
            description="PriorityClass: one the platform allows (the chart's guardrails.priorityClassNames; "
            "by default any but system-*).",
        ),
    ] = None
    affinity: Affinity | None = Field(default=None, description="Scheduling affinity.")
    image_pull_secrets: Annotated[
        list[LocalName],
        Field(
            max_length=16,
            description="Secrets for pulling the engine image from a private registry.",
            json_schema_extra={"x-kubernetes-list-type": "atomic"},
        ),
    ] = []
    # Refused fields (FORBIDDEN_POD_FIELDS): declared so that a manifest setting one is refused with the
    # reason instead of silently pruned.
    security_context: dict[str, Any] | None = Field(
        default=None,
        description="Refused: " + FORBIDDEN_POD_FIELDS["securityContext"] + ".",
        json_schema_extra=_OPEN_OBJECT,
    )
    host_network: bool | None = Field(
        default=None, description="Refused: " + FORBIDDEN_POD_FIELDS["hostNetwork"] + "."
    )
    host_pid: bool | None = Field(
        default=None, alias="hostPID", description="Refused: " + FORBIDDEN_POD_FIELDS["hostPID"] + "."
    )
    host_ipc: bool | None = Field(
        default=None, alias="hostIPC", description="Refused: " + FORBIDDEN_POD_FIELDS["hostIPC"] + "."
    )
    service_account_name: Annotated[
        str | None,
        Field(max_length=253, description="Refused: " + FORBIDDEN_POD_FIELDS["serviceAccountName"] + "."),
    ] = None
    automount_service_account_token: bool | None = Field(
        default=None, description="Refused: " + FORBIDDEN_POD_FIELDS["automountServiceAccountToken"] + "."
    )
    volumes: Annotated[
        list[dict[str, Any]] | None,
        Field(
            max_length=16,
            description="Refused: " + FORBIDDEN_POD_FIELDS["volumes"] + ".",
            json_schema_extra={"items": {"type": "object", **_OPEN_OBJECT}},
        ),
    ] = None
    node_name: Annotated[
        str | None, Field(max_length=253, description="Refused: " + FORBIDDEN_POD_FIELDS["nodeName"] + ".")
    ] = None

    @model_validator(mode="after")
    def _nothing_reserved(self) -> Self:
        problems = check_pod_template(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def check_pod_template(template: PodTemplate) -> list[str]:
    """Every reason ``template`` may not be merged over an engine pod (empty: it may). The one check the
    model validator and the builder (``build/engine.py``) both run, with the CEL rules' messages."""
    problems = [
        rule.message
        for rule in RULES_FORBIDDEN_POD_FIELDS
        if template.model_dump(by_alias=True).get(rule.field_path.lstrip(".") if rule.field_path else "")
        is not None
    ]
    if any(k.startswith(RESERVED_LABEL_PREFIXES) for k in template.labels):
        problems.append(RULE_POD_LABELS.message)
    if any(k.startswith(RESERVED_ANNOTATION_PREFIXES) for k in template.annotations):
        problems.append(RULE_POD_ANNOTATIONS.message)
    if any(e.name in RESERVED_ENV_NAMES or e.name.startswith(RESERVED_ENV_PREFIXES) for e in template.env):
        problems.append(RULE_POD_ENV.message)
    if not all(env_from_prefix_ok(e.prefix) for e in template.env_from):
        problems.append(RULE_POD_ENV_FROM.message)
    return problems


RULE_GPUS_MATCH_PARALLELISM = CelRule(
    rule="self.pool.gpusPerReplica == 0 || self.pool.gpusPerReplica == "
    "self.engine.tensorParallelSize * self.engine.pipelineParallelSize * self.engine.dataParallelSize",
    message="spec.pool.gpusPerReplica must equal tensorParallelSize x pipelineParallelSize x "
    "dataParallelSize of spec.engine (or 0 for a CPU engine)",
    field_path=".pool.gpusPerReplica",
)
RULE_CPU_KV_SPACE = CelRule(
    rule="!has(self.cpuKvCacheSpace) || self.gpusPerReplica == 0",
    message="spec.pool.cpuKvCacheSpace applies only to CPU engines: set gpusPerReplica: 0 or remove it",
    field_path=".cpuKvCacheSpace",
)
RULE_TEMPLATE_NO_GPU_RESOURCE = CelRule(
    rule="!has(self.podTemplate) || !has(self.podTemplate.resources) || "
    + " && ".join(
        f"(!has(self.podTemplate.resources.{m}) || !(self.gpuResource in self.podTemplate.resources.{m}))"
        for m in ("requests", "limits")
    ),
    message="spec.pool.podTemplate.resources may not name the GPU resource (spec.pool.gpuResource): "
    "spec.pool.gpusPerReplica sets it, to match the engine's parallelism",
    field_path=".podTemplate.resources",
)
RULE_POOL_SELECTS_NO_GPU_GROUP = CelRule(
    rule=f"!has(self.nodeSelector) || !('{GPU_GROUP_LABEL}' in self.nodeSelector)",
    message=f"spec.pool.nodeSelector may not name {GPU_GROUP_LABEL}: a dedicated GPU group belongs to one "
    "Tenant (isolation: dedicated, spec.dedicated.gpuGroup)",
    field_path=".nodeSelector",
)
RULE_POOL_TOLERATES_NO_GPU_GROUP = CelRule(
    rule=f"!has(self.tolerations) || self.tolerations.all(t, !has(t.key) || t.key != '{GPU_GROUP_LABEL}')",
    message=f"spec.pool.tolerations may not tolerate {GPU_GROUP_LABEL}: a dedicated GPU group belongs to one "
    "Tenant (isolation: dedicated, spec.dedicated.gpuGroup)",
    field_path=".tolerations",
)


#: How long after an evicted engine pod's deletion grace period ended the operator waits before it
#: force-deletes the pod (``spec.pool.nodeLoss.after``): long enough for a kubelet that is only slow to
#: confirm the deletion itself, short enough that the replica is back in minutes.
DEFAULT_NODE_LOSS_AFTER = "60s"


class NodeLossSpec(CrdModel):
    """What the operator does with an engine pod whose node was lost (``reconcile/node_loss.py``)."""

    replace: bool = Field(
        default=True,
        description="Force-delete an engine pod that the node lifecycle controller evicted from an "
        "unreachable node once its deletion grace period plus `after` has passed, so its StatefulSet starts "
        "the replacement on another node (an engine holds no durable state and the evicted pod is already "
        "out of the Service). false keeps StatefulSet's at-most-one guarantee: the pod stays Terminating "
        "until someone confirms the node is gone (the node.kubernetes.io/out-of-service taint). Pods with "
        "an NVMe claim (kvCache.nvme.storageClassName) are never force-deleted: a local volume cannot "
        "move; the operator says so in an Event.",
    )
    after: Duration = Field(
        default=DEFAULT_NODE_LOSS_AFTER,
        description="How long after the evicted pod's deletion grace period ended the operator waits "
        "before it force-deletes the pod, e.g. 60s.",
    )


# The has() guards: the API server also checks the rules against the field's default ({}), before defaulting.
RULE_AUTOSCALING_BOUNDS = CelRule(
    rule="(!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas) && "
    "(!has(self.bestEffortMaxReplicas) || "
    "((!has(self.minReplicas) || self.minReplicas <= self.bestEffortMaxReplicas) && "
    "(!has(self.maxReplicas) || self.bestEffortMaxReplicas <= self.maxReplicas)))",
    message="spec.pool.autoscaling must satisfy minReplicas <= bestEffortMaxReplicas <= maxReplicas",
)
RULE_AUTOSCALING_PROMETHEUS = CelRule(
    rule="!has(self.enabled) || !self.enabled || has(self.prometheusAddress)",
    message="spec.pool.autoscaling.prometheusAddress is required when autoscaling is enabled: KEDA reads "
    "the pool's signals from that Prometheus, e.g. http://prometheus-operated.monitoring:9090",
    field_path=".prometheusAddress",
    reason="FieldValueRequired",
)
#: Prometheus' HTTP API, as KEDA's prometheus trigger takes it (``serverAddress``).
PROMETHEUS_ADDRESS_PATTERN = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"


class QueueTargets(CrdModel):
    """Requests the gateway may hold for the pool's saturated engines per replica, by SLA tier (its
    ``kvfleet_gateway_engine_queue_depth``): the pool is sized for the tier's queue divided by its target.
    0 turns a tier's signal off."""

    premium: Annotated[
        int, Field(ge=0, le=100000, description="Queued premium requests per replica, e.g. 2 (0: off).")
    ] = 2
    standard: Annotated[
        int, Field(ge=0, le=100000, description="Queued standard requests per replica, e.g. 4 (0: off).")
    ] = 4
    basic: Annotated[
        int,
        Field(
            ge=0,
            le=100000,
            description="Queued basic (best-effort) requests per replica, e.g. 8 (0: off); this load alone "
            "scales the pool up to bestEffortMaxReplicas only.",
        ),
    ] = 8


class TtftSignal(CrdModel):
    """The 99th percentile time to first token of one tier's requests at the gateway (over 2 minutes)."""

    tier: Literal["premium", "standard", "basic"] = Field(
        default="premium",
        description="The SLA tier whose objective it is (the tightest one, usually premium).",
    )
    p99_seconds: Annotated[
        float,
        Field(
            gt=0,
            le=600,
            description="The objective: above it the pool grows in proportion (HPA Value target), e.g. 0.5.",
        ),
    ]


class AutoscalingSignals(CrdModel):
    """What KEDA reads from Prometheus to size the pool; the HPA follows whichever asks for most replicas."""

    queue_per_replica: QueueTargets = Field(
        default_factory=QueueTargets,
        description="Queue depth per replica, by SLA tier.",
        json_schema_extra={"default": {}},
    )
    kv_usage: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="The fraction of the pool's GPU-memory KV blocks held by running requests to keep "
            "(the engines' kvfleet_engine_kv_pool_used_blocks over kvfleet_engine_kv_pool_blocks): above it "
            "the pool grows in proportion, e.g. 0.9. 0: KV use does not scale the pool.",
        ),
    ] = 0.9
    ttft: TtftSignal | None = Field(
        default=None, description="A time-to-first-token objective that scales the pool when missed."
    )


class PoolAutoscaling(CrdModel):
    """Autoscaling of the shared pool through KEDA: the operator renders a ScaledObject whose HPA writes
    spec.pool.replicas through the ModelDeployment's scale subresource. Needs KEDA in the cluster and a
    Prometheus that scrapes the gateway and the engines."""

    model_config = {
        "json_schema_extra": cel_rules_schema(RULE_AUTOSCALING_BOUNDS, RULE_AUTOSCALING_PROMETHEUS)
    }

    enabled: bool = Field(
        default=False,
        description="true: KEDA sizes the pool between minReplicas and maxReplicas and owns "
        "spec.pool.replicas (leave it out of what you apply).",
    )
    min_replicas: Annotated[int, Field(ge=1, le=1024, description="Fewest replicas.")] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1024, description="Most replicas.")] = 4
    best_effort_max_replicas: Annotated[
        int | None,
        Field(
            ge=1,
            le=1024,
            description="The most replicas best-effort (basic tier) load alone may bring the pool to, "
            "e.g. 2. Unset: minReplicas (best-effort load never adds a replica); premium and standard "
            "pressure and KV use scale up to maxReplicas.",
        ),
    ] = None
    prometheus_address: Annotated[
        str | None,
        Field(
            max_length=512,
            pattern=PROMETHEUS_ADDRESS_PATTERN,
            description="The Prometheus KEDA queries, e.g. http://prometheus-operated.monitoring:9090.",
        ),
    ] = None
    polling_interval_seconds: Annotated[
        int, Field(ge=1, le=3600, description="How often KEDA reads the signals, in seconds.")
    ] = 15
    signals: AutoscalingSignals = Field(
        default_factory=AutoscalingSignals,
        description="The signals and their targets.",
        json_schema_extra={"default": {}},
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        cap = self.best_effort_max_replicas
        if self.min_replicas > self.max_replicas or (
            cap is not None and not self.min_replicas <= cap <= self.max_replicas
        ):
            raise ValueError(RULE_AUTOSCALING_BOUNDS.message)
        if self.enabled and self.prometheus_address is None:
            raise ValueError(RULE_AUTOSCALING_PROMETHEUS.message)
        return self

    @property
    def best_effort_cap(self) -> int:
        """The replicas best-effort load alone may ask for (``bestEffortMaxReplicas``, else minReplicas)."""
        return self.min_replicas if self.best_effort_max_replicas is None else self.best_effort_max_replicas


class PoolSpec(CrdModel):
    """The engine replicas: how many, on which nodes, with which GPUs."""

    model_config = {
        "json_schema_extra": cel_rules_schema(
            RULE_CPU_KV_SPACE,
            RULE_POOL_SELECTS_NO_GPU_GROUP,
            RULE_POOL_TOLERATES_NO_GPU_GROUP,
            RULE_TEMPLATE_NO_GPU_RESOURCE,
        )
    }

    replicas: Annotated[
        int, Field(ge=0, le=1024, description="Engine replicas in the shared pool (0 stops the pool).")
    ] = 1
    gpus_per_replica: Annotated[
        int, Field(ge=0, le=64, description="GPUs per replica (0: CPU engine, for demos and tests).")
    ] = 1
    gpu_type: Annotated[
        str | None,
        Field(max_length=128, description="GPU product name for scheduling and sizing, e.g. NVIDIA-H200."),
    ] = None
    gpu_memory: Quantity | None = Field(
        default=None, description="Memory of one GPU, e.g. 141Gi (H200); sets the KV capacity estimate."
    )
    reserve_per_gpu: Quantity = Field(
        default=DEFAULT_RESERVE_PER_GPU,
        description="GPU pools: memory the planner leaves on each GPU for what vLLM needs besides weights "
        "and KV cache (activations at maxNumBatchedTokens, CUDA graphs, NCCL and cuBLAS workspaces) when it "
        "estimates the KV blocks quotas are admitted against until an engine reports the blocks it really "
        "allocated (status.kvCapacity.reportedBlocks). vLLM sizes its own cache; raise this when the "
        "reported figure is below the estimate (CapacityBelowPlan says by how much).",
    )
    cpu_kv_cache_space: Annotated[
        str | None,
        Field(
            max_length=8,
            pattern=CPU_KV_CACHE_SPACE_PATTERN,
            description="CPU engines only: memory for the KV cache in whole GiB (vLLM's "
            "VLLM_CPU_KVCACHE_SPACE is an integer number of GiB), e.g. 1Gi.",
        ),
    ] = None
    gpu_resource: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9._]*[a-zA-Z0-9])?$",
            description="Extended resource the engine requests gpusPerReplica of: nvidia.com/gpu (the "
            "default), a MIG profile such as nvidia.com/mig-1g.10gb, or another vendor's, e.g. amd.com/gpu.",
        ),
    ] = DEFAULT_GPU_RESOURCE
    node_selector: Annotated[
        dict[str, Annotated[str, Field(max_length=63)]],
        Field(max_length=32, description="Node labels the engine pods must match."),
    ] = {}
    tolerations: Annotated[
        list[Toleration],
        Field(
            max_length=32,
            description="Tolerations for tainted GPU nodes (added to the operator's own). A wildcard "
            "(operator Exists, no key) never "
            "reaches a dedicated GPU group: the engine pods then also require nodes without "
            f"{GPU_GROUP_LABEL}.",
            json_schema_extra={"x-kubernetes-list-type": "atomic"},
        ),
    ] = []
    pod_template: PodTemplate = Field(
        default_factory=PodTemplate,
        description="Settings merged over the engine pods: resources, env, envFrom, runtimeClassName, "
        "priorityClassName, affinity, imagePullSecrets, labels, annotations. Fields that carry isolation "
        "or security are refused.",
        json_schema_extra={"default": {}},
    )
    node_loss: NodeLossSpec = Field(
        default_factory=NodeLossSpec,
        description="What happens to an engine pod whose node stops reporting (NotReady/unreachable).",
        json_schema_extra={"default": {}},
    )
    autoscaling: PoolAutoscaling = Field(
        default_factory=PoolAutoscaling,
        description="Autoscaling of the pool through KEDA on kvfleet's own signals (queue per SLA tier, KV "
        "use, time to first token).",
        json_schema_extra={"default": {}},
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        resources = self.pod_template.resources
        if self.gpu_resource in resources.requests or self.gpu_resource in resources.limits:
            raise ValueError(RULE_TEMPLATE_NO_GPU_RESOURCE.message)
        if self.cpu_kv_cache_space is not None and self.gpus_per_replica != 0:
            raise ValueError(RULE_CPU_KV_SPACE.message)
        if GPU_GROUP_LABEL in self.node_selector:
            raise ValueError(RULE_POOL_SELECTS_NO_GPU_GROUP.message)
        if any(t.key == GPU_GROUP_LABEL for t in self.tolerations):
            raise ValueError(RULE_POOL_TOLERATES_NO_GPU_GROUP.message)
        return self


class ResourceList(CrdModel):
    """CPU and memory amounts (Kubernetes quantities)."""

    cpu: ResourceQuantity | None = Field(default=None, description="CPU, e.g. 500m or 2.")
    memory: ResourceQuantity | None = Field(default=None, description="Memory, e.g. 512Mi.")


class ResourceRequirements(CrdModel):
    """Requests and limits of a container."""

    requests: ResourceList | None = Field(default=None, description="Guaranteed resources.")
    limits: ResourceList | None = Field(default=None, description="Resource limits.")


# --- gateway exposure ---------------------------------------------------------------------------------
# How clients outside the cluster reach the gateway (docs/operations.md, "Exposure"). The gateway's
# metrics port is never on the exposed Service: it has its own ClusterIP Service (build/gateway.py).


class ServiceType(StrEnum):
    """Type of the gateway's client Service."""

    CLUSTER_IP = "ClusterIP"
    LOAD_BALANCER = "LoadBalancer"
    NODE_PORT = "NodePort"


#: A precise DNS name (RFC 1123, lowercase): no wildcard, no scheme, no port. A character class stands for
#: the dot so the pattern needs no escaping inside a CEL string literal.
HOSTNAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?([.][a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"
#: An IPv4 address matches HOSTNAME_PATTERN too; Ingress hosts and HTTPRoute hostnames may not be one.
_IPV4_PATTERN = r"^[0-9.]+$"


def _hostname_ok(name: str) -> bool:
    return re.fullmatch(HOSTNAME_PATTERN, name) is not None and re.fullmatch(_IPV4_PATTERN, name) is None


def _hostname_cel(var: str) -> str:
    return f"{var}.matches('{HOSTNAME_PATTERN}') && !{var}.matches('{_IPV4_PATTERN}')"


_HOSTNAME_RULE_TAIL = (
    "a lowercase DNS name such as llm.example.com (no wildcard, scheme, port, path or IP address)"
)
RULE_INGRESS_HOST = CelRule(
    rule=_hostname_cel("self.host"),
    message=f"spec.gateway.exposure.ingress.host must be {_HOSTNAME_RULE_TAIL}",
    field_path=".host",
)
RULE_ROUTE_HOSTNAMES = CelRule(
    rule="self.hostnames.all(h, " + _hostname_cel("h") + ")",
    message=f"spec.gateway.exposure.httpRoute.hostnames: each must be {_HOSTNAME_RULE_TAIL}",
    field_path=".hostnames",
)
RULE_TLS_SECRET = CelRule(
    rule="has(self.secretName)",
    message="spec.gateway.exposure.ingress.tls.secretName is required: the Secret (type kubernetes.io/tls, "
    "in this namespace) with the certificate and key for the host",
    field_path=".secretName",
    reason="FieldValueRequired",
)
RULE_ONE_ROUTE = CelRule(
    rule="!has(self.ingress) || !has(self.httpRoute)",
    message="spec.gateway.exposure.httpRoute: set it or spec.gateway.exposure.ingress, not both (one "
    "external route to the gateway)",
    field_path=".httpRoute",
)


class ServiceExposure(CrdModel):
    """The gateway's client Service (the API port only; metrics have their own ClusterIP Service)."""

    type: ServiceType = Field(
        default=ServiceType.CLUSTER_IP,
        description="ClusterIP (in the cluster only; the default), LoadBalancer (an address from the cloud's "
        "load balancer; status.endpoint shows it once assigned) or NodePort (a port on every node); only the "
        "types the platform allows (the chart's guardrails.serviceTypes; ClusterIP by default).",
    )
    annotations: Annotated[
        dict[str, Annotated[str, Field(max_length=4096)]],
        Field(
            max_length=32,
            description="Annotations on the Service, e.g. a cloud's internal load balancer switch; only "
            "keys the platform allows (the chart's guardrails.serviceAnnotations; none by default).",
        ),
    ] = {}


class IngressTls(CrdModel):
    """TLS for the Ingress host, terminated by the ingress controller."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_TLS_SECRET)}

    secret_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=DNS_SUBDOMAIN_PATTERN,
            description="Secret of type kubernetes.io/tls in this namespace (e.g. made by cert-manager).",
        ),
    ] = None

    @model_validator(mode="after")
    def _secret_named(self) -> Self:
        if self.secret_name is None:
            raise ValueError(RULE_TLS_SECRET.message)
        return self


class IngressExposure(CrdModel):
    """A networking.k8s.io/v1 Ingress for the gateway's OpenAI API (path prefix /v1 only)."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_INGRESS_HOST)}

    host: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="Host clients call, e.g. llm.example.com; one the platform gives this namespace (the "
            "chart's guardrails.hosts).",
        ),
    ]
    class_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=DNS_SUBDOMAIN_PATTERN,
            description="IngressClass; empty: the cluster's default class. Another class must be one the "
            "platform allows (the chart's guardrails.ingressClasses).",
        ),
    ] = None
    annotations: Annotated[
        dict[str, Annotated[str, Field(max_length=4096)]],
        Field(
            max_length=32,
            description="Annotations on the Ingress, for the controller (e.g. turn off response buffering "
            "for streams, raise read timeouts); only keys the platform allows (the chart's "
            "guardrails.ingressAnnotations; by default ingress-nginx's proxy-buffering, proxy-read-timeout, "
            "proxy-send-timeout and proxy-body-size).",
        ),
    ] = {}
    tls: IngressTls | None = Field(
        default=None, description="TLS from a Secret; status.endpoint is https:// with it, http:// without."
    )

    @model_validator(mode="after")
    def _host_ok(self) -> Self:
        if not _hostname_ok(self.host):
            raise ValueError(RULE_INGRESS_HOST.message)
        return self


class ParentReference(CrdModel):
    """A Gateway (gateway.networking.k8s.io) the route attaches to."""

    name: ObjectName = Field(description="Name of the Gateway.")
    namespace: Annotated[
        str | None,
        Field(
            max_length=63,
            pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
            description="Namespace of the Gateway; empty: this namespace (its listener must allow routes "
            "from here).",
        ),
    ] = None
    section_name: Annotated[
        str | None,
        Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Listener of the Gateway."),
    ] = None


class HttpRouteExposure(CrdModel):
    """A Gateway API HTTPRoute (gateway.networking.k8s.io/v1) for the gateway's OpenAI API (path prefix /v1
    only). TLS is the parent Gateway's: its HTTPS listener names the certificate Secret."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ROUTE_HOSTNAMES)}

    parent_refs: Annotated[
        list[ParentReference],
        Field(
            min_length=1,
            max_length=8,
            description="Gateways the route attaches to: ones the platform allows (the chart's "
            "guardrails.parentGateways; by default any in this namespace).",
            json_schema_extra={"x-kubernetes-list-type": "atomic"},
        ),
    ]
    hostnames: Annotated[
        list[Annotated[str, Field(max_length=253)]],
        Field(
            min_length=1,
            max_length=16,
            description="Hostnames clients call; the first is status.endpoint's. Each one the platform "
            "gives this namespace (the chart's guardrails.hosts).",
            json_schema_extra={"x-kubernetes-list-type": "atomic"},
        ),
    ]
    https: bool = Field(
        default=True,
        description="Whether the parent's listener for these hostnames terminates TLS (status.endpoint's "
        "scheme).",
    )

    @model_validator(mode="after")
    def _hostnames_ok(self) -> Self:
        if not all(_hostname_ok(h) for h in self.hostnames):
            raise ValueError(RULE_ROUTE_HOSTNAMES.message)
        return self


class ExposureSpec(CrdModel):
    """How clients reach the gateway: its Service's type, and at most one of an Ingress or an HTTPRoute."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ONE_ROUTE)}

    service: ServiceExposure = Field(
        default_factory=ServiceExposure,
        description="The gateway's client Service.",
        json_schema_extra={"default": {}},
    )
    ingress: IngressExposure | None = Field(
        default=None, description="An Ingress to the gateway (the operator needs the chart's rbac.ingress)."
    )
    http_route: HttpRouteExposure | None = Field(
        default=None,
        description="A Gateway API HTTPRoute to the gateway (the operator needs the chart's rbac.httpRoute "
        "and the cluster the Gateway API CRDs).",
    )

    @model_validator(mode="after")
    def _one_route(self) -> Self:
        if self.ingress is not None and self.http_route is not None:
            raise ValueError(RULE_ONE_ROUTE.message)
        return self


# --- GIE: InferencePool and the data plane --------------------------------------------------------------
# kvfleet behind the platform's own Gateway API Inference Extension gateway (docs/onboarding.md): an
# InferencePool per pool whose Endpoint Picker is kvfleet's (``build/endpoint_picker.py``).


class DataPlane(StrEnum):
    """What the gateway pods run."""

    KVFLEET = "kvfleet"
    ENVOY = "envoy"


#: A label key (an optional DNS-subdomain prefix and a name) and value, as Kubernetes checks them.
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
RULE_GATEWAY_POD_LABELS = CelRule(
    rule=f"self.all(k, k.matches('{LABEL_KEY_PATTERN}'))",
    message="spec.gateway.inferencePool.gatewayPods.matchLabels: each key must be a label key such as "
    "gateway.networking.k8s.io/gateway-name (an optional DNS prefix and /, then a name of at most 63 "
    "letters, digits, -, _ or .)",
)


class GatewayPods(CrdModel):
    """The pods of the platform's gateway (Istio, kgateway, Envoy Gateway, ...) that call the Endpoint
    Picker and then the engines: one namespace, by name, and the pods' labels there."""

    namespace: Annotated[
        str | None,
        Field(
            max_length=63,
            pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
            description="Namespace the gateway's pods run in, e.g. gateways; empty: this namespace. One the "
            "platform allows (the chart's guardrails.inferenceGatewayNamespaces; by default only this "
            "namespace).",
        ),
    ] = None
    match_labels: Annotated[
        dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]],
        Field(
            min_length=1,
            max_length=16,
            description="Labels the gateway's pods carry there, e.g. gateway.networking.k8s.io/gateway-name: "
            "edge (Istio, kgateway and Envoy Gateway put the Gateway's name in that label). At least one: "
            "the NetworkPolicies admit exactly these pods to the Endpoint Picker and the engines' OpenAI "
            "port.",
            json_schema_extra=cel_rules_schema(RULE_GATEWAY_POD_LABELS),
        ),
    ]

    @model_validator(mode="after")
    def _label_keys(self) -> Self:
        if not all(re.fullmatch(LABEL_KEY_PATTERN, k) for k in self.match_labels):
            raise ValueError(RULE_GATEWAY_POD_LABELS.message)
        return self


class EndpointPickerSpec(CrdModel):
    """The Endpoint Picker (``<name>-epp``), which runs for dataPlane envoy and for inferencePool."""

    tls_secret_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=DNS_SUBDOMAIN_PATTERN,
            description="Secret in this namespace (type kubernetes.io/tls, e.g. cert-manager's) whose "
            "tls.crt and tls.key the Endpoint Picker serves its gRPC port with: TLS only, a plaintext call "
            "gets no answer. Its ca.crt is the CA the Envoy data plane verifies the picker with (only that "
            "key is mounted in the gateway pods). The certificate should name <name>-epp.<namespace>.svc. "
            "Read at start: a renewed certificate takes effect as the pods restart. Most GIE gateways call "
            "the picker over TLS (GIE's own picker serves TLS by default). Unset: plaintext gRPC (h2c), "
            "readiness by gRPC health.",
        ),
    ] = None


class InferencePoolSpec(CrdModel):
    """An InferencePool (inference.networking.k8s.io/v1) per engine pool, whose endpointPickerRef is this
    ModelDeployment's Endpoint Picker (``<name>-epp``, port 9002): the platform's GIE gateway asks it which
    engine serves each request, and kvfleet's tenancy (keys, salts, limits, fair queuing, metering) holds
    as through kvfleet's own gateway."""

    gateway_pods: GatewayPods = Field(
        description="The platform gateway's pods: the only pods besides this ModelDeployment's own gateway "
        "that the NetworkPolicies admit to the Endpoint Picker's gRPC port and the engines' OpenAI port."
    )


# --- gateway fair queuing -----------------------------------------------------------------------------
# The gateway holds requests beyond what the engines are given at once and releases them in a fair order
# within an SLA tier (docs/operations.md, "Fair queuing"). Unset fields keep the gateway's own defaults.


class FairQueuingOrder(StrEnum):
    """Order of held requests within an SLA tier (between tiers: strict priority)."""

    VTC = "vtc"
    FIFO = "fifo"


class Routing(StrEnum):
    """How the gateway picks an engine replica for a request (within the load bound either way)."""

    PRECISE = "precise"
    AFFINITY = "affinity"


#: The longest a request may wait at the gateway (for its tenant's concurrency or for the engines).
MAX_QUEUE_TIMEOUT = "10m"
RULE_QUEUE_TIMEOUT = CelRule(
    rule="!has(self.queueTimeout) || (duration(self.queueTimeout) > duration('0s') && "
    f"duration(self.queueTimeout) <= duration('{MAX_QUEUE_TIMEOUT}'))",
    message=f"spec.gateway.queueTimeout must be longer than 0s and at most {MAX_QUEUE_TIMEOUT}, e.g. 10s "
    "(how long a request may wait at the gateway before it is refused with 429)",
    field_path=".queueTimeout",
)
RULE_IN_FLIGHT_PER_GATEWAY = CelRule(
    rule="!has(self.engineInFlightPerReplica) || self.engineInFlightPerReplica == 0 || "
    "self.engineInFlightPerReplica >= self.replicas",
    message="spec.gateway.engineInFlightPerReplica must be 0 (no limit) or at least spec.gateway.replicas: "
    "each gateway replica gives every engine replica its share of it, at least one request",
    field_path=".engineInFlightPerReplica",
)


class GatewaySpec(CrdModel):
    """The tenant-aware gateway in front of the pool."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_QUEUE_TIMEOUT, RULE_IN_FLIGHT_PER_GATEWAY)}

    replicas: Annotated[
        int, Field(ge=1, le=64, description="Gateway replicas (2 or more for availability).")
    ] = 2
    image: Annotated[
        str | None,
        Field(
            max_length=512, pattern=r"^[^\s]+$", description="Gateway image; empty: the operator's default."
        ),
    ] = None
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="CPU and memory of each gateway pod.",
        json_schema_extra={"default": {}},
    )
    exposure: ExposureSpec = Field(
        default_factory=ExposureSpec,
        description="How clients outside the cluster reach the gateway: Service type, Ingress or HTTPRoute.",
        json_schema_extra={"default": {}},
    )
    fair_queuing: FairQueuingOrder | None = Field(
        default=None,
        description="Order of the requests the gateway holds while the engines are saturated, within an SLA "
        "tier: vtc (token-weighted fair queuing: each tenant gets service in proportion to its Tenant "
        "spec.fairShareWeight) or fifo (first come, first served). Between tiers the order is always strict "
        "priority. Unset: vtc.",
    )
    engine_in_flight_per_replica: Annotated[
        int | None,
        Field(
            ge=0,
            le=65536,
            description="Requests each engine replica is given at once, over all gateway replicas (each "
            "gives it this divided by spec.gateway.replicas, rounded up); the gateway holds the rest in the "
            "spec.gateway.fairQueuing order. Fair queuing acts only on what is held: set this at or below "
            "what an engine runs at once (vLLM's max_num_seqs) for it to take effect. 0: no limit, nothing "
            "is held. Unset: 256 per gateway replica.",
        ),
    ] = None
    queue_timeout: Duration | None = Field(
        default=None,
        description="How long a request may wait at the gateway (for its tenant's concurrency limit or for "
        "room on the engines) before it is refused with 429 and Retry-After, e.g. 10s; longer than 0s, at "
        f"most {MAX_QUEUE_TIMEOUT}. Unset: 10s.",
    )
    routing: Routing = Field(
        default=Routing.PRECISE,
        description="How the gateway picks the engine replica: precise (the replica holding the longest "
        "cached prefix of the tenant's own KV blocks, from the engines' KV events; the engine tokenizes each "
        "request of a tenant it holds blocks of, one more local round trip) or affinity (a hash of the "
        "tenant's salt and the prompt's first characters). Both stay within the same load bound.",
    )
    data_plane: DataPlane = Field(
        default=DataPlane.KVFLEET,
        description="What the gateway pods run: kvfleet (kvfleet's own gateway) or envoy (Envoy, which asks "
        "this ModelDeployment's Endpoint Picker, <name>-epp, for every request; the tenancy is the same, "
        "applied by the Endpoint Picker, which also serves the gateway's metrics).",
    )
    endpoint_picker: EndpointPickerSpec = Field(
        default_factory=EndpointPickerSpec,
        description="The Endpoint Picker (<name>-epp) that dataPlane envoy and inferencePool call: TLS on "
        "its gRPC port.",
        json_schema_extra={"default": {}},
    )
    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description="Serve the pools behind the platform's own Gateway API Inference Extension gateway: an "
        "InferencePool per pool (the operator needs the chart's rbac.inferencePool and the cluster the "
        "InferencePool CRD) and an Endpoint Picker; with exposure.httpRoute the route's backend is the "
        "shared pool's InferencePool.",
    )

    @model_validator(mode="after")
    def _fair_queuing(self) -> Self:
        if self.queue_timeout is not None and not (
            0 < parse_duration(self.queue_timeout) <= parse_duration(MAX_QUEUE_TIMEOUT)
        ):
            raise ValueError(RULE_QUEUE_TIMEOUT.message)
        n = self.engine_in_flight_per_replica
        if n is not None and n != 0 and n < self.replicas:
            raise ValueError(RULE_IN_FLIGHT_PER_GATEWAY.message)
        return self


class ModelDeploymentSpec(CrdModel):
    """Desired state of a ModelDeployment."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_GPUS_MATCH_PARALLELISM)}

    model: ModelSpec = Field(description="Which model to serve.")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="How vLLM runs it.", json_schema_extra={"default": {}}
    )
    kv_cache: KvCacheSpec = Field(
        default_factory=KvCacheSpec,
        description="LMCache CPU/NVMe tiers and default TTLs.",
        json_schema_extra={"default": {}},
    )
    pool: PoolSpec = Field(
        default_factory=PoolSpec,
        description="Engine replicas and placement.",
        json_schema_extra={"default": {}},
    )
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec, description="The gateway in front.", json_schema_extra={"default": {}}
    )

    @model_validator(mode="after")
    def _gpus_match(self) -> Self:
        gpus = self.pool.gpus_per_replica
        engine = self.engine
        if gpus and gpus != (
            engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size
        ):
            raise ValueError(RULE_GPUS_MATCH_PARALLELISM.message)
        return self


# --- status -------------------------------------------------------------------------------------------


class TierCapacity(CrdModel):
    """KV capacity of one tier."""

    tokens: Annotated[int, Field(ge=0, description="Tokens of KV that fit.")] = 0
    bytes: Annotated[int, Field(ge=0, description="Bytes of KV space.")] = 0
    blocks: Annotated[
        int, Field(ge=0, description="KV blocks (HBM: vLLM blocks; CPU/NVMe: LMCache chunks).")
    ] = 0


class TieredCapacity(CrdModel):
    """KV capacity per tier."""

    hbm: TierCapacity = Field(default_factory=TierCapacity, description="GPU memory.")
    cpu: TierCapacity = Field(default_factory=TierCapacity, description="LMCache CPU tier.")
    nvme: TierCapacity = Field(default_factory=TierCapacity, description="LMCache NVMe tier.")


class KvCapacityStatus(CrdModel):
    """KV capacity per replica and for the whole pool: the figure quotas are admitted against (the
    engines' own once one reports, the planner's estimate before), and both figures side by side."""

    planned_blocks: Annotated[
        int,
        Field(
            ge=0,
            description="KV blocks per replica the planner estimates from the spec (gpuMemory, "
            "reservePerGpu, gpuMemoryUtilization, or cpuKvCacheSpace); quotas are admitted against it until "
            "an engine reports its own.",
        ),
    ] = 0
    reported_blocks: Annotated[
        int | None,
        Field(
            ge=0,
            description="KV blocks per replica vLLM really allocated: the fewest any ready engine replica "
            "reports (vllm:cache_config_info on its metrics port). Absent until one reports; once present, "
            "quotas are admitted against it.",
        ),
    ] = None
    per_replica: TieredCapacity = Field(default_factory=TieredCapacity, description="One replica.")
    pool: TieredCapacity = Field(default_factory=TieredCapacity, description="All replicas together.")
    summary: Annotated[
        str, Field(max_length=64, description="Human-readable pool HBM capacity, e.g. 1.2M tokens.")
    ] = ""


class GuaranteeStatus(CrdModel):
    """Sum of the quotas the Tenants of this ModelDeployment are guaranteed."""

    tenants: Annotated[int, Field(ge=0, description="Tenants that reference this ModelDeployment.")] = 0
    hbm_tokens: Annotated[int, Field(ge=0, description="Guaranteed GPU-memory KV, in tokens.")] = 0
    hbm_share: Annotated[
        str, Field(max_length=16, description="Guaranteed GPU-memory KV as a share of the pool, e.g. 45%.")
    ] = "0%"
    cpu_bytes: Annotated[int, Field(ge=0, description="Guaranteed CPU-tier bytes.")] = 0
    nvme_bytes: Annotated[int, Field(ge=0, description="Guaranteed NVMe-tier bytes.")] = 0
    seats: Annotated[
        int,
        Field(
            ge=0,
            description="Concurrent requests the premium and standard tenants on the shared pool are "
            "promised (their rateLimits.maxConcurrent, summed).",
        ),
    ] = 0
    replicas: Annotated[
        int,
        Field(
            ge=0,
            description="The guarantee floor: shared-pool replicas those seats and the waiting seats need. "
            "With autoscaling the pool never scales in below it (within minReplicas..maxReplicas).",
        ),
    ] = 0
    waiting_seats: Annotated[
        int,
        Field(
            ge=0,
            description="Concurrent requests of premium and standard tenants that wait for the autoscaled "
            "pool's replicas to be ready (WaitingForCapacity); admitted, in order, once they are.",
        ),
    ] = 0


class ModelDeploymentStatus(CrdModel):
    """Observed state of a ModelDeployment, written by the operator."""

    conditions: Conditions = []
    observed_generation: Annotated[
        int, Field(ge=0, description="The metadata.generation the operator last acted on.")
    ] = 0
    replicas: Annotated[int, Field(ge=0, description="Engine replicas that exist (scale subresource).")] = 0
    ready_replicas: Annotated[int, Field(ge=0, description="Engine replicas that serve requests.")] = 0
    selector: Annotated[
        str, Field(max_length=1024, description="Label selector of the engine pods (scale subresource).")
    ] = ""
    kv_capacity: KvCapacityStatus = Field(
        default_factory=KvCapacityStatus, description="KV capacity per replica and per pool, per tier."
    )
    guaranteed: GuaranteeStatus = Field(
        default_factory=GuaranteeStatus, description="Sum of the Tenants' guaranteed quotas."
    )
    endpoint: Annotated[
        str,
        Field(
            max_length=512,
            description="OpenAI-compatible base URL of the gateway: the external one when there is one "
            "(the Ingress or HTTPRoute host; a LoadBalancer's address once assigned), else the in-cluster "
            "one.",
        ),
    ] = ""


class ModelDeployment(CrdModel):
    """A model and how to serve it: engine settings, KV cache tiers, GPU pool and gateway."""

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", alias="apiVersion", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["ModelDeployment"] = Field(default="ModelDeployment", description="ModelDeployment")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: ModelDeploymentSpec = Field(description="Desired state.")
    status: ModelDeploymentStatus | None = Field(default=None, description="Observed state.")
