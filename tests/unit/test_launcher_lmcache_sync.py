"""The pure core of the LMCache quota sync (kvfleet_runtime.engine.lmcache_sync)."""

from __future__ import annotations

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    TenantEntry,
    TenantTable,
    TierTTLs,
    derive_cache_salt,
)
from kvfleet_runtime.engine.lmcache_sync import (
    GIB,
    QuotaState,
    SaltActivity,
    bytes_to_limit_gb,
    compute_l1_bytes_by_salt,
    compute_salt_quotas,
    compute_sync_plan,
    compute_tenant_usage,
    observe_activity,
    parse_lmcache_metrics,
    parse_quota_listing,
)

KEYS = KeyFile(salt_key_hex="cd" * 32, key_hashes={})


def _tenant(name: str, iso: Isolation, nvme: int, ttl: float = 100.0, pool: str = "p") -> TenantEntry:
    return tenant_entry(
        name,
        isolation=iso,
        salt_id="pool" if iso is Isolation.SHARED else name,
        pool=pool,
        hbm=1,
        cpu=nvme // 2,
        nvme=nvme,
        ttl=TierTTLs(nvme_seconds=ttl),
    )


def _table(*tenants: TenantEntry) -> TenantTable:
    pools = [
        pool_entry("p", block_size=32, hbm_blocks=10),
        pool_entry("d", block_size=32, hbm_blocks=10, dedicated_to="z"),
    ]
    return tenant_table(*tenants, pools=pools)


def salt(salt_id: str) -> str:
    return derive_cache_salt(KEYS.salt_key, salt_id)


def test_shared_tenants_sum_quotas_and_take_the_longest_ttl() -> None:
    t = _table(
        _tenant("a", Isolation.SALTED, 100),
        _tenant("s1", Isolation.SHARED, 300, ttl=50),
        _tenant("s2", Isolation.SHARED, 500, ttl=70),
        _tenant("z", Isolation.DEDICATED, 900, pool="d"),
    )
    q = compute_salt_quotas(t, KEYS, "p")
    assert set(q) == {salt("a"), salt("pool")}
    shared = q[salt("pool")]
    assert shared.tenants == ("s1", "s2")
    assert shared.nvme_bytes == 800 and shared.nvme_ttl_seconds == 70
    assert shared.tenant_nvme_bytes == {"s1": 300, "s2": 500}
    assert q[salt("a")].nvme_bytes == 100
    assert set(compute_salt_quotas(t, KEYS, "d")) == {salt("z")}
    assert len(compute_salt_quotas(t, KEYS, None)) == 3


def test_limit_gb_never_rounds_below_the_quota() -> None:
    for n in (1, 131_072, 393_216, 3 * GIB + 7, 10**12 + 1):
        assert int(bytes_to_limit_gb(n) * GIB) >= n
        assert int(bytes_to_limit_gb(n) * GIB) - n <= 1


def test_plan_puts_missing_and_changed_quotas_deletes_removed_ones() -> None:
    q = compute_salt_quotas(
        _table(_tenant("a", Isolation.SALTED, 1000), _tenant("b", Isolation.SALTED, 2000)), KEYS
    )
    current = {salt("a"): QuotaState(1000, 5), salt("b"): QuotaState(10, 0), "gone": QuotaState(50, 40)}
    plan = compute_sync_plan(q, current, {}, now=0.0)
    assert plan.put == {salt("b"): 2000}
    assert plan.delete == ("gone",)
    assert plan.clear_l1
    converged = {salt("a"): QuotaState(1000, 5), salt("b"): QuotaState(2000, 0)}
    plan = compute_sync_plan(q, converged, {}, now=0.0)
    assert plan.put == {} and plan.delete == () and not plan.clear_l1


def test_salt_removed_while_server_forgot_its_quota_still_clears_l1() -> None:
    q = compute_salt_quotas(_table(_tenant("a", Isolation.SALTED, 1000)), KEYS)
    plan = compute_sync_plan(q, {salt("a"): QuotaState(1000, 0)}, {}, 0.0, known_salts={salt("a"), "old"})
    assert plan.delete == () and plan.clear_l1


