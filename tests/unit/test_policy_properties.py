"""Property tests of the KV policy core: random operation sequences checked against a reference model.

At every step: per-tenant accounting equals the sum over that tenant's entries. For every victim, in the
order returned, a shadow copy of the store (taken before the call) checks the selection rules: pinned
entries are never victims; expired entries go first (oldest first); then the LRU entry of the tenant
ranked furthest over quota; then the global LRU with premium reservations last; and so a tenant at or
under its quota never loses an entry to another tenant while expired or over-quota candidates exist.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_runtime.config import KVTier, SlaTier
from kvfleet_runtime.kv.limits import TenantLimits
from kvfleet_runtime.kv.policy import EvictionReason, TierPolicy

TENANTS = ["a", "b", "c", "d"]


@st.composite
def tenant_limits(draw: st.DrawFn) -> TenantLimits:
    # Small quotas exercise the over-quota stage; generous ones the global-LRU stage and reservations.
    quota = draw(st.one_of(st.integers(0, 6), st.integers(20, 40)))
    return TenantLimits(
        quota=quota,
        burst=quota + draw(st.integers(0, 10)),
        ttl_seconds=draw(st.sampled_from([0.5, 2.0, 5.0, 50.0])),
        sla=draw(st.sampled_from(list(SlaTier))),
    )


_insert = st.tuples(st.just("insert"), st.sampled_from(TENANTS), st.integers(1, 3), st.booleans())
_select = st.tuples(st.just("select"), st.integers(1, 6), st.sampled_from([None, *TENANTS]))
# Inserts and selections are listed several times: one_of picks branches uniformly, and victims only
# exist once the store has filled up.
op = st.one_of(
    _insert,
    _insert,
    _insert,
    _insert,
    _select,
    st.tuples(st.just("touch"), st.integers(0, 40)),
    st.tuples(st.just("pin"), st.integers(0, 40)),
    st.tuples(st.just("unpin"), st.integers(0, 40)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("select"), st.integers(1, 6), st.sampled_from([None, *TENANTS])),
    st.tuples(st.just("make_room"), st.integers(1, 8), st.sampled_from([None, *TENANTS])),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.1, 0.5, 3.0])),
)


@dataclass
class Shadow:
    tenant: str
    size: int
    last_use: float
    pins: int


def snapshot(policy: TierPolicy) -> dict[Hashable, Shadow]:
    out: dict[Hashable, Shadow] = {}
    for key in policy.entry_keys():
        info = policy.get(key)
        assert info is not None
        out[key] = Shadow(info.tenant, info.size, info.last_use, info.pins)
    return out


def check_accounting(policy: TierPolicy) -> None:
    snap = snapshot(policy)
    assert policy.used == sum(e.size for e in snap.values())
    for tenant in {*TENANTS, *(e.tenant for e in snap.values())}:
        mine = [e for e in snap.values() if e.tenant == tenant]
        usage = policy.usage(tenant)
        assert usage.entries == len(mine)
        assert usage.size == sum(e.size for e in mine)
        assert usage.pinned_entries == sum(1 for e in mine if e.pins)


def over_rank(policy: TierPolicy, tenant: str, size: int) -> tuple[int, float, int]:
    """Larger evicts first, mirroring the documented ranking."""
    lim = policy.limits(tenant)
    ratio = math.inf if lim.quota == 0 else (size - lim.quota) / lim.quota
    sla_rank = {SlaTier.BASIC: 2, SlaTier.STANDARD: 1, SlaTier.PREMIUM: 0}[lim.sla]
    return (1 if size > lim.burst else 0, ratio, sla_rank)


def check_victims(
    policy: TierPolicy,
    before: dict[Hashable, Shadow],
    victims: list,  # type: ignore[type-arg]
    now: float,
    requester: str | None,
    incoming: int,
) -> None:
    snap = dict(before)
    for victim in victims:
        assert victim.key in snap, "a victim must have been present"
        entry = snap[victim.key]
        assert entry.pins == 0, "pinned entries are never victims"
        assert entry.tenant == victim.tenant
        usage: dict[str, int] = {}
        for e in snap.values():
            usage[e.tenant] = usage.get(e.tenant, 0) + e.size
        unpinned = {k: e for k, e in snap.items() if e.pins == 0}
        expired = {
            k: e for k, e in unpinned.items() if now - e.last_use > policy.limits(e.tenant).ttl_seconds
        }
        over = {e.tenant for e in unpinned.values() if usage[e.tenant] > policy.limits(e.tenant).quota}
        victim_tenant_within_quota = usage[victim.tenant] <= policy.limits(victim.tenant).quota
        requester_over_burst = (
            requester is not None
            and usage.get(requester, 0) + incoming > policy.limits(requester).burst
            and any(e.tenant == requester for e in unpinned.values())
        )
        if requester_over_burst:
            # Stage 0: the requester recycles its own least recently used entry.
            assert victim.tenant == requester
            own = [e.last_use for e in unpinned.values() if e.tenant == requester]
            assert entry.last_use == min(own)
            expected = EvictionReason.TTL if victim.key in expired else EvictionReason.OVER_QUOTA
            assert victim.reason is expected
        elif expired:
            assert victim.reason is EvictionReason.TTL
            assert victim.key in expired
            assert entry.last_use == min(e.last_use for e in expired.values())
        elif over:
            assert victim.reason is EvictionReason.OVER_QUOTA
            best = max(over_rank(policy, t, usage[t]) for t in over)
            assert over_rank(policy, victim.tenant, usage[victim.tenant]) == best
            own = [e.last_use for e in unpinned.values() if e.tenant == victim.tenant]
            assert entry.last_use == min(own)
        else:
            assert victim.reason is EvictionReason.LRU

            reserved = {
                t
                for t in usage
                if policy.limits(t).sla is SlaTier.PREMIUM and usage[t] <= policy.limits(t).quota
            }
            pool = [e for e in unpinned.values() if e.tenant not in reserved] or list(unpinned.values())
            assert entry.last_use == min(e.last_use for e in pool)
        # The headline invariant, stated on its own.
        if victim_tenant_within_quota and victim.tenant != requester and victim.key not in expired:
            assert not expired and not over, "a tenant within quota lost an entry while candidates existed"
        del snap[victim.key]
    # everything not returned is still there, untouched
    assert set(snapshot(policy)) == set(snap)


@settings(max_examples=300, deadline=None)
@given(
    limits=st.fixed_dictionaries({t: tenant_limits() for t in TENANTS[:3]}),
    capacity=st.integers(5, 40),
    ops=st.lists(op, min_size=20, max_size=120),
)
def test_random_operation_sequences_keep_every_invariant(
    limits: dict[str, TenantLimits],
    capacity: int,
    ops: list[tuple],  # type: ignore[type-arg]
) -> None:
    # Tenant "d" has no limits: it runs on the default (quota 0).
    policy = TierPolicy(KVTier.CPU, capacity, limits)
    now = 0.0
    next_key = 0
    for operation in ops:
        kind = operation[0]
        if kind == "tick":
            now += operation[1]
        elif kind == "insert":
            _, tenant, size, pinned = operation
            policy.insert(next_key, tenant, now, size=size, pinned=pinned)
            next_key += 1
        elif kind in {"touch", "pin", "unpin", "remove"}:
            key = operation[1]
            info = policy.get(key)
            if kind == "touch":
                assert policy.touch(key, now) == (info is not None)
            elif info is None:
                continue
            elif kind == "pin":
                policy.pin(key)
            elif kind == "unpin" and info.pins:
                policy.unpin(key, now)
            elif kind == "remove":
                assert policy.remove(key)
        elif kind in {"select", "make_room"}:
            _, amount, requester = operation
            before = snapshot(policy)
            if kind == "select":
                victims = policy.select_victims(amount, now, requester=requester)
                evictable = sum(1 for e in before.values() if e.pins == 0)
                assert len(victims) == min(amount, evictable)
            else:
                victims = policy.make_room(amount, now, requester=requester)
                if any(e.pins == 0 for e in snapshot(policy).values()):
                    assert policy.free >= amount
            check_victims(policy, before, victims, now, requester, amount)
        check_accounting(policy)


@settings(max_examples=200, deadline=None)
@given(
    slas=st.lists(st.sampled_from(list(SlaTier)), min_size=3, max_size=3),
    quotas=st.lists(st.integers(0, 8), min_size=3, max_size=3),
    ops=st.lists(
        st.tuples(st.sampled_from(TENANTS[:3]), st.integers(1, 2), st.integers(0, 3)),
        min_size=10,
        max_size=60,
    ),
)
def test_global_lru_stage_takes_premium_reservations_last(
    slas: list[SlaTier], quotas: list[int], ops: list[tuple[str, int, int]]
) -> None:
    # No TTL pressure and known tenants only, so most victims come from the over-quota and LRU stages.
    limits = {
        t: TenantLimits(quota=q, burst=q + 5, ttl_seconds=1e9, sla=s)
        for t, q, s in zip(TENANTS[:3], quotas, slas, strict=True)
    }
    policy = TierPolicy(KVTier.HBM, 12, limits)
    now = 0.0
    for key, (tenant, size, evict) in enumerate(ops):
        now += 1.0
        policy.insert(key, tenant, now, size=size)
        if evict:
            before = snapshot(policy)
            victims = policy.select_victims(evict, now)
            check_victims(policy, before, victims, now, None, evict)
        check_accounting(policy)
