"""The gateway's view of the configuration: an immutable snapshot, and the reloader that swaps it.

A ``GatewaySnapshot`` is built from one tenant table and one key file and never changes; a reload builds
a new one and swaps a single reference, so a request that started under the old snapshot finishes under
it (nothing in flight is dropped). When the files changed, and what happens to a bad one (logged without
its content, counted, the last good snapshot stays), is the runtime's one rule:
``kvfleet_runtime.config_watch.RuntimeConfigWatcher``; ``SnapshotReloader`` runs it on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfleet_runtime.config import (
    KeyFile,
    PoolEntry,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    hash_api_key,
)
from kvfleet_runtime.config_watch import ConfigFile, RuntimeConfigWatcher

log = logging.getLogger("kvfleet.gateway")

_BEARER = "bearer "


@dataclass(frozen=True)
class TenantRuntime:
    """One tenant with everything derived that the request path needs."""

    entry: TenantEntry
    pool: PoolEntry
    cache_salt: str
    models: frozenset[str]
    #: The tenant's burst limit in tokens (hbm_burst_blocks x block_size); ``None``: no KV budget.
    kv_budget_tokens: int | None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def tier(self) -> str:
        return self.entry.tier.value


@dataclass(frozen=True)
class GatewaySnapshot:
    """An immutable, validated configuration."""

    table: TenantTable
    tenants: dict[str, TenantRuntime]
    #: SHA-256 hex digest of an API key -> (tenant name, the stored digest).
    key_index: dict[str, tuple[str, str]]

    def authenticate(self, authorization: str | None) -> TenantRuntime | None:
        """The tenant owning the bearer key in ``authorization``; ``None`` for anything else.

        The dict lookup finds the candidate by digest; ``hmac.compare_digest`` then compares the stored
        digest in constant time, so the answer does not depend on how many leading characters matched.
        """
        if not authorization or len(authorization) > 4096:
            return None
        if authorization[: len(_BEARER)].lower() != _BEARER:
            return None
        key = authorization[len(_BEARER) :].strip()
        if not key:
            return None
        digest = hash_api_key(key)
        hit = self.key_index.get(digest)
        if hit is None or not hmac.compare_digest(hit[1], digest):
            return None
        return self.tenants.get(hit[0])


def build_snapshot(table: TenantTable, keys: KeyFile) -> GatewaySnapshot:
    """Derive salts, budgets and the key index. Keys of tenants missing from the table are ignored."""
    tenants: dict[str, TenantRuntime] = {}
    for name, entry in table.tenants.items():
        pool = table.pools[entry.pool]
        burst = entry.quota.hbm_burst_blocks
        tenants[name] = TenantRuntime(
            entry=entry,
            pool=pool,
            cache_salt=derive_cache_salt(keys.salt_key, entry.salt_id),
            models=frozenset(entry.models),
            kv_budget_tokens=burst * pool.block_size if burst > 0 else None,
        )
    key_index: dict[str, tuple[str, str]] = {}
    for tenant, digests in keys.key_hashes.items():
        if tenant not in tenants:
            log.warning("key file lists tenant %r that the tenant table does not have; ignored", tenant)
            continue
        for digest in digests:
            key_index[digest] = (tenant, digest)
    return GatewaySnapshot(table=table, tenants=tenants, key_index=key_index)


def load_snapshot(config_path: Path, keys_path: Path) -> GatewaySnapshot:
    """Read and validate both files (blocking; call in a thread on the event loop)."""
    return build_snapshot(TenantTable.load(config_path), KeyFile.load(keys_path))


class SnapshotReloader:
    """Reloads the gateway's snapshot when the tenant table or key file changes (``RuntimeConfigWatcher``
    in a thread) and calls ``on_change`` with each new one; ``on_failure`` gets the rejected file's name
    (``tenant_table`` or ``key_file``)."""

    def __init__(
        self,
        config_path: Path,
        keys_path: Path,
        on_change: Callable[[GatewaySnapshot], None],
        on_failure: Callable[[ConfigFile], None],
        interval_s: float = 1.0,
    ) -> None:
        self.watcher = RuntimeConfigWatcher(
            config_path, keys_path, on_rejected=lambda r: on_failure(r.file), logger=log
        )
        self._on_change = on_change
        self.interval_s = interval_s

    def load_initial(self) -> GatewaySnapshot:
        """The first snapshot; raises (with the reason) so the process fails to start on bad config."""
        return build_snapshot(*self.watcher.load())

    def _check(self) -> GatewaySnapshot | None:
        config = self.watcher.poll()
        return None if config is None else build_snapshot(*config)

    async def poll_once(self) -> bool:
        """Check both files once; ``True`` when a new snapshot took effect."""
        snapshot = await asyncio.to_thread(self._check)
        if snapshot is None:
            return False
        self._on_change(snapshot)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # a reloader bug must not stop reloads forever
                log.exception("config reload iteration failed")
