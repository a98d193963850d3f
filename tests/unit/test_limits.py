"""Per-tenant limits on every tier from the tenant table (kvfleet_runtime.kv.limits), and the hosts that use
them (block-pool attribution, governed L1, LMCache quota sync) agreeing with it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    SLA_ORDER,
    SLA_RANK,
    TIER_PRIORITY,
    Isolation,
    KeyFile,
    KVTier,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
    derive_cache_salt,
)
from kvfleet_runtime.engine.attribution import SHARED_PREFIX, UNATTRIBUTED, build_attribution
from kvfleet_runtime.engine.l1_governance import compute_l1_limits
from kvfleet_runtime.engine.lmcache_sync import compute_salt_quotas
from kvfleet_runtime.kv.limits import (
    TenantLimits,
    best_sla,
    build_default_limits,
    build_group_limits,
    build_limits,
    build_tenant_limits,
    build_tier_limits,
    group_by_salt_id,
)
from kvfleet_runtime.kv.policy import TierPolicy

KIB = 1024
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})


def tenant(
    name: str,
    *,
    sla: SlaTier = SlaTier.STANDARD,
    hbm: int = 10,
    hbm_burst: int = 20,
    cpu: int = 0,
    nvme: int = 0,
    ttl: TierTTLs | None = None,
    shared: bool = False,
    pool: str = "shared",
) -> TenantEntry:
    return tenant_entry(
        name,
        tier=sla,
        priority=TIER_PRIORITY[sla],
        isolation=Isolation.SHARED if shared else Isolation.SALTED,
        pool=pool,
        hbm=hbm,
        hbm_burst=hbm_burst,
        cpu=cpu,
        nvme=nvme,
        ttl=ttl or TierTTLs(),
    )


def table(*tenants: TenantEntry, burst_cap: float = 0.5) -> TenantTable:
    return tenant_table(
        *tenants,
        pools=[
            pool_entry(hbm_blocks=100, burst_cap=burst_cap),
            pool_entry("gold", hbm_blocks=100, dedicated_to="g"),
        ],
    )


# -- the SLA order and the defaults, each defined once ---------------------------------------------------
def test_sla_order_ranks_and_priorities_derive_from_one_tuple() -> None:
    assert SLA_ORDER == (SlaTier.BASIC, SlaTier.STANDARD, SlaTier.PREMIUM)
    assert [SLA_RANK[t] for t in SLA_ORDER] == [0, 1, 2]
    # vLLM serves lower priorities first: the last to give way is the first served.
    assert TIER_PRIORITY == {SlaTier.PREMIUM: 0, SlaTier.STANDARD: 10, SlaTier.BASIC: 20}


@pytest.mark.parametrize(
    ("tier", "ttl"), [(KVTier.HBM, 30.0), (KVTier.CPU, 600.0), (KVTier.NVME, 86_400.0)], ids=str
)
def test_default_limits_guarantee_nothing_and_use_the_tiers_default_ttl(tier: KVTier, ttl: float) -> None:
    assert build_default_limits(tier, 1000) == TenantLimits(quota=0, burst=500, ttl_seconds=ttl)
    assert build_default_limits(tier, 1000, burst_cap=0.25).burst == 250
    # The policy core's own default for a tenant without limits is the same rule.
    assert TierPolicy(tier, 1000).default_limits == build_default_limits(tier, 1000)


# -- one tenant on each tier -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    entry: TenantEntry
    tier: KVTier
    capacity: int
    burst_cap: float
    want: TenantLimits
    unit_bytes: int = 1


TTLS = TierTTLs(hbm_seconds=20.0, cpu_seconds=300.0, nvme_seconds=3600.0)
CASES = [
    Case(
        "hbm: burst is the tenant's own, under the pool cap",
        tenant("a", hbm=10, hbm_burst=20, ttl=TTLS),
        KVTier.HBM,
        1000,
        0.5,
        TenantLimits(10, 20, 20.0),
    ),
    Case(
        "hbm: the pool cap bounds the tenant's burst",
        tenant("a", sla=SlaTier.PREMIUM, hbm=300, hbm_burst=900, ttl=TTLS),
        KVTier.HBM,
        1000,
        0.4,
        TenantLimits(300, 400, 20.0, SlaTier.PREMIUM),
    ),
    Case(
        "hbm: a guarantee above the pool cap is kept whole",
        tenant("a", hbm=700, hbm_burst=800),
        KVTier.HBM,
        1000,
        0.5,
        TenantLimits(700, 700, 30.0),
    ),
    Case(
        "cpu: bytes, the pool cap as burst",
        tenant("a", sla=SlaTier.BASIC, cpu=64 * KIB, ttl=TTLS),
        KVTier.CPU,
        1024 * KIB,
        0.25,
        TenantLimits(64 * KIB, 256 * KIB, 300.0, SlaTier.BASIC),
    ),
    Case(
        "cpu: counted in 1 KiB chunks",
        tenant("a", cpu=4 * KIB + 5, ttl=TTLS),
        KVTier.CPU,
        100,
        0.5,
        TenantLimits(4, 50, 300.0),
        unit_bytes=KIB,
    ),
    Case(
        "nvme: quota above the cap raises the burst",
        tenant("a", nvme=900, ttl=TTLS),
        KVTier.NVME,
        1000,
        0.5,
        TenantLimits(900, 900, 3600.0),
    ),
    Case(
        "nvme: no quota, default TTL",
        tenant("a"),
        KVTier.NVME,
        1000,
        0.5,
        TenantLimits(0, 500, 86_400.0),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tenant_limits(case: Case) -> None:
    got = build_tenant_limits(case.entry, case.tier, case.capacity, case.burst_cap, case.unit_bytes)
    assert got == case.want


# -- groups of tenants that share one cache salt -------------------------------------------------------
GROUP = (
    tenant("s1", sla=SlaTier.BASIC, hbm=10, hbm_burst=30, cpu=2 * KIB, nvme=100, shared=True,
           ttl=TierTTLs(hbm_seconds=10, cpu_seconds=900, nvme_seconds=60)),
    tenant("s2", sla=SlaTier.PREMIUM, hbm=20, hbm_burst=40, cpu=3 * KIB, nvme=50, shared=True,
           ttl=TierTTLs(hbm_seconds=50, cpu_seconds=100, nvme_seconds=7200)),
)  # fmt: skip


@pytest.mark.parametrize(
    ("tier", "capacity", "want"),
    [
        # quotas summed, HBM bursts summed (70 < the cap of 100), longest TTL, best SLA
        (KVTier.HBM, 200, TenantLimits(30, 70, 50.0, SlaTier.PREMIUM)),
        # the pool cap (50) bounds the summed burst, but never below the summed quota
        (KVTier.HBM, 100, TenantLimits(30, 50, 50.0, SlaTier.PREMIUM)),
        (KVTier.HBM, 40, TenantLimits(30, 30, 50.0, SlaTier.PREMIUM)),
        (KVTier.CPU, 100 * KIB, TenantLimits(5 * KIB, 50 * KIB, 900.0, SlaTier.PREMIUM)),
        (KVTier.NVME, 1000, TenantLimits(150, 500, 7200.0, SlaTier.PREMIUM)),
    ],
    ids=["hbm-own-bursts", "hbm-pool-cap", "hbm-quota-above-cap", "cpu", "nvme"],
)
def test_group_limits(tier: KVTier, capacity: int, want: TenantLimits) -> None:
    assert build_group_limits(GROUP, tier, capacity) == want
    assert build_group_limits(tuple(reversed(GROUP)), tier, capacity) == want  # order does not matter


def test_a_group_of_one_is_the_tenant_and_an_empty_group_is_refused() -> None:
    for tier in KVTier:
        assert build_group_limits(GROUP[:1], tier, 1000) == build_tenant_limits(GROUP[0], tier, 1000)
    with pytest.raises(ValueError, match="at least one member"):
        build_group_limits((), KVTier.HBM, 1000)


@pytest.mark.parametrize(
    ("tiers", "best"),
    [
        ((SlaTier.BASIC,), SlaTier.BASIC),
        ((SlaTier.BASIC, SlaTier.STANDARD), SlaTier.STANDARD),
        ((SlaTier.PREMIUM, SlaTier.BASIC), SlaTier.PREMIUM),
        ((SlaTier.STANDARD, SlaTier.STANDARD), SlaTier.STANDARD),
    ],
)
def test_best_sla(tiers: tuple[SlaTier, ...], best: SlaTier) -> None:
    assert best_sla([tenant(f"t{i}", sla=t) for i, t in enumerate(tiers)]) == best


def test_build_limits_raises_the_burst_to_the_quota() -> None:
    assert build_limits(10, 4, 1.0) == TenantLimits(10, 10, 1.0)
    assert build_limits(4, 10, 1.0, SlaTier.BASIC) == TenantLimits(4, 10, 1.0, SlaTier.BASIC)


def test_group_by_salt_id_filters_by_pool_and_ignores_table_order() -> None:
    entries = [
        tenant("zed"),
        tenant("s2", shared=True),
        tenant("gold", pool="gold"),
        tenant("s1", shared=True),
        tenant("abe"),
    ]
    groups = group_by_salt_id(table(*entries), "shared")
    assert {k: [m.name for m in v] for k, v in groups.items()} == {
        "salt-abe": ["abe"],
        "pool": ["s1", "s2"],
        "salt-zed": ["zed"],
    }
    assert list(groups) == ["salt-abe", "pool", "salt-zed"]  # by first member's name
    assert list(group_by_salt_id(table(*reversed(entries)), "shared")) == list(groups)
    assert set(group_by_salt_id(table(*entries))) == {"salt-abe", "pool", "salt-zed", "salt-gold"}


def test_tier_limits_cover_every_tenant_of_the_pool() -> None:
    tbl = table(tenant("a", hbm=5, hbm_burst=8), tenant("g", pool="gold"), burst_cap=0.5)
    assert build_tier_limits(tbl, "shared", KVTier.HBM, 100) == {"a": TenantLimits(5, 8, 30.0)}


# -- every host derives the same limits from the same table ------------------------------------------------
def test_hosts_use_the_same_limits() -> None:
    salted = tenant("solo", sla=SlaTier.BASIC, hbm=5, hbm_burst=9, cpu=7 * KIB, nvme=11)
    tbl = table(salted, *GROUP, burst_cap=0.25)
    pool_salt, solo_salt = (derive_cache_salt(KEYS.salt_key, s) for s in ("pool", "salt-solo"))

    hbm = build_attribution(tbl, KEYS, "shared", capacity=200)
    assert hbm.limits["solo"] == build_tenant_limits(salted, KVTier.HBM, 200, 0.25)
    assert hbm.limits[SHARED_PREFIX + "pool"] == build_group_limits(GROUP, KVTier.HBM, 200, 0.25)
    assert hbm.limits[UNATTRIBUTED] == build_default_limits(KVTier.HBM, 200, 0.25)

    l1 = compute_l1_limits(tbl, KEYS, "shared", capacity_bytes=100 * KIB)
    assert l1.per_salt[solo_salt] == build_tenant_limits(salted, KVTier.CPU, 100 * KIB, 0.25)
    assert l1.per_salt[pool_salt] == build_group_limits(GROUP, KVTier.CPU, 100 * KIB, 0.25)
    assert l1.default == build_default_limits(KVTier.CPU, 100 * KIB, 0.25)

    shared = compute_salt_quotas(tbl, KEYS, "shared")[pool_salt]
    nvme, cpu = (build_group_limits(GROUP, tier, 1000) for tier in (KVTier.NVME, KVTier.CPU))
    assert (shared.nvme_bytes, shared.nvme_ttl_seconds) == (nvme.quota, nvme.ttl_seconds)
    assert (shared.cpu_bytes, shared.cpu_ttl_seconds) == (cpu.quota, cpu.ttl_seconds)
    assert shared.tenants == ("s1", "s2")
    assert compute_salt_quotas(tbl, KEYS, "shared")[solo_salt].tenants == ("solo",)
