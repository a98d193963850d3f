"""The gateway's view of the configuration: an immutable snapshot, and the file watcher that swaps it.

A ``GatewaySnapshot`` is built from one tenant table and one key file and never changes; a reload builds
a new one and swaps a single reference, so a request that started under the old snapshot finishes under
it (nothing in flight is dropped). The watcher polls both files' ``stat`` (following symlinks: a mounted
ConfigMap/Secret changes by swapping the ``..data`` symlink, which changes the inode the path resolves
to, so the swap is seen even when mtimes are equal). A file that is unreadable or invalid is logged
(without its content: pydantic errors are reduced to location and message, never the input value) and
counted, and the last good snapshot stays.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from kvfleet_runtime.config import (
    KeyFile,
    PoolEntry,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    hash_api_key,
)

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


def describe_error(exc: BaseException) -> str:
    """A log-safe description of a load failure: never the file's content or an input value."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors(include_input=False, include_url=False, include_context=False)[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{loc or '<root>'}: {err.get('msg', '')}")
        return f"{exc.error_count()} validation error(s): " + "; ".join(parts)
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'cannot read'}"
    return type(exc).__name__


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a ConfigMap ..data swap changes the inode
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def load_snapshot(config_path: Path, keys_path: Path) -> GatewaySnapshot:
    """Read and validate both files (blocking; call in a thread on the event loop)."""
    return build_snapshot(TenantTable.load(config_path), KeyFile.load(keys_path))


class ConfigWatcher:
    """Polls the tenant table and key file and calls ``on_change`` with each new valid snapshot."""

    def __init__(
        self,
        config_path: Path,
        keys_path: Path,
        on_change: Callable[[GatewaySnapshot], None],
        on_failure: Callable[[str], None],
        interval_s: float = 1.0,
    ) -> None:
        self.config_path = config_path
        self.keys_path = keys_path
        self._on_change = on_change
        self._on_failure = on_failure
        self.interval_s = interval_s
        self._seen: tuple[object, object] | None = None

    def load_initial(self) -> GatewaySnapshot:
        """The first snapshot; raises (with the reason) so the process fails to start on bad config."""
        self._seen = (_signature(self.config_path), _signature(self.keys_path))
        return load_snapshot(self.config_path, self.keys_path)

    def _check(self) -> GatewaySnapshot | None:
        seen = (_signature(self.config_path), _signature(self.keys_path))
        if seen == self._seen:
            return None
        # Remember the signature even when loading fails, so a bad file is reported once, not every poll.
        self._seen = seen
        try:
            table = TenantTable.load(self.config_path)
        except (OSError, ValueError) as exc:
            log.error(
                "tenant table %s rejected, keeping the last good one: %s",
                self.config_path,
                describe_error(exc),
            )
            self._on_failure("tenant_table")
            return None
        try:
            keys = KeyFile.load(self.keys_path)
        except (OSError, ValueError) as exc:
            log.error(
                "key file %s rejected, keeping the last good one: %s", self.keys_path, describe_error(exc)
            )
            self._on_failure("key_file")
            return None
        return build_snapshot(table, keys)

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
            except Exception:  # a watcher bug must not stop reloads forever
                log.exception("config watcher iteration failed")
