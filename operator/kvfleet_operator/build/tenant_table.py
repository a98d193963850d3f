"""From the custom resources to the data plane's tenant table: capacity, quota admission, salts. Pure.

The pool's KV capacity comes from the planner's math (``kvfleet_runtime.kv.sizing``), the same numbers
``kvfleet plan`` prints. Quotas are admitted per replica, because every engine replica governs its own
block pool: a tenant's ``20%`` is 20% of each replica's blocks.

Admission is sticky (:func:`admit_tenants`): a tenant that was admitted stays admitted, at the quota it
was admitted at, until its own edit is admitted or it is deleted. The durable memory of what was admitted
is the tenant's ``status.admittedQuota`` (the reconcile is level-triggered and keeps nothing between runs).
Each reconcile first re-admits the tenants admitted before at their admitted quota, then considers new
tenants and raised quotas, first come, first served (creation time, then name): a new tenant whose
guarantee would push the sum of guarantees past the capacity of its pool, or whose guarantee exceeds its
burst limit, is rejected with ``QuotaExceedsCapacity`` and the numbers; an admitted tenant whose raised
quota does not fit keeps serving at its admitted quota with ``QuotaChangeRefused``. A younger tenant that
is serving never loses its admission because an older one asks for more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.tenant import QuotaTerms
from kvfleet_operator.api.units import parse_duration, parse_quantity
from kvfleet_operator.build.common import MODEL_MOUNT, NVME_MOUNT, SHARED_POOL
from kvfleet_operator.build.keys import pool_salt_id, tenant_salt_id
from kvfleet_operator.build.shared_tier import shared_tier_bytes, shared_tier_host, with_shared_tier
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
            reserve_bytes_per_gpu=parse_quantity(spec.pool.reserve_per_gpu),
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
    """What admission decided for one tenant.

    ``admitted`` tenants are served with ``quota`` (resolved) and ``terms`` (the same quota in spec units,
    recorded as ``status.admittedQuota``); ``requested`` is what the spec asks for. When the two differ,
    the tenant's change was refused (``reason`` is ``QuotaChangeRefused``, ``refused`` says why) and it keeps
    serving at its admitted quota.
    """

    name: str
    admitted: bool
    reason: str
    message: str
    pool: str
    quota: KVQuota | None = None
    requested: QuotaTerms | None = None
    terms: QuotaTerms | None = None
    #: Why the requested change was not admitted, while the tenant keeps its admitted quota.
    refused: str | None = None


def dedicated_pool_name(tenant: str) -> str:
    return f"dedicated-{tenant}"


def _hbm_blocks(amount: int | str, capacity: PoolCapacity) -> int:
    if isinstance(amount, int):
        return compute_blocks_for_tokens(amount, capacity.block_size)
    return compute_blocks_for_share(amount, capacity.hbm_blocks)


def creation_order(tenant: Tenant) -> tuple[str, str]:
    meta = tenant.metadata
    return (str(meta.get("creationTimestamp", "")), str(meta.get("name", "")))


def requested_terms(tenant: Tenant) -> QuotaTerms:
    """The quota the tenant's spec asks for, in spec units."""
    spec = tenant.spec
    return QuotaTerms(
        hbm=spec.kv_quota.hbm,
        cpu=spec.kv_quota.cpu,
        nvme=spec.kv_quota.nvme,
        burst_limit=spec.burst_limit or DEFAULT_BURST,
    )


def admitted_terms(tenant: Tenant) -> QuotaTerms | None:
    """The quota the tenant was admitted at by an earlier reconcile (its status), ``None`` if it was not."""
    return tenant.status.admitted_quota if tenant.status is not None else None


def _describe(terms: QuotaTerms) -> str:
    return f"hbm {terms.hbm}, cpu {terms.cpu}, nvme {terms.nvme}, burstLimit {terms.burst_limit}"


