"""Unit tests of the KV policy core: one test per rule, accounting, the builders and the complexity."""

from __future__ import annotations

import random
import time

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    KVQuota,
    KVTier,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
)
from kvfleet_runtime.kv.limits import TenantLimits, build_tenant_limits, build_tier_limits
from kvfleet_runtime.kv.policy import EvictionReason, TierPolicy


def limits(
    quota: int, burst: int | None = None, ttl: float = 1000.0, sla: SlaTier = SlaTier.STANDARD
) -> TenantLimits:
    return TenantLimits(quota=quota, burst=quota if burst is None else burst, ttl_seconds=ttl, sla=sla)


def test_global_lru_when_nobody_is_over_quota_or_expired() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"a": limits(5, 10), "b": limits(5, 10)})
    for i in range(3):
        policy.insert(("a", i), "a", now=float(i))
        policy.insert(("b", i), "b", now=float(i) + 0.5)
    policy.touch(("a", 0), now=10.0)
    victims = policy.select_victims(3, now=11.0)
    assert [v.key for v in victims] == [("b", 0), ("a", 1), ("b", 1)]
    assert {v.reason for v in victims} == {EvictionReason.LRU}


def test_expired_entries_go_first_oldest_first_even_from_under_quota_tenants() -> None:
    policy = TierPolicy(KVTier.HBM, 100, {"short": limits(50, 50, ttl=5.0), "long": limits(1, 50, ttl=500.0)})
    policy.insert("long-old", "long", now=0.0)
    policy.insert("long-2", "long", now=0.5)  # makes "long" over quota, but TTL comes first
    policy.insert("short-1", "short", now=1.0)
    policy.insert("short-2", "short", now=2.0)
    policy.insert("short-fresh", "short", now=9.0)
    victims = policy.select_victims(3, now=10.0)
    assert [(v.key, v.reason) for v in victims] == [
        ("short-1", EvictionReason.TTL),
        ("short-2", EvictionReason.TTL),
        ("long-old", EvictionReason.OVER_QUOTA),
    ]
    assert victims[0].idle_seconds == pytest.approx(9.0)


def test_tenant_furthest_over_quota_loses_its_lru_first_and_is_re_ranked() -> None:
    policy = TierPolicy(KVTier.HBM, 100, {"a": limits(2, 50), "b": limits(4, 50), "c": limits(10, 50)})
    t = 0.0
    for tenant, count in (("a", 4), ("b", 6), ("c", 3)):
        for i in range(count):
            t += 1
            policy.insert(f"{tenant}{i}", tenant, now=t)
    # a: 4/2 -> +100%; b: 6/4 -> +50%; c is under quota.
    victims = policy.select_victims(4, now=t)
    assert [v.key for v in victims] == ["a0", "a1", "b0", "b1"]
    assert all(v.reason is EvictionReason.OVER_QUOTA for v in victims)
    assert policy.usage("c").entries == 3
    assert policy.evictions_of("a")[EvictionReason.OVER_QUOTA] == 2
    # everyone at quota now: global LRU takes the oldest, whoever owns it
    assert [v.key for v in policy.select_victims(1, now=t)] == ["a2"]


def test_ties_in_overshoot_evict_basic_before_premium() -> None:
    policy = TierPolicy(
        KVTier.HBM,
        100,
        {"gold": limits(2, 50, sla=SlaTier.PREMIUM), "bronze": limits(2, 50, sla=SlaTier.BASIC)},
    )
    policy.insert("g0", "gold", now=0.0)
    policy.insert("g1", "gold", now=0.0)
    policy.insert("g2", "gold", now=0.0)
    policy.insert("b0", "bronze", now=1.0)
    policy.insert("b1", "bronze", now=1.0)
    policy.insert("b2", "bronze", now=1.0)
    assert [v.tenant for v in policy.select_victims(1, now=2.0)] == ["bronze"]


