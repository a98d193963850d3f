"""The engine plugin's shell without vLLM: its tenant source (hot reload) and the line it logs when the
tenant-aware block pool is installed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    dump_json,
)
from kvfleet_runtime.engine.attribution import build_attribution
from kvfleet_runtime.engine.plugin_config import (
    ENGINE_LOGGER,
    PluginSettings,
    TenantSource,
    describe_installed_pool,
)

KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
POOL = "shared"


def entry(name: str, *, shared: bool = False, pool: str = POOL) -> TenantEntry:
    return tenant_entry(
        name, isolation=Isolation.SHARED if shared else Isolation.SALTED, pool=pool, hbm=2, hbm_burst=4
    )


def table(*entries: TenantEntry, pools: tuple[str, ...] = (POOL, "gold")) -> TenantTable:
    return tenant_table(*entries, pools=[pool_entry(p, hbm_blocks=64) for p in pools])


@pytest.mark.parametrize(
    ("entries", "port", "expected"),
    [
        (
            [entry("a"), entry("b")],
            8001,
            "pool 'shared', 2 tenants (2 accounting tenants), 64 KV blocks, metrics on port 8001",
        ),
        # Shared tenants are one accounting tenant; tenants of another pool are not this pool's.
        (
            [entry("a"), entry("s1", shared=True), entry("s2", shared=True), entry("g", pool="gold")],
            9100,
            "pool 'shared', 3 tenants (2 accounting tenants), 64 KV blocks, metrics on port 9100",
        ),
        ([], 0, "pool 'shared', 0 tenants (0 accounting tenants), 64 KV blocks, no metrics server"),
    ],
    ids=["salted", "shared-group-and-other-pool", "empty"],
)
def test_installed_pool_line(entries: list[TenantEntry], port: int, expected: str) -> None:
    attribution = build_attribution(table(*entries), KEYS, POOL, capacity=64)
    line = describe_installed_pool(POOL, attribution, port)
    assert line == "kvfleet: tenant-aware block pool installed: " + expected


def test_engine_logger_is_a_child_of_vllms() -> None:
    """vLLM gives only its ``vllm`` logger a handler (and stops propagation there): the plugin's lines
    reach the engine's log only as that logger's children."""
    assert ENGINE_LOGGER.startswith("vllm.")


# -- TenantSource over the shared watcher --------------------------------------------------------------
def write(tmp: Path, tbl: TenantTable, keys: KeyFile = KEYS) -> PluginSettings:
    (tmp / "tenants.json").write_text(dump_json(tbl))
    (tmp / "keys.json").write_text(dump_json(keys))
    return PluginSettings(tmp / "tenants.json", tmp / "keys.json", POOL, metrics_port=0)


def test_tenant_source_reloads_on_a_key_file_change_alone(tmp_path: Path) -> None:
    settings = write(tmp_path, table(entry("a")))
    source = TenantSource(settings, capacity=64)
    first = source.load()
    new_keys = KeyFile(salt_key_hex="cd" * 32, key_hashes={})
    (tmp_path / "keys.json").write_text(dump_json(new_keys))
    new = source.poll(5.0)
    assert new is not None and new is not first
    assert new.tenant_of(derive_cache_salt(new_keys.salt_key, "salt-a")) == "a"
    assert first.tenant_of(derive_cache_salt(new_keys.salt_key, "salt-a")) != "a"
    assert source.reloads == {"ok": 1, "error": 0}


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_tenant_source_counts_a_bad_file_and_a_lost_pool_as_errors(tmp_path: Path) -> None:
    settings = write(tmp_path, table(entry("a")))
    source = TenantSource(settings, capacity=64)
    source.load()
    # On the plugin's logger itself: with vLLM loaded, its records never reach the root logger.
    handler = ListHandler()
    logger = logging.getLogger(ENGINE_LOGGER)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        (tmp_path / "tenants.json").write_text("{not json")
        assert source.poll(1.0) is None
        assert source.poll(2.0) is None  # unchanged: not counted twice
        assert source.reloads == {"ok": 0, "error": 1}
        (tmp_path / "tenants.json").write_text(dump_json(table(entry("a", pool="gold"), pools=("gold",))))
        assert source.poll(3.0) is None  # valid, but this engine's pool is gone: keep the old one
        assert source.reloads == {"ok": 0, "error": 2}
        assert source.table is not None and POOL in source.table.pools
        (tmp_path / "tenants.json").write_text(dump_json(table(entry("a"), entry("b"))))
        new = source.poll(4.0)
        assert new is not None and set(new.limits) >= {"a", "b"}
        assert source.reloads == {"ok": 1, "error": 2}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert sum("rejected" in m for m in handler.messages) == 2
    assert any("tenant table reloaded" in m for m in handler.messages)
