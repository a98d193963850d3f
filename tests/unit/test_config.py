from __future__ import annotations

import pytest
from pydantic import ValidationError

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    KVQuota,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    dump_json,
    hash_api_key,
    salt_to_tenants,
)


def _tenant(name: str, isolation: Isolation, salt_id: str) -> TenantEntry:
    return tenant_entry(name, isolation=isolation, salt_id=salt_id, hbm=10, hbm_burst=50)


def _table(*tenants: TenantEntry) -> TenantTable:
    return tenant_table(*tenants, pools=[pool_entry(block_size=32, hbm_blocks=100)], model_deployment="ns/md")


def test_round_trip_is_byte_stable() -> None:
    table = _table(_tenant("a", Isolation.SALTED, "a"), _tenant("b", Isolation.SHARED, "pool"))
    text = dump_json(table)
    assert dump_json(TenantTable.model_validate_json(text)) == text


def test_shared_tenant_must_use_pool_salt() -> None:
    with pytest.raises(ValidationError, match="pool_salt_id"):
        _table(_tenant("b", Isolation.SHARED, "own"))


def test_unknown_pool_is_rejected() -> None:
    bad = _tenant("a", Isolation.SALTED, "a").model_copy(update={"pool": "nope"})
    with pytest.raises(ValidationError, match="not one of the pools"):
        _table(bad)


def test_burst_below_guarantee_is_rejected() -> None:
    with pytest.raises(ValidationError, match="hbm_burst_blocks"):
        KVQuota(hbm_blocks=10, hbm_burst_blocks=5)


def test_salts_separate_salted_tenants_and_group_shared_ones() -> None:
    keys = KeyFile(salt_key_hex="ab" * 32, key_hashes={"a": [hash_api_key("k")]})
    table = _table(
        _tenant("a", Isolation.SALTED, "a"),
        _tenant("b", Isolation.SHARED, "pool"),
        _tenant("c", Isolation.SHARED, "pool"),
    )
    groups = salt_to_tenants(table, keys)
    assert sorted(groups.values()) == [["a"], ["b", "c"]]
    assert derive_cache_salt(keys.salt_key, "a") != derive_cache_salt(bytes(32), "a")


def test_key_hash_is_sha256_hex_and_never_the_key() -> None:
    digest = hash_api_key("secret-key")
    assert len(digest) == 64 and "secret" not in digest
