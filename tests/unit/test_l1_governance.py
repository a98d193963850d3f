"""The per-salt governance of LMCache's L1 (engine/l1_governance.py): limits from the table, the cycle."""

from __future__ import annotations

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
    derive_cache_salt,
)
from kvfleet_runtime.engine.l1_governance import L1Governor, L1Limits, compute_l1_limits
from kvfleet_runtime.kv.limits import TenantLimits
from kvfleet_runtime.kv.policy import EvictionReason

SALT_KEY = "cd" * 32
MIB = 1 << 20


def entry(
    name: str, cpu: int, ttl: float = 600.0, *, shared: bool = False, sla: SlaTier = SlaTier.STANDARD
) -> TenantEntry:
    return tenant_entry(
        name,
        tier=sla,
        isolation=Isolation.SHARED if shared else Isolation.SALTED,
        models=["tiny"],
        hbm=1,
        cpu=cpu,
        ttl=TierTTLs(cpu_seconds=ttl),
    )


def table(*tenants: TenantEntry, burst_cap: float = 0.5) -> tuple[TenantTable, KeyFile]:
    tbl = tenant_table(
        *tenants,
        pools=[pool_entry(block_size=32, hbm_blocks=64, cpu_bytes_per_replica=64 * MIB, burst_cap=burst_cap)],
        model_deployment="ns/tiny",
        served_model_name="tiny",
    )
    return tbl, KeyFile(salt_key_hex=SALT_KEY, key_hashes={t.name: [] for t in tenants})


def salt(salt_id: str) -> str:
    return derive_cache_salt(bytes.fromhex(SALT_KEY), salt_id)