def test_tenant_above_burst_cap_is_ranked_before_larger_relative_overshoot() -> None:
    policy = TierPolicy(KVTier.HBM, 100, {"big": limits(40, 45), "small": limits(1, 50)})
    for i in range(46):
        policy.insert(f"big{i}", "big", now=1.0)
    for i in range(3):  # +200% over quota, but under its burst
        policy.insert(f"small{i}", "small", now=0.0)
    assert policy.select_victims(1, now=2.0)[0].tenant == "big"


def test_pinned_entries_are_never_victims_and_unpin_makes_them_most_recent() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"a": limits(10, 10)})
    policy.insert("x", "a", now=0.0, pinned=True)
    policy.insert("y", "a", now=1.0)
    policy.pin("y")
    policy.pin("y")  # two running requests share it
    assert policy.select_victims(5, now=2.0) == []
    policy.unpin("y", now=3.0)
    assert policy.select_victims(5, now=3.0) == []  # still referenced once
    policy.unpin("y", now=4.0)
    policy.unpin("x", now=5.0)
    assert [v.key for v in policy.select_victims(5, now=6.0)] == ["y", "x"]
    with pytest.raises(KeyError):
        policy.unpin("y", now=7.0)


def test_unpin_below_zero_is_an_error() -> None:
    policy = TierPolicy(KVTier.HBM, 10)
    policy.insert("x", "a", now=0.0)
    with pytest.raises(ValueError, match="not pinned"):
        policy.unpin("x", now=1.0)


def test_burst_cap_makes_a_full_tenant_recycle_its_own_entries() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"flood": limits(0, 5, ttl=1e6), "quiet": limits(5, 5, ttl=1e6)})
    for i in range(5):
        policy.insert(f"q{i}", "quiet", now=float(i))  # quiet's entries are the oldest
    for i in range(5):
        policy.insert(f"f{i}", "flood", now=10.0 + i)
    result = policy.admit("f-new", "flood", now=20.0)
    assert result.admitted
    assert [(v.key, v.reason) for v in result.victims] == [("f0", EvictionReason.OVER_QUOTA)]
    assert policy.usage("quiet").entries == 5


def test_premium_reservation_is_taken_only_when_nothing_else_is_left() -> None:
    policy = TierPolicy(
        KVTier.HBM, 10, {"gold": limits(3, 5, sla=SlaTier.PREMIUM), "std": limits(3, 5, sla=SlaTier.STANDARD)}
    )
    for i in range(3):
        policy.insert(f"g{i}", "gold", now=float(i))
    for i in range(3):
        policy.insert(f"s{i}", "std", now=10.0 + i)
    victims = policy.select_victims(4, now=20.0)
    assert [v.key for v in victims] == ["s0", "s1", "s2", "g0"]


def test_unknown_tenant_gets_default_quota_zero_and_goes_first() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"known": limits(5, 5)})
    policy.insert("k", "known", now=0.0)
    policy.insert("u", "stranger", now=5.0)
    victims = policy.select_victims(1, now=6.0)
    assert [(v.key, v.reason) for v in victims] == [("u", EvictionReason.OVER_QUOTA)]


def test_make_room_counts_sizes_and_admit_refuses_when_everything_is_pinned() -> None:
    policy = TierPolicy(KVTier.CPU, 1000, {"a": limits(1000, 1000)})
    policy.insert("c1", "a", now=0.0, size=400)
    policy.insert("c2", "a", now=1.0, size=400)
    victims = policy.make_room(500, now=2.0)
    assert [v.key for v in victims] == ["c1"]
    assert policy.free == 600
    policy.insert("c3", "a", now=3.0, size=500, pinned=True)
    result = policy.admit("c4", "a", now=4.0, size=600)
    assert not result.admitted
    assert "c4" not in policy
    assert policy.used == 500  # c2 went, c3 is pinned
    assert not policy.admit("huge", "a", now=5.0, size=1001).admitted


