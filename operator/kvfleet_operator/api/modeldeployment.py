"""``ModelDeployment`` (kvfleet.io/v1alpha1, short name ``md``): a model and how to serve it.

The architecture block maps one to one onto ``kvfleet_runtime.kv.sizing.ModelArchitecture`` (same
field names in camelCase), so the operator can size the KV cache with the runtime's planner.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from kvfleet_operator.api.common import (
    GPU_GROUP_LABEL,
    CelRule,
    Conditions,
    CrdModel,
    ObjectName,
    cel_rules_schema,
)
from kvfleet_operator.api.units import PositiveDuration, Quantity, ResourceQuantity, parse_duration

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

# --- model --------------------------------------------------------------------------------------------


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


class ModelSource(CrdModel):
    """Where the weights come from: exactly one of huggingFace, pvc, uri."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_ONE_SOURCE)}

    hugging_face: Annotated[
        str | None,
        Field(
            max_length=256,
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
            description="Hugging Face model id, e.g. Qwen/Qwen2.5-72B-Instruct.",
        ),
    ] = None
    pvc: PvcSource | None = Field(default=None, description="Model files on a PersistentVolumeClaim.")
    uri: Annotated[
        str | None,
        Field(
            max_length=2048,
            pattern=r"^(s3|gs|https?|oci|file)://.+$",
            description="URI of the model files: s3://, gs://, https://, oci:// or file://.",
        ),
    ] = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if sum(x is not None for x in (self.hugging_face, self.pvc, self.uri)) != 1:
            raise ValueError(RULE_ONE_SOURCE.message)
        return self


RULE_ARCH_ONE_WAY = CelRule(
    rule="((has(self.fromConfig) && self.fromConfig) ? 1 : 0) + (has(self.preset) ? 1 : 0)"
    " + (has(self.numLayers) ? 1 : 0) == 1",
    message="spec.model.architecture must use exactly one of fromConfig: true, preset, or explicit "
    "fields (numLayers, numAttentionHeads, numKvHeads, headDim, hiddenSize)",
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
    """The model architecture, for KV sizing: fromConfig, a preset, or explicit fields.

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

    from_config: bool | None = Field(
        default=None,
        description="true: read the architecture from the model's config.json when the engine starts.",
    )
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
        ways = int(bool(self.from_config)) + int(self.preset is not None) + int(self.num_layers is not None)
        if ways != 1:
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
        (empty for fromConfig and preset architectures)."""
        fields = self.model_dump(exclude={"from_config", "preset"}, exclude_none=True, mode="json")
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
        description="Architecture for KV sizing: fromConfig: true, a preset, or explicit fields."
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
            description="Container image of the engine (vLLM with the kvfleet plugin). Empty: the "
            "operator's default image.",
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
            description="More vLLM command-line arguments, appended verbatim, e.g. [--max-num-seqs=256].",
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
            description="Absolute node path to an NVMe mount, e.g. /mnt/nvme; it must exist and be writable "
            "by uid 10001. Each replica writes under <hostPath>/<namespace>/<pod>. A hostPath volume needs "
            "the privileged Pod Security level (baseline and restricted refuse it), and its files stay on "
            "the node when the pool or tenant is deleted: prefer storageClassName, whose volumes go with "
            "the pool.",
        ),
    ] = None

    @model_validator(mode="after")
    def _one_storage(self) -> Self:
        if (self.storage_class_name is None) == (self.host_path is None):
            raise ValueError(RULE_NVME_ONE_STORAGE.message)
        return self


class SharedTier(CrdModel):
    """An LMCache tier shared by all replicas of the pool (a shared LMCache server)."""

    enabled: bool = Field(default=False, description="true: run one shared LMCache server for the pool.")
    size: Quantity = Field(default="0", description="Memory of the shared tier, e.g. 512Gi.")


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
    shared: SharedTier | None = Field(default=None, description="Optional tier shared across replicas.")
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


class PoolSpec(CrdModel):
    """The engine replicas: how many, on which nodes, with which GPUs."""

    model_config = {
        "json_schema_extra": cel_rules_schema(
            RULE_CPU_KV_SPACE, RULE_POOL_SELECTS_NO_GPU_GROUP, RULE_POOL_TOLERATES_NO_GPU_GROUP
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
    cpu_kv_cache_space: Quantity | None = Field(
        default=None,
        description="CPU engines only: memory for the KV cache (VLLM_CPU_KVCACHE_SPACE), e.g. 1Gi.",
    )
    node_selector: Annotated[
        dict[str, Annotated[str, Field(max_length=63)]],
        Field(max_length=32, description="Node labels the engine pods must match."),
    ] = {}
    tolerations: Annotated[
        list[Toleration],
        Field(
            max_length=32,
            description="Tolerations for tainted GPU nodes. A wildcard (operator Exists, no key) never "
            "reaches a dedicated GPU group: the engine pods then also require nodes without "
            f"{GPU_GROUP_LABEL}.",
            json_schema_extra={"x-kubernetes-list-type": "atomic"},
        ),
    ] = []

    @model_validator(mode="after")
    def _consistent(self) -> Self:
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


class GatewaySpec(CrdModel):
    """The tenant-aware gateway in front of the pool."""

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
    """KV capacity per replica and for the whole pool."""

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
        str, Field(max_length=512, description="OpenAI-compatible base URL of the gateway.")
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