def test_limits_per_salt_follow_the_table_and_shared_tenants_pool_theirs() -> None:
    tbl, keys = table(
        entry("solo", 4 * MIB, ttl=30.0),
        entry("s1", 2 * MIB, ttl=10.0, shared=True),
        entry("s2", 3 * MIB, ttl=90.0, shared=True, sla=SlaTier.PREMIUM),
        entry("huge", 40 * MIB),
        burst_cap=0.25,
    )
    limits = compute_l1_limits(tbl, keys, "shared", capacity_bytes=100 * MIB)
    assert limits.per_salt[salt("salt-solo")] == TenantLimits(4 * MIB, 25 * MIB, 30.0, SlaTier.STANDARD)
    # Shared: quotas summed, TTL the longest, SLA the highest; one salt for both tenants.
    assert limits.per_salt[salt("pool")] == TenantLimits(5 * MIB, 25 * MIB, 90.0, SlaTier.PREMIUM)
    assert limits.tenants_of[salt("pool")] == ("s1", "s2")
    # A quota above the pool's burst cap raises the tenant's burst to its quota.
    assert limits.per_salt[salt("salt-huge")].burst == 40 * MIB
    assert limits.default.quota == 0 and limits.default.burst == 25 * MIB
    with pytest.raises(ValueError, match="pool 'nope' is not in the tenant table"):
        compute_l1_limits(tbl, keys, "nope", 100 * MIB)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(capacity: int, **per_salt: TenantLimits) -> tuple[L1Governor, Clock]:
    clock = Clock()
    default = TenantLimits(quota=0, burst=capacity // 2, ttl_seconds=1000.0)
    limits = L1Limits(per_salt=per_salt, tenants_of={s: (s,) for s in per_salt}, default=default)
    return L1Governor(capacity, limits, clock=clock), clock


def test_idle_entries_expire_and_a_salt_over_its_burst_loses_only_its_own_even_below_the_watermark() -> None:
    gov, clock = governor(
        100,
        a=TenantLimits(quota=10, burst=30, ttl_seconds=5.0),
        b=TenantLimits(quota=10, burst=50, ttl_seconds=100.0),
    )
    gov.on_stored([("b0", "b", 10)])
    clock.now = 1.0
    gov.on_stored([(f"a{i}", "a", 10) for i in range(4)])  # 40 > a's burst of 30
    victims = gov.select(used_bytes=50, total_bytes=100, watermark=0.8, ratio=0.2)
    assert [(v.key, v.reason) for v in victims] == [("a3", EvictionReason.OVER_QUOTA)]  # listed oldest-last
    clock.now = 7.0
    gov.on_used(["a0"])
    victims = gov.select(used_bytes=40, total_bytes=100, watermark=0.8, ratio=0.2)
    assert sorted(v.key for v in victims) == ["a1", "a2"]
    assert {v.reason for v in victims} == {EvictionReason.TTL}
    usage = gov.usage()
    assert usage["a"].resident_bytes == 10 and usage["b"].resident_bytes == 10
    assert usage["a"].evictions[EvictionReason.TTL] == 2
    assert usage["a"].evictions[EvictionReason.OVER_QUOTA] == 1


def test_under_pressure_the_salt_furthest_over_quota_pays_and_a_salt_within_quota_keeps_everything() -> None:
    gov, _ = governor(
        100,
        victim=TenantLimits(quota=30, burst=50, ttl_seconds=1000.0),
        flood=TenantLimits(quota=10, burst=50, ttl_seconds=1000.0),
    )
    gov.on_stored([(f"v{i}", "victim", 10) for i in range(3)])  # oldest entries, within quota
    gov.on_stored([(f"f{i}", "flood", 10) for i in range(5)])
    gov.on_stored([("x0", "stranger", 10)])  # a salt not in the table: quota 0
    # L1 reports 90% used: above the 80% watermark, so evict down to 60%.
    victims = gov.select(used_bytes=90, total_bytes=100, watermark=0.8, ratio=0.2)
    assert sum(v.size for v in victims) >= 30
    assert {v.key for v in victims} == {"x0", "f4", "f3"}  # tails first (see on_stored)
    assert all(v.reason is EvictionReason.OVER_QUOTA for v in victims)
    assert gov.usage()["victim"].resident_bytes == 30
    assert gov.tracked_bytes == 60
    # Below the watermark nothing goes.
    assert gov.select(used_bytes=60, total_bytes=100, watermark=0.8, ratio=0.2) == []


def test_victims_lmcache_cannot_delete_are_tracked_again_and_not_counted() -> None:
    gov, clock = governor(100, a=TenantLimits(quota=0, burst=10, ttl_seconds=1000.0))
    gov.on_stored([("k0", "a", 10), ("k1", "a", 10)])
    clock.now = 1.0
    victims = gov.select(used_bytes=20, total_bytes=100, watermark=0.8, ratio=0.2)
    assert [v.key for v in victims] == ["k1"]  # over its burst of 10
    gov.restore(victims)  # read-locked in LMCache: it stays
    assert gov.tracked_bytes == 20
    assert gov.usage()["a"].evictions[EvictionReason.OVER_QUOTA] == 0
    # It is now the most recently used: the next cycle takes the other one.
    assert [v.key for v in gov.select(used_bytes=20, total_bytes=100, watermark=0.8, ratio=0.2)] == ["k0"]


def test_reloaded_limits_apply_at_once_and_removed_salts_fall_back_to_the_default() -> None:
    gov, _ = governor(100, a=TenantLimits(quota=40, burst=40, ttl_seconds=1000.0))
    gov.on_stored([(f"k{i}", "a", 10) for i in range(4)])
    assert gov.select(used_bytes=40, total_bytes=100, watermark=0.8, ratio=0.2) == []
    default = TenantLimits(quota=0, burst=20, ttl_seconds=1000.0)
    gov.set_limits(L1Limits(per_salt={}, tenants_of={}, default=default))  # tenant a was removed
    victims = gov.select(used_bytes=40, total_bytes=100, watermark=0.8, ratio=0.2)
    assert len(victims) == 2 and gov.usage()["a"].resident_bytes == 20
    assert gov.usage()["a"].limits == default


def test_objects_lmcache_removes_itself_leave_the_accounting() -> None:
    gov, _ = governor(100)
    gov.on_stored([("k0", "s", 10), ("k1", "s", 7)])
    gov.on_stored([("k0", "s", 10)])  # rewritten: touched, not counted twice
    assert gov.tracked_bytes == 17
    gov.on_removed(["k0", "missing"])
    assert gov.tracked_bytes == 7 and gov.usage()["s"].resident_bytes == 7


def test_a_salt_removed_from_the_table_hands_out_all_its_objects_until_none_is_left() -> None:
    keep = TenantLimits(quota=40, burst=50, ttl_seconds=1000.0)
    gov, _ = governor(100, a=keep, b=keep)
    gov.on_stored([("a0", "a", 10), ("a1", "a", 10), ("b0", "b", 10)])
    assert gov.take_removed() == []
    gov.set_limits(L1Limits(per_salt={"b": keep}, tenants_of={"b": ("b",)}, default=keep))
    gone = gov.take_removed()
    assert sorted(gone, key=str) == [("a0", "a", 10), ("a1", "a", 10)]
    assert gov.tracked_bytes == 10  # b keeps its object
    gov.on_stored([g for g in gone if g[0] == "a1"])  # LMCache refused one (read-locked)
    assert gov.take_removed() == [("a1", "a", 10)]  # taken again next cycle
    assert gov.take_removed() == []
    # The salt coming back (tenant re-created) stops the removal.
    gov.on_stored([("a2", "a", 10)])
    gov.set_limits(L1Limits(per_salt={"a": keep, "b": keep}, tenants_of={}, default=keep))
    assert gov.take_removed() == []