def test_expire_removes_everything_idle_past_ttl_and_nothing_else() -> None:
    policy = TierPolicy(KVTier.CPU, 100, {"a": limits(50, 50, ttl=10.0), "b": limits(50, 50, ttl=100.0)})
    policy.insert("a-old", "a", now=0.0)
    policy.insert("a-new", "a", now=15.0)
    policy.insert("b-old", "b", now=0.0)
    policy.insert("a-pinned", "a", now=0.0, pinned=True)
    assert [v.key for v in policy.expire(now=20.0)] == ["a-old"]
    assert set(policy.entry_keys()) == {"a-new", "b-old", "a-pinned"}


def test_trim_to_burst_takes_only_the_offenders_own_oldest_entries() -> None:
    policy = TierPolicy(KVTier.CPU, 100, {"a": limits(10, 30, ttl=50.0), "b": limits(10, 30)})
    for i in range(5):
        policy.insert(("a", i), "a", now=float(i), size=10)  # 50 bytes: 20 above a's burst of 30
    policy.insert(("b", 0), "b", now=0.0, size=10)  # b is older but within its burst
    policy.insert("a-pinned", "a", now=0.0, size=5, pinned=True)
    victims = policy.trim_to_burst(now=52.0)
    assert [v.key for v in victims] == [("a", 0), ("a", 1), ("a", 2)]
    # The first two were also idle past a's TTL (50 s): they are counted as expiries.
    assert [v.reason for v in victims] == [EvictionReason.TTL, EvictionReason.TTL, EvictionReason.OVER_QUOTA]
    assert policy.usage("a").size == 25 and policy.usage("b").size == 10
    assert policy.trim_to_burst(now=53.0) == []  # idempotent once everyone is within burst


def test_remove_drop_tenant_and_clear_keep_accounting_exact() -> None:
    policy = TierPolicy(KVTier.HBM, 100)
    for i in range(5):
        policy.insert(i, "a", now=0.0, pinned=i == 0)
    policy.insert("b", "b", now=0.0, size=3)
    assert policy.remove(1)
    assert not policy.remove(1)
    assert policy.usage("a").entries == 4
    assert sorted(map(str, policy.drop_tenant("a"))) == ["2", "3", "4"]
    assert policy.usage("a").entries == 1  # the pinned one stays
    assert policy.usage("a").pinned_entries == 1
    assert policy.used == 4
    assert policy.evictions == {}  # host removals are not policy evictions
    policy.clear()
    assert policy.used == 0
    assert len(policy) == 0


def test_touch_moves_to_most_recent_and_reports_presence() -> None:
    policy = TierPolicy(KVTier.HBM, 10)
    policy.insert("x", "a", now=0.0)
    policy.insert("y", "a", now=1.0)
    assert policy.touch("x", now=2.0)
    assert not policy.touch("zzz", now=2.0)
    info = policy.get("x")
    assert info is not None
    assert info.last_use == 2.0
    assert [v.key for v in policy.select_victims(1, now=3.0)] == ["y"]


def test_clock_never_goes_backwards() -> None:
    policy = TierPolicy(KVTier.HBM, 10)
    policy.insert("x", "a", now=10.0)
    policy.insert("y", "a", now=5.0)  # clamped to 10
    info = policy.get("y")
    assert info is not None
    assert info.last_use == 10.0
    assert [v.key for v in policy.select_victims(2, now=11.0)] == ["x", "y"]


def test_set_limits_takes_effect_at_once() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"a": limits(5, 5), "b": limits(5, 5)})
    policy.insert("a0", "a", now=0.0)
    policy.insert("b0", "b", now=1.0)
    policy.insert("b1", "b", now=2.0)
    policy.set_limits("b", limits(1, 5))
    assert [v.key for v in policy.select_victims(1, now=3.0)] == ["b0"]