@dataclass(frozen=True)
class _Amounts:
    """A quota resolved against the pool: HBM blocks (guarantee and burst), CPU and NVMe bytes."""

    hbm: int
    burst: int
    cpu: int
    nvme: int

    def within(self, other: _Amounts) -> bool:
        """Whether every guarantee is at most ``other``'s (a decrease or no change)."""
        return self.hbm <= other.hbm and self.cpu <= other.cpu and self.nvme <= other.nvme

    def quota(self) -> KVQuota:
        return KVQuota(
            hbm_blocks=self.hbm, hbm_burst_blocks=self.burst, cpu_bytes=self.cpu, nvme_bytes=self.nvme
        )


_NOTHING = _Amounts(0, 0, 0, 0)


def _resolve(terms: QuotaTerms, capacity: PoolCapacity) -> _Amounts:
    return _Amounts(
        hbm=_hbm_blocks(terms.hbm, capacity),
        burst=compute_blocks_for_share(terms.burst_limit, capacity.hbm_blocks),
        cpu=parse_quantity(terms.cpu),
        nvme=parse_quantity(terms.nvme),
    )


def _problems(amounts: _Amounts, terms: QuotaTerms, capacity: PoolCapacity, base: _Amounts) -> list[str]:
    """Why ``amounts`` cannot be guaranteed on top of ``base`` (what the pool already guarantees)."""
    problems: list[str] = []
    if amounts.hbm > capacity.hbm_blocks:
        problems.append(
            f"HBM quota {terms.hbm} is {amounts.hbm} blocks but a replica holds {capacity.hbm_blocks}"
        )
    if amounts.hbm > amounts.burst:
        problems.append(
            f"HBM quota is {amounts.hbm} blocks, above the burst limit {terms.burst_limit} ({amounts.burst} "
            "blocks); raise spec.burstLimit or lower spec.kvQuota.hbm"
        )
    if base.hbm + amounts.hbm > capacity.hbm_blocks:
        problems.append(
            f"HBM guarantees would total {base.hbm + amounts.hbm} of {capacity.hbm_blocks} blocks per "
            f"replica ({base.hbm} already guaranteed to other tenants)"
        )
    if base.cpu + amounts.cpu > capacity.cpu_bytes:
        problems.append(
            f"CPU-tier guarantees would total {base.cpu + amounts.cpu} of {capacity.cpu_bytes} bytes per "
            "replica"
        )
    if base.nvme + amounts.nvme > capacity.nvme_bytes:
        problems.append(
            f"NVMe-tier guarantees would total {base.nvme + amounts.nvme} of {capacity.nvme_bytes} bytes per "
            "replica"
        )
    return problems


class _SharedPool:
    """The guarantees of the shared pool admitted so far. A dedicated pool serves one tenant, so only the
    shared pool's guarantees add up; a dedicated tenant is checked against an empty pool."""

    def __init__(self) -> None:
        self.used = _NOTHING

    def base(self, dedicated: bool, without: _Amounts = _NOTHING) -> _Amounts:
        if dedicated:
            return _NOTHING
        u = self.used
        return _Amounts(u.hbm - without.hbm, 0, u.cpu - without.cpu, u.nvme - without.nvme)

    def take(self, dedicated: bool, amounts: _Amounts, instead_of: _Amounts = _NOTHING) -> None:
        if not dedicated:
            base = self.base(False, instead_of)
            self.used = _Amounts(base.hbm + amounts.hbm, 0, base.cpu + amounts.cpu, base.nvme + amounts.nvme)


