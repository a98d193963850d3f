"""From the custom resources to the data plane's tenant table: capacity, quota admission, salts. Pure.

The pool's KV capacity comes from the planner's math (``kvfleet_runtime.kv.sizing``), the same numbers
``kvfleet plan`` prints. Quotas are admitted per replica, because every engine replica governs its own
block pool: a tenant's ``20%`` is 20% of each replica's blocks.

Admission is first come, first served (creation time, then name): a tenant whose guarantee would push
the sum of guarantees past the capacity of its pool, or whose guarantee exceeds its burst limit, is
rejected with ``QuotaExceedsCapacity`` and the numbers; tenants admitted earlier keep their place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.units import parse_duration, parse_quantity
from kvfleet_operator.build.common import MODEL_MOUNT, NVME_MOUNT, SHARED_POOL
from kvfleet_operator.build.keys import pool_salt_id, tenant_salt_id
from kvfleet_runtime.config import (
    TIER_PRIORITY,
    EngineSettings,
    Isolation,
    KVQuota,
    LMCacheSettings,
    PoolEntry,
    RateLimits,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
)
from kvfleet_runtime.kv.presets import get_preset
from kvfleet_runtime.kv.sizing import (
    ModelArchitecture,
    SizingError,
    build_model_architecture,
    compute_blocks_for_share,
    compute_blocks_for_tokens,
    compute_offload_bytes_per_token,
    compute_replica_capacity,
)

DEFAULT_BURST = "50%"


@dataclass(frozen=True)
class PoolCapacity:
    """KV capacity of one replica of a pool, per tier."""

    block_size: int
    hbm_blocks: int
    hbm_tokens: int
    hbm_bytes: int
    cpu_bytes: int
    nvme_bytes: int
    #: Bytes one token takes in LMCache's tiers (to convert byte quotas to tokens for humans).
    offload_bytes_per_token: int


def resolve_architecture(md: ModelDeployment) -> ModelArchitecture:
    """The architecture the planner sizes with. Raises ``SizingError`` with the field to fix."""
    arch = md.spec.model.architecture
    if arch.preset is not None:
        return get_preset(str(arch.preset.value)).architecture
    if arch.from_config:
        raise SizingError(
            "spec.model.architecture.fromConfig: the operator cannot read config.json before an engine "
            "starts, so it cannot size the KV cache for quota admission; set spec.model.architecture."
            "preset or the explicit fields (kvfleet plan --config-json prints them)"
        )
    return build_model_architecture(**arch.to_sizing_fields())


def compute_pool_capacity(md: ModelDeployment) -> PoolCapacity:
    """Per-replica capacity of the ModelDeployment's pools (dedicated pools use the same engine shape).

    Raises ``SizingError`` (the model does not fit, no GPU memory given, ...).
    """
    spec = md.spec
    arch = resolve_architecture(md)
    engine = spec.engine
    kv_dtype = str(engine.kv_cache_dtype.value)
    if spec.pool.gpus_per_replica == 0:
        if spec.pool.cpu_kv_cache_space is None:
            raise SizingError("spec.pool.cpuKvCacheSpace is required when spec.pool.gpusPerReplica is 0")
        # A CPU engine gets exactly VLLM_CPU_KVCACHE_SPACE for KV: no weights, no reserve in that budget.
        capacity = compute_replica_capacity(
            arch,
            gpu_memory_bytes=parse_quantity(spec.pool.cpu_kv_cache_space),
            kv_cache_dtype=kv_dtype,
            block_size=engine.block_size,
            gpu_memory_utilization=1,
            reserve_bytes_per_gpu=0,
            weight_bytes_per_gpu=0,
        )
    else:
        if spec.pool.gpu_memory is None:
            raise SizingError(
                "spec.pool.gpuMemory is needed to size the KV cache (e.g. 141Gi for H200, 80Gi for H100)"
            )
        capacity = compute_replica_capacity(
            arch,
            gpu_memory_bytes=parse_quantity(spec.pool.gpu_memory),
            kv_cache_dtype=kv_dtype,
            block_size=engine.block_size,
            tensor_parallel=engine.tensor_parallel_size,
            pipeline_parallel=engine.pipeline_parallel_size,
            gpu_memory_utilization=engine.gpu_memory_utilization,
        )
    nvme = spec.kv_cache.nvme
    return PoolCapacity(
        block_size=engine.block_size,
        hbm_blocks=capacity.blocks_per_replica,
        hbm_tokens=capacity.tokens_per_replica,
        hbm_bytes=capacity.kv_bytes_per_replica,
        cpu_bytes=parse_quantity(spec.kv_cache.cpu_size),
        nvme_bytes=parse_quantity(nvme.size) if nvme is not None else 0,
        offload_bytes_per_token=compute_offload_bytes_per_token(
            arch, kv_dtype, engine.tensor_parallel_size, engine.pipeline_parallel_size
        ),
    )


@dataclass(frozen=True)
class TenantDecision:
    """What admission decided for one tenant."""

    name: str
    admitted: bool
    reason: str
    message: str
    pool: str
    quota: KVQuota | None = None


def dedicated_pool_name(tenant: str) -> str:
    return f"dedicated-{tenant}"


def _hbm_blocks(amount: int | str, capacity: PoolCapacity) -> int:
    if isinstance(amount, int):
        return compute_blocks_for_tokens(amount, capacity.block_size)
    return compute_blocks_for_share(amount, capacity.hbm_blocks)


def _creation_order(tenant: Tenant) -> tuple[str, str]:
    meta = tenant.metadata
    return (str(meta.get("creationTimestamp", "")), str(meta.get("name", "")))


def admit_tenants(capacity: PoolCapacity, tenants: Sequence[Tenant]) -> list[TenantDecision]:
    """Admission in creation order; see the module docstring."""
    used_hbm = used_cpu = used_nvme = 0
    decisions: list[TenantDecision] = []
    for tenant in sorted(tenants, key=_creation_order):
        name = str(tenant.metadata["name"])
        spec = tenant.spec
        dedicated = spec.isolation.value == Isolation.DEDICATED.value
        pool = dedicated_pool_name(name) if dedicated else SHARED_POOL
        hbm = _hbm_blocks(spec.kv_quota.hbm, capacity)
        burst = compute_blocks_for_share(spec.burst_limit or DEFAULT_BURST, capacity.hbm_blocks)
        cpu = parse_quantity(spec.kv_quota.cpu)
        nvme = parse_quantity(spec.kv_quota.nvme)
        problems: list[str] = []
        if hbm > capacity.hbm_blocks:
            problems.append(
                f"HBM quota {spec.kv_quota.hbm} is {hbm} blocks but a replica holds {capacity.hbm_blocks}"
            )
        if hbm > burst:
            problems.append(
                f"HBM quota is {hbm} blocks, above the burst limit {spec.burst_limit} ({burst} blocks); "
                "raise spec.burstLimit or lower spec.kvQuota.hbm"
            )
        # A dedicated pool serves one tenant: only the shared pool's guarantees add up.
        base_hbm, base_cpu, base_nvme = (0, 0, 0) if dedicated else (used_hbm, used_cpu, used_nvme)
        if base_hbm + hbm > capacity.hbm_blocks:
            problems.append(
                f"HBM guarantees would total {base_hbm + hbm} of {capacity.hbm_blocks} blocks per replica "
                f"({base_hbm} already guaranteed to other tenants)"
            )
        if base_cpu + cpu > capacity.cpu_bytes:
            problems.append(
                f"CPU-tier guarantees would total {base_cpu + cpu} of {capacity.cpu_bytes} bytes per replica"
            )
        if base_nvme + nvme > capacity.nvme_bytes:
            problems.append(
                f"NVMe-tier guarantees would total {base_nvme + nvme} of {capacity.nvme_bytes} bytes per "
                "replica"
            )
        if problems:
            decisions.append(
                TenantDecision(
                    name=name,
                    admitted=False,
                    reason=reasons.QUOTA_EXCEEDS_CAPACITY,
                    message="; ".join(problems) + ". Nothing was applied for this tenant.",
                    pool=pool,
                )
            )
            continue
        if not dedicated:
            used_hbm, used_cpu, used_nvme = used_hbm + hbm, used_cpu + cpu, used_nvme + nvme
        decisions.append(
            TenantDecision(
                name=name,
                admitted=True,
                reason=reasons.ADMITTED,
                message=f"{hbm} guaranteed HBM blocks per replica, burst up to {burst}.",
                pool=pool,
                quota=KVQuota(hbm_blocks=hbm, hbm_burst_blocks=burst, cpu_bytes=cpu, nvme_bytes=nvme),
            )
        )
    return decisions


def model_path(md: ModelDeployment) -> str:
    source = md.spec.model.source
    if source.hugging_face:
        return source.hugging_face
    if source.pvc is not None:
        return f"{MODEL_MOUNT}/{source.pvc.path.lstrip('/')}" if source.pvc.path else MODEL_MOUNT
    return str(source.uri)


def build_engine_settings(md: ModelDeployment) -> EngineSettings:
    spec = md.spec
    engine = spec.engine
    extra = list(engine.extra_args)
    if engine.max_num_seqs is not None:
        extra += ["--max-num-seqs", str(engine.max_num_seqs)]
    nvme = spec.kv_cache.nvme
    cpu_bytes = parse_quantity(spec.kv_cache.cpu_size)
    nvme_bytes = parse_quantity(nvme.size) if nvme is not None else 0
    return EngineSettings(
        model=model_path(md),
        revision=spec.model.revision,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        data_parallel_size=engine.data_parallel_size,
        enable_expert_parallel=engine.expert_parallel_size > 1,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        kv_cache_dtype=engine.kv_cache_dtype.value,
        enable_prefix_caching=engine.enable_prefix_caching,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        scheduling_policy=engine.scheduling_policy.value,
        extra_args=extra,
        # No CPU and no NVMe tier: no LMCache server (the launcher runs one iff this section exists).
        lmcache=LMCacheSettings(
            cpu_bytes=max(cpu_bytes, 1),
            nvme_bytes=nvme_bytes,
            nvme_path=NVME_MOUNT if nvme_bytes else None,
            chunk_size=spec.kv_cache.chunk_size,
        )
        if cpu_bytes or nvme_bytes
        else None,
    )


def _ttls(md: ModelDeployment, tenant: Tenant) -> TierTTLs:
    defaults, own = md.spec.kv_cache.ttl, tenant.spec.ttl
    return TierTTLs(
        hbm_seconds=parse_duration(own.hbm or defaults.hbm),
        cpu_seconds=parse_duration(own.cpu or defaults.cpu),
        nvme_seconds=parse_duration(own.nvme or defaults.nvme),
    )


@dataclass(frozen=True)
class PoolEndpoints:
    """Replica base URLs of one pool (engine HTTP), in replica order."""

    engines: tuple[str, ...]


def build_tenant_table(
    md: ModelDeployment,
    capacity: PoolCapacity,
    tenants: Sequence[Tenant],
    decisions: Sequence[TenantDecision],
    endpoints: dict[str, PoolEndpoints],
) -> TenantTable:
    """The table for every admitted tenant; ``endpoints`` has one entry per pool (shared + dedicated)."""
    by_name = {str(t.metadata["name"]): t for t in tenants}
    settings = build_engine_settings(md)
    served = md.spec.model.served_name or str(md.metadata.get("name"))
    pool_salt = pool_salt_id(md)
    pools: dict[str, PoolEntry] = {}
    entries: dict[str, TenantEntry] = {}

    def _pool(name: str, dedicated_to: str | None) -> PoolEntry:
        return PoolEntry(
            name=name,
            endpoints=list(endpoints[name].engines) if name in endpoints else [],
            block_size=capacity.block_size,
            hbm_blocks_per_replica=capacity.hbm_blocks,
            cpu_bytes_per_replica=capacity.cpu_bytes,
            nvme_bytes_per_replica=capacity.nvme_bytes,
            dedicated_to=dedicated_to,
            engine=settings,
        )

    pools[SHARED_POOL] = _pool(SHARED_POOL, None)
    for decision in decisions:
        if not decision.admitted or decision.quota is None:
            continue
        tenant = by_name[decision.name]
        spec = tenant.spec
        isolation = Isolation(spec.isolation.value)
        if isolation is Isolation.DEDICATED:
            pools[decision.pool] = _pool(decision.pool, decision.name)
        tier = SlaTier(spec.tier.value)
        limits = spec.rate_limits
        entries[decision.name] = TenantEntry(
            name=decision.name,
            tier=tier,
            priority=TIER_PRIORITY[tier],
            isolation=isolation,
            salt_id=pool_salt if isolation is Isolation.SHARED else tenant_salt_id(tenant),
            pool=decision.pool,
            models=[served],
            quota=decision.quota,
            ttl=_ttls(md, tenant),
            rate_limits=RateLimits(
                requests_per_minute=limits.requests_per_minute,
                tokens_per_minute=limits.tokens_per_minute,
                max_concurrent=limits.max_concurrent,
            ),
        )
    meta = md.metadata
    return TenantTable(
        model_deployment=f"{meta.get('namespace')}/{meta.get('name')}",
        served_model_name=served,
        pool_salt_id=pool_salt,
        pools=pools,
        tenants=entries,
    )