def test_duplicate_insert_is_rejected() -> None:
    policy = TierPolicy(KVTier.HBM, 10)
    policy.insert("x", "a", now=0.0)
    with pytest.raises(KeyError):
        policy.insert("x", "b", now=1.0)


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="burst"):
        TenantLimits(quota=5, burst=4, ttl_seconds=1.0)
    with pytest.raises(ValueError, match="ttl"):
        TenantLimits(quota=1, burst=1, ttl_seconds=0.0)


def _table() -> TenantTable:
    def tenant(name: str, tier: SlaTier, quota: KVQuota) -> TenantEntry:
        return tenant_entry(
            name,
            tier=tier,
            priority=0,
            salt_id=name,
            quota=quota,
            ttl=TierTTLs(hbm_seconds=20.0, cpu_seconds=300.0, nvme_seconds=3600.0),
        )

    return tenant_table(
        tenant("acme", SlaTier.PREMIUM, KVQuota(hbm_blocks=300, hbm_burst_blocks=900, cpu_bytes=4096)),
        tenant("tiny", SlaTier.BASIC, KVQuota(hbm_blocks=10, hbm_burst_blocks=20)),
        pools=[pool_entry(hbm_blocks=1000, burst_cap=0.4)],
        model_deployment="md",
    )


def test_builders_map_the_tenant_table_onto_tier_limits() -> None:
    table = _table()
    hbm = build_tier_limits(table, "shared", KVTier.HBM, capacity=1000)
    assert hbm["acme"] == TenantLimits(quota=300, burst=400, ttl_seconds=20.0, sla=SlaTier.PREMIUM)
    assert hbm["tiny"] == TenantLimits(quota=10, burst=20, ttl_seconds=20.0, sla=SlaTier.BASIC)
    cpu = build_tenant_limits(table.tenants["acme"], KVTier.CPU, capacity=100, unit_bytes=1024)
    assert cpu == TenantLimits(quota=4, burst=50, ttl_seconds=300.0, sla=SlaTier.PREMIUM)


def _ops_per_second(n: int, ops: int, tenants: int = 8) -> float:
    rng = random.Random(n)
    policy = TierPolicy(
        KVTier.HBM, n, {f"t{i}": limits(n // (2 * tenants), n // 2, ttl=50.0) for i in range(tenants)}
    )
    for i in range(n):
        policy.insert(i, f"t{i % tenants}", now=i * 1e-3)
    next_key = n
    now = n * 1e-3
    start = time.perf_counter()
    for _ in range(ops):
        now += 1e-3
        key = rng.randrange(next_key)
        if key in policy:
            policy.touch(key, now)
            policy.pin(key)
            policy.unpin(key, now)
        victims = policy.select_victims(1, now, requester=f"t{next_key % tenants}")
        assert len(victims) == 1
        policy.insert(next_key, f"t{next_key % tenants}", now)
        next_key += 1
    return ops / (time.perf_counter() - start)


def test_operations_do_not_slow_down_with_the_number_of_entries() -> None:
    small = max(_ops_per_second(1_000, 20_000) for _ in range(2))
    large = max(_ops_per_second(100_000, 20_000) for _ in range(2))
    # O(1)/O(log T) per op: 100x the entries may cost cache misses, never 100x the time.
    assert small / large < 3.0, (small, large)


def test_changing_the_default_limits_applies_to_tenants_without_their_own() -> None:
    policy = TierPolicy(KVTier.HBM, 10, {"known": limits(1, 5)}, default_limits=limits(10, 10))
    policy.insert("k0", "known", now=0.0)
    policy.insert("k1", "known", now=0.0)  # known is over its quota of 1
    policy.insert("s0", "stranger", now=1.0)
    assert [v.key for v in policy.select_victims(1, now=2.0)] == ["k0"]
    policy.default_limits = limits(0, 5)  # strangers are now always over quota, infinitely
    assert policy.limits("stranger").quota == 0
    assert policy.limits("known").quota == 1
    assert [v.key for v in policy.select_victims(1, now=3.0)] == ["s0"]