def admit_tenants(
    capacity: PoolCapacity, tenants: Sequence[Tenant], held: Sequence[Tenant] = ()
) -> list[TenantDecision]:
    """Sticky admission of ``tenants`` (see the module docstring); one decision per tenant, in creation
    order.

    ``held`` are tenants that cannot be served this time (their API key is refused) but keep the room of
    their admitted quota, so that fixing the key brings them back at the quota they had.

    1. Tenants admitted before (``status.admittedQuota``), in creation order: a tenant whose request is
       its admitted quota or less is admitted at the request; one that asks for more (or for something
       invalid) keeps the room of its admitted quota and waits for step 2. Only a pool that shrank can make
       an admitted quota not fit; then the youngest such tenants lose their admission.
    2. New tenants and raised quotas, in creation order: a raise that fits replaces the admitted quota;
       one that does not is refused (``QuotaChangeRefused``) and the tenant keeps its admitted quota; a new
       tenant that does not fit is rejected (``QuotaExceedsCapacity``).
    """
    pool = _SharedPool()
    eligible = {str(t.metadata["name"]) for t in tenants}
    decisions: dict[str, TenantDecision] = {}
    #: Step 2's claims: the tenant, its pool, what it asks for and what it keeps if that is refused.
    claims: list[tuple[Tenant, str, QuotaTerms, QuotaTerms | None]] = []

    def admit(name: str, pool_name: str, amounts: _Amounts, requested: QuotaTerms, terms: QuotaTerms) -> None:
        decisions[name] = TenantDecision(
            name=name,
            admitted=True,
            reason=reasons.ADMITTED,
            message=f"{amounts.hbm} guaranteed HBM blocks per replica, burst up to {amounts.burst}.",
            pool=pool_name,
            quota=amounts.quota(),
            requested=requested,
            terms=terms,
        )

    def reject(name: str, pool_name: str, requested: QuotaTerms, problems: list[str]) -> None:
        decisions[name] = TenantDecision(
            name=name,
            admitted=False,
            reason=reasons.QUOTA_EXCEEDS_CAPACITY,
            message="; ".join(problems) + ". Nothing was applied for this tenant.",
            pool=pool_name,
            requested=requested,
        )

    for tenant in sorted([*tenants, *held], key=creation_order):
        name = str(tenant.metadata["name"])
        dedicated = tenant.spec.isolation.value == Isolation.DEDICATED.value
        pool_name = dedicated_pool_name(name) if dedicated else SHARED_POOL
        requested, previous = requested_terms(tenant), admitted_terms(tenant)
        if previous is None:
            if name in eligible:
                claims.append((tenant, pool_name, requested, None))
            continue
        kept = _resolve(previous, capacity)
        if name in eligible:
            asked = _resolve(requested, capacity)
            if asked.within(kept) and not _problems(asked, requested, capacity, pool.base(dedicated)):
                pool.take(dedicated, asked)
                admit(name, pool_name, asked, requested, requested)
                continue
        if _problems(kept, previous, capacity, pool.base(dedicated)):
            if name in eligible:  # the pool shrank under it
                reject(name, pool_name, requested, _problems(kept, previous, capacity, pool.base(dedicated)))
            continue
        pool.take(dedicated, kept)
        if name in eligible:
            claims.append((tenant, pool_name, requested, previous))

    for tenant, pool_name, requested, previous in claims:
        name = str(tenant.metadata["name"])
        dedicated = pool_name != SHARED_POOL
        asked = _resolve(requested, capacity)
        kept = _resolve(previous, capacity) if previous is not None else _NOTHING
        problems = _problems(asked, requested, capacity, pool.base(dedicated, without=kept))
        if not problems:
            pool.take(dedicated, asked, instead_of=kept)
            admit(name, pool_name, asked, requested, requested)
        elif previous is None:
            reject(name, pool_name, requested, problems)
        else:
            admit(name, pool_name, kept, requested, previous)
            decisions[name] = dataclasses.replace(
                decisions[name],
                reason=reasons.QUOTA_CHANGE_REFUSED,
                refused=f"the requested quota ({_describe(requested)}) was not admitted: "
                + "; ".join(problems)
                + f". It keeps serving at its admitted quota ({_describe(previous)}).",
            )
    return [decisions[str(t.metadata["name"])] for t in sorted(tenants, key=creation_order)]


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
    if shared_tier_bytes(md):
        # Only the shared pool's replicas reach the shared KV tier; dedicated pools keep theirs to themselves.
        host = shared_tier_host(str(md.metadata.get("namespace")), str(md.metadata.get("name")))
        engine = with_shared_tier(settings, host, md.spec.kv_cache.chunk_size)
        pools[SHARED_POOL] = pools[SHARED_POOL].model_copy(update={"engine": engine})
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
            fair_share_weight=spec.fair_share_weight,
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