def test_idle_past_ttl_sets_quota_to_zero_until_active_again() -> None:
    q = compute_salt_quotas(_table(_tenant("a", Isolation.SALTED, 1000, ttl=10)), KEYS)
    s = salt("a")
    activity: dict[str, SaltActivity] = {}
    metrics = {"lmcache_mp_lookup_requested_tokens_total": {s: 100.0}}
    usage = {s: QuotaState(1000, 500)}
    observe_activity(activity, [s], metrics, usage, now=0.0)
    assert compute_sync_plan(q, usage, activity, now=5.0).put == {}
    plan = compute_sync_plan(q, usage, activity, now=11.0)
    assert plan.put == {s: 0} and plan.expired_now == (s,)
    activity[s].expired = True
    # LMCache empties the salt: usage change alone is not activity.
    emptied = {s: QuotaState(0, 0)}
    observe_activity(activity, [s], metrics, emptied, now=12.0)
    plan = compute_sync_plan(q, emptied, activity, now=12.0)
    assert plan.put == {} and plan.expired_now == ()
    # A new lookup re-arms the quota.
    observe_activity(
        activity, [s], {"lmcache_mp_lookup_requested_tokens_total": {s: 200.0}}, emptied, now=20.0
    )
    assert compute_sync_plan(q, emptied, activity, now=20.0).put == {s: 1000}


def test_parse_quota_listing_and_default_salt() -> None:
    body = {"users": {"x": {"limit_gb": 0.5, "current_usage_gb": 0.25}, "_default": {"limit_gb": 1.0}}}
    parsed = parse_quota_listing(body)
    assert parsed["x"] == QuotaState(GIB // 2, GIB // 4)
    assert parsed[""].limit_bytes == GIB and parsed[""].usage_bytes == 0


METRICS = """# HELP lmcache_mp_l1_write_chunks_total x
lmcache_mp_l1_write_chunks_total{cache_salt="a",l1_tag="_default"} 10.0
lmcache_mp_l1_write_chunks_total{cache_salt="b",l1_tag="_default"} 4.0
lmcache_mp_l1_evicted_chunks_total{cache_salt="a",l1_tag="_default"} 4.0
lmcache_mp_l1_memory_usage_bytes{backend="dram",l1_tag="_default"} 1.31072e+06
lmcache_mp_lookup_requested_tokens_total{cache_salt="a",model_name="m"} 256.0
lmcache_mp_lookup_requested_tokens_total{cache_salt="a",model_name="n"} 512.0
python_gc_objects_collected_total{generation="0"} 1.0
"""


def test_parse_metrics_sums_series_per_salt() -> None:
    m = parse_lmcache_metrics(METRICS)
    assert m["lmcache_mp_lookup_requested_tokens_total"] == {"a": 768.0}
    assert m["lmcache_mp_l1_memory_usage_bytes"] == {"*": 1_310_720.0}
    assert "python_gc_objects_collected_total" not in m


def test_l1_estimate_splits_memory_by_resident_chunks() -> None:
    m = parse_lmcache_metrics(METRICS)
    # Resident: a = 10 - 4 = 6, b = 4 -> 10 chunks in 1,310,720 bytes.
    assert compute_l1_bytes_by_salt(m, {}) == {"a": 786_432, "b": 524_288}
    # After a clear the baseline hides what was resident then.
    assert compute_l1_bytes_by_salt(m, {"a": 6.0, "b": 4.0}) == {"a": 0, "b": 0}


def test_a_governed_l1_reports_exact_bytes_per_salt_which_win_over_the_estimate() -> None:
    governed = METRICS + (
        'kvfleet_lmcache_l1_bytes{cache_salt="a"} 655360.0\n'
        'kvfleet_lmcache_l1_bytes{cache_salt="b"} 0.0\n'
        'kvfleet_lmcache_l1_evictions_total{cache_salt="a",reason="ttl"} 3.0\n'
    )
    m = parse_lmcache_metrics(governed)
    assert m["kvfleet_lmcache_l1_evictions_total"] == {"a": 3.0}
    assert compute_l1_bytes_by_salt(m, {}) == {"a": 655_360, "b": 0}


def test_tenant_usage_of_a_shared_salt_adds_up() -> None:
    q = compute_salt_quotas(
        _table(
            _tenant("s1", Isolation.SHARED, 1),
            _tenant("s2", Isolation.SHARED, 1),
            _tenant("s3", Isolation.SHARED, 1),
        ),
        KEYS,
    )
    usage = compute_tenant_usage(q, {salt("pool"): 100})
    assert sum(usage.values()) == 100
    assert sorted(usage.values()) == [33, 33, 34]
