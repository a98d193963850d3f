"""Per-tenant KV limits on every tier, derived from the tenant table: the one place that says how much a
tenant may keep on a tier, for how long, and how it ranks when tenants tie for eviction.

Pure (no I/O, no clock). The policy core (``kv.policy.TierPolicy``) enforces :class:`TenantLimits`; its
hosts get them from here: the vLLM block pool (``engine.attribution``, HBM blocks), the governed LMCache L1
(``engine.l1_governance``, CPU bytes), the LMCache quota sync (``engine.lmcache_sync``, NVMe bytes and
TTLs) and the simulator (``kv.simulator``, tiers in units of a share).

Rules
-----
* **quota** (the guarantee; for premium tenants a reservation): the tenant table's quota for the tier
  (``hbm_blocks``, ``cpu_bytes``, ``nvme_bytes``), divided by ``unit_bytes`` when a host counts a byte
  tier in chunks or blocks.
* **burst** (the most a tenant may hold while others need room): the pool's ``burst_cap`` of the tier;
  on HBM also at most the tenant's ``hbm_burst_blocks``. Never below the quota: a guarantee larger than
  the burst cap is kept whole.
* **TTL**: the tenant's TTL for the tier (``TierTTLs``, whose defaults are the only default TTLs).
* **SLA tier**: the tenant's; it orders tenants that are equally far over quota (``config.SLA_RANK``:
  basic goes first, premium last), and a premium tenant at or under its quota is evicted by plain LRU
  only when nothing else is left.

Tenants that send the same cache salt (``shared`` tenants, who all send the pool salt) share their cached
KV, so every host accounts for them as one group (:func:`group_by_salt_id`): quotas and HBM bursts are
**summed** (each member brought its guarantee to the jointly used cache), the TTL is the **longest** (a
shared entry serves every member), the SLA tier the **best** (a premium member's reservation is in the
group's quota). A group of one is the tenant itself.

A tenant or salt the table does not know gets :func:`build_default_limits`: quota 0 (always over quota,
so it goes first: LMCache's allowlist semantics), the pool's burst cap and the tier's default TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_runtime.config import (
    DEFAULT_BURST_CAP,
    SLA_RANK,
    KVTier,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
)

__all__ = [
    "TenantLimits",
    "best_sla",
    "build_default_limits",
    "build_group_limits",
    "build_limits",
    "build_tenant_limits",
    "build_tier_limits",
    "burst_units",
    "group_by_salt_id",
    "group_quota",
    "group_ttl",
]

_DEFAULT_TTLS = TierTTLs()


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits on one tier, in the tier's unit (blocks for HBM, bytes for CPU/NVMe)."""

    quota: int
    burst: int
    ttl_seconds: float
    sla: SlaTier = SlaTier.STANDARD

    def __post_init__(self) -> None:
        if self.quota < 0:
            raise ValueError(f"quota must be >= 0, got {self.quota}")
        if self.burst < self.quota:
            raise ValueError(f"burst ({self.burst}) must be >= quota ({self.quota})")
        if not self.ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {self.ttl_seconds}")


def burst_units(capacity: int, burst_cap: float = DEFAULT_BURST_CAP) -> int:
    """The pool's burst cap in units of a tier of ``capacity`` units (floored)."""
    return int(capacity * burst_cap)


def build_limits(quota: int, burst: int, ttl_seconds: float, sla: SlaTier = SlaTier.STANDARD) -> TenantLimits:
    """Limits with the burst raised to the quota where it is lower (a guarantee is never cut by the cap)."""
    return TenantLimits(quota=quota, burst=max(quota, burst), ttl_seconds=ttl_seconds, sla=sla)


def build_default_limits(tier: KVTier, capacity: int, burst_cap: float = DEFAULT_BURST_CAP) -> TenantLimits:
    """Limits of a tenant or salt without its own: nothing guaranteed, the tier's default TTL."""
    return build_limits(0, burst_units(capacity, burst_cap), _DEFAULT_TTLS.for_tier(tier))


def best_sla(members: Sequence[TenantEntry]) -> SlaTier:
    """The SLA tier of a group: its best member's."""
    return max((m.tier for m in members), key=SLA_RANK.__getitem__)


def group_quota(members: Sequence[TenantEntry], tier: KVTier, unit_bytes: int = 1) -> int:
    """A group's guarantee on ``tier``: the sum of its members' (bytes tiers divided by ``unit_bytes``)."""
    total = sum(m.quota.for_tier(tier) for m in members)
    return total if tier is KVTier.HBM else total // unit_bytes


def group_ttl(members: Sequence[TenantEntry], tier: KVTier) -> float:
    """A group's TTL on ``tier``: its most patient member's."""
    return max(m.ttl.for_tier(tier) for m in members)


def build_group_limits(
    members: Sequence[TenantEntry],
    tier: KVTier,
    capacity: int,
    burst_cap: float = DEFAULT_BURST_CAP,
    unit_bytes: int = 1,
) -> TenantLimits:
    """The limits of tenants that share one cache salt, on a tier of ``capacity`` units (see the module
    docstring for the rules). Raises ``ValueError`` for an empty group."""
    if not members:
        raise ValueError("a group of tenants needs at least one member")
    pool_burst = burst_units(capacity, burst_cap)
    burst = pool_burst
    if tier is KVTier.HBM:
        burst = min(sum(m.quota.hbm_burst_blocks for m in members), pool_burst)
    return build_limits(
        group_quota(members, tier, unit_bytes), burst, group_ttl(members, tier), best_sla(members)
    )


def build_tenant_limits(
    entry: TenantEntry,
    tier: KVTier,
    capacity: int,
    burst_cap: float = DEFAULT_BURST_CAP,
    unit_bytes: int = 1,
) -> TenantLimits:
    """One tenant-table entry's limits on one tier of ``capacity`` units (a group of one)."""
    return build_group_limits((entry,), tier, capacity, burst_cap, unit_bytes)


def build_tier_limits(
    table: TenantTable, pool: str, tier: KVTier, capacity: int, unit_bytes: int = 1
) -> dict[str, TenantLimits]:
    """Limits of every tenant served by ``pool``, each on its own, on one tier of one replica of it."""
    burst_cap = table.pools[pool].burst_cap
    return {
        name: build_tenant_limits(entry, tier, capacity, burst_cap, unit_bytes)
        for name, entry in table.tenants.items()
        if entry.pool == pool
    }


def group_by_salt_id(table: TenantTable, pool: str | None = None) -> dict[str, tuple[TenantEntry, ...]]:
    """Tenants served by ``pool`` (every pool when ``None``) grouped by the salt id they send.

    Members are in name order, and groups in the order of their first member's name, so the result is
    the same however the table lists its tenants.
    """
    groups: dict[str, list[TenantEntry]] = {}
    for entry in sorted(table.tenants.values(), key=lambda t: t.name):
        if pool is None or entry.pool == pool:
            groups.setdefault(entry.salt_id, []).append(entry)
    return {salt_id: tuple(members) for salt_id, members in groups.items()}
