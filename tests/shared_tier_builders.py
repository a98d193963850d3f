"""Builders the shared KV tier's tests share: the store's pure half (tests/unit/test_build_shared_tier.py)
and its server on a loopback socket (tests/loopback/test_shared_tier_server.py)."""

from __future__ import annotations

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import KeyFile, TenantEntry, TenantTable, TierTTLs, derive_cache_salt

KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
SALT_KEY = KEYS.salt_key
#: The store's capacity in bytes.
CAPACITY = 100_000


def shared_tier_tenant(name: str, cpu_bytes: int) -> TenantEntry:
    return tenant_entry(name, hbm=1, hbm_burst=1, cpu=cpu_bytes, ttl=TierTTLs(cpu_seconds=600.0))


def shared_tier_table(*tenants: TenantEntry, burst_cap: float = 0.001) -> TenantTable:
    return tenant_table(*tenants, pools=[pool_entry(block_size=32, hbm_blocks=8, burst_cap=burst_cap)])


def salt_of(name: str) -> str:
    return derive_cache_salt(SALT_KEY, f"salt-{name}")


def store_key(salt: str, n: int) -> bytes:
    """A key of the shape LMCache's connector writes, for chunk ``n`` of ``salt``."""
    return f"m@00000000@0@{n:064x}@{salt}".encode()
