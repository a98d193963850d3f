"""Who owns a cached KV block: from a request's ``cache_salt`` to an accounting tenant and its HBM limits.

Pure (no vLLM import, no I/O): the tenant-aware block pool (``engine.block_pool``) builds one
:class:`Attribution` from the tenant table and key file of its pool, and rebuilds it when they change.

Accounting tenants
------------------
The gateway sets ``cache_salt = derive_cache_salt(salt_key, tenant.salt_id)`` on every request, so the
salt is all the engine knows about a request's tenant. A ``salted`` (or ``dedicated``) tenant has a salt
of its own, and its accounting tenant is the tenant itself (its name is the metric label).

``shared`` tenants all send the pool salt, and vLLM hashes that salt into the first block of every
prefix, so a block cached by one shared tenant is *the same block* another shared tenant hits: there is
no honest way to split it between them. The shared group is therefore one accounting tenant named
``shared:<pool_salt_id>`` (the same for any number of members, so adding or removing a shared tenant
never renames it and never loses its accounting). Its limits combine its members' by the group rules
of ``kv.limits`` (quotas and bursts summed, the burst capped at the pool's burst cap, the longest TTL, the
best SLA tier).

Any other salt used by two or more tenants of the pool (only possible if a table reuses a salt id) is
treated the same way, named ``shared:<salt_id>``.

Requests without a salt, or with a salt no tenant of this pool derives (a client that bypassed the
gateway, a tenant removed from the table), belong to ``unattributed``: quota 0, the pool's burst cap and
the default HBM TTL (``kv.limits.build_default_limits``), so its blocks are always over quota and go
first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfleet_runtime.config import KeyFile, KVTier, TenantEntry, TenantTable, derive_cache_salt
from kvfleet_runtime.kv.limits import (
    TenantLimits,
    build_default_limits,
    build_group_limits,
    group_by_salt_id,
)

__all__ = [
    "SHARED_PREFIX",
    "UNATTRIBUTED",
    "Attribution",
    "build_attribution",
    "build_unattributed_limits",
    "compute_accounting_name",
]

#: Accounting tenant of requests whose salt no tenant of the pool sends.
UNATTRIBUTED = "unattributed"
#: Prefix of the accounting tenant of a salt shared by several tenants (the pool salt).
SHARED_PREFIX = "shared:"


@dataclass(frozen=True)
class Attribution:
    """Salt -> accounting tenant, and each accounting tenant's HBM limits, for one pool."""

    pool: str
    capacity: int
    salt_to_tenant: Mapping[str, str]
    limits: Mapping[str, TenantLimits]
    #: Accounting tenant -> the tenant-table tenants it stands for (sorted).
    members: Mapping[str, tuple[str, ...]]
    unattributed: TenantLimits

    def tenant_of(self, cache_salt: str | None) -> str:
        """The accounting tenant of a request carrying ``cache_salt`` (O(1))."""
        if cache_salt is None:
            return UNATTRIBUTED
        return self.salt_to_tenant.get(cache_salt, UNATTRIBUTED)


def compute_accounting_name(table: TenantTable, salt_id: str, members: Sequence[TenantEntry]) -> str:
    """The accounting tenant of the tenants in ``members``, which all send the salt of ``salt_id``."""
    if salt_id == table.pool_salt_id or len(members) > 1:
        return SHARED_PREFIX + salt_id
    return members[0].name


def build_unattributed_limits(capacity: int, burst_cap: float) -> TenantLimits:
    """Limits of requests no tenant of the pool claims: nothing guaranteed, first to go."""
    return build_default_limits(KVTier.HBM, capacity, burst_cap)


def build_attribution(table: TenantTable, keys: KeyFile, pool: str, capacity: int) -> Attribution:
    """The attribution of one replica of ``pool`` whose HBM holds ``capacity`` blocks.

    Raises ``ValueError`` when ``pool`` is not in the table (a misconfigured engine must not start).
    """
    if pool not in table.pools:
        raise ValueError(f"pool {pool!r} is not in the tenant table (pools: {sorted(table.pools)})")
    burst_cap = table.pools[pool].burst_cap
    salt_to_tenant: dict[str, str] = {}
    limits: dict[str, TenantLimits] = {}
    members: dict[str, tuple[str, ...]] = {}
    for salt_id, group in sorted(group_by_salt_id(table, pool).items()):
        name = compute_accounting_name(table, salt_id, group)
        salt_to_tenant[derive_cache_salt(keys.salt_key, salt_id)] = name
        members[name] = tuple(m.name for m in group)  # in name order
        limits[name] = build_group_limits(group, KVTier.HBM, capacity, burst_cap)
    unattributed = build_unattributed_limits(capacity, burst_cap)
    limits[UNATTRIBUTED] = unattributed
    members[UNATTRIBUTED] = ()
    return Attribution(pool, capacity, salt_to_tenant, limits, members, unattributed)
