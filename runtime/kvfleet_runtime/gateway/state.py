"""The gateway's view of the configuration: an immutable snapshot, and the reloader that swaps it.

A ``GatewaySnapshot`` is built from one tenant table and one key file and never changes; a reload builds
a new one and swaps a single reference, so a request that started under the old snapshot finishes under
it (nothing in flight is dropped). When the files changed, and what happens to a bad one (logged without
its content, counted, the last good snapshot stays), is the runtime's one rule:
``kvfleet_runtime.config_watch.RuntimeConfigWatcher``; ``SnapshotReloader`` runs it on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kvfleet_runtime.config import (
    SLA_RANK,
    YIELD_EVERY,
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
#: Longest ``Authorization`` header looked at; anything longer is no key of ours.
MAX_AUTHORIZATION_CHARS = 4096


class AuthFailure(StrEnum):
    """Why ``GatewaySnapshot.authenticate`` found no tenant."""

    #: No ``Authorization: Bearer <key>`` at all (401).
    MISSING = "missing"
    #: A bearer key that no tenant has (401).
    UNKNOWN = "unknown"
    #: The header is not valid UTF-8, so it cannot be a key (400).
    MALFORMED = "malformed"
    #: More than one tenant lists this key: refused for all of them, never routed (403).
    AMBIGUOUS = "ambiguous"


@dataclass(frozen=True)
class TenantRuntime:
    """One tenant with everything derived that the request path needs."""

    entry: TenantEntry
    pool: PoolEntry
    cache_salt: str
    models: frozenset[str]
    #: The tenant's HBM burst cap in blocks (``hbm_burst_blocks``); ``None`` (0 in the table): no cap.
    kv_burst_blocks: int | None = None
    #: The model's context length, when the pool's engine settings name it.
    max_model_len: int | None = None
    #: ``entry.name``, ``entry.tier``'s value and its ``SLA_RANK``, copied once: the request path reads
    #: them a dozen times.
    name: str = field(init=False)
    tier: str = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.entry.name)
        object.__setattr__(self, "tier", self.entry.tier.value)
        object.__setattr__(self, "rank", SLA_RANK[self.entry.tier])

    @property
    def kv_budget_tokens(self) -> int | None:
        """The burst cap in tokens: what the tenant's admitted requests may hold at once."""
        return None if self.kv_burst_blocks is None else self.kv_burst_blocks * self.pool.block_size


@dataclass(frozen=True)
class GatewaySnapshot:
    """An immutable, validated configuration."""

    table: TenantTable
    tenants: dict[str, TenantRuntime]
    #: SHA-256 hex digest of an API key -> (tenant name, the stored digest); one owner per key only.
    key_index: dict[str, tuple[str, str]]
    #: Digests listed by more than one tenant: refused for every one of them.
    ambiguous_keys: frozenset[str] = frozenset()
    #: The salt key the tenants' cache salts derive from (a reload reuses a tenant only under the same).
    salt_key: bytes = b""
    #: The key file it was built from (a reload with the same one and the same tenants keeps the index).
    keys: KeyFile | None = None

    def authenticate(self, authorization: str | None) -> TenantRuntime | AuthFailure:
        """The one tenant owning the bearer key in ``authorization``, or why there is none.

        The dict lookup finds the candidate by digest; ``hmac.compare_digest`` then compares the stored
        digest in constant time, so the answer does not depend on how many leading characters matched.
        A header that is not valid UTF-8 arrives with surrogate escapes for its bad bytes (aiohttp's
        decoding) and is ``MALFORMED``.
        """
        if not authorization or len(authorization) > MAX_AUTHORIZATION_CHARS:
            return AuthFailure.MISSING if not authorization else AuthFailure.UNKNOWN
        if authorization[: len(_BEARER)].lower() != _BEARER:
            return AuthFailure.MISSING
        key = authorization[len(_BEARER) :].strip()
        if not key:
            return AuthFailure.MISSING
        if not key.isascii():
            try:
                key.encode()
            except UnicodeEncodeError:
                return AuthFailure.MALFORMED
        digest = hash_api_key(key)
        if digest in self.ambiguous_keys:
            return AuthFailure.AMBIGUOUS
        hit = self.key_index.get(digest)
        if hit is None or not hmac.compare_digest(hit[1], digest):
            return AuthFailure.UNKNOWN
        return self.tenants.get(hit[0]) or AuthFailure.UNKNOWN


def build_snapshot(
    table: TenantTable, keys: KeyFile, previous: GatewaySnapshot | None = None
) -> GatewaySnapshot:
    """Derive salts, budgets and the key index.

    Keys of tenants missing from the table are ignored, except that they still make a key ambiguous: a
    digest listed under more than one tenant name anywhere in the key file is routed for none of them,
    and a warning names the tenants (never the key or its digest).

    ``previous``: the snapshot in force. A tenant whose entry is the same object (``TenantTable.reload``
    keeps the unchanged ones), in an equal pool, under the same salt key keeps its ``TenantRuntime``, so
    the gateway applies a reload to what changed alone (``Pipeline.apply_snapshot``).
    """
    salt_key = keys.salt_key
    unchanged_pools: set[str] = set()
    if previous is not None and previous.salt_key == salt_key:
        unchanged_pools = {n for n, p in table.pools.items() if previous.table.pools.get(n) == p}
    tenants: dict[str, TenantRuntime] = {}
    for i, (name, entry) in enumerate(table.tenants.items()):
        if i % YIELD_EVERY == 0:
            time.sleep(0)  # in the reload's thread: let the one that serves requests have the GIL
        if entry.pool in unchanged_pools and previous is not None:
            kept = previous.tenants.get(name)
            if kept is not None and kept.entry is entry:
                tenants[name] = kept
                continue
        pool = table.pools[entry.pool]
        burst = entry.quota.hbm_burst_blocks
        tenants[name] = TenantRuntime(
            entry=entry,
            pool=pool,
            cache_salt=derive_cache_salt(salt_key, entry.salt_id),
            models=frozenset(entry.models),
            kv_burst_blocks=burst if burst > 0 else None,
            max_model_len=pool.engine.max_model_len if pool.engine is not None else None,
        )
    if previous is not None and previous.keys is keys and previous.tenants.keys() == tenants.keys():
        # The same key file (config_watch reuses it when its bytes did not change) and the same names:
        # the same index; its warnings were logged when it was built.
        key_index, ambiguous = previous.key_index, previous.ambiguous_keys
    else:
        key_index, ambiguous = _index_keys(keys, tenants)
    return GatewaySnapshot(
        table=table,
        tenants=tenants,
        key_index=key_index,
        ambiguous_keys=ambiguous,
        salt_key=salt_key,
        keys=keys,
    )


def _index_keys(
    keys: KeyFile, tenants: Mapping[str, TenantRuntime]
) -> tuple[dict[str, tuple[str, str]], frozenset[str]]:
    """Digest -> (tenant, digest) for the tenants of the table, and the digests listed by several tenants
    (refused for all of them; each such group is named in a warning, never the key or its digest)."""
    owners: dict[str, set[str]] = {}
    for tenant, digests in keys.key_hashes.items():
        for digest in digests:
            owners.setdefault(digest, set()).add(tenant)
    ambiguous = frozenset(d for d, names in owners.items() if len(names) > 1)
    for names in sorted({tuple(sorted(owners[d])) for d in ambiguous}):
        log.warning(
            "one API key is listed by tenants %s; it is refused for all of them until it is listed by one",
            ", ".join(repr(n) for n in names),
        )
    key_index: dict[str, tuple[str, str]] = {}
    for i, (tenant, digests) in enumerate(keys.key_hashes.items()):
        if i % YIELD_EVERY == 0:
            time.sleep(0)
        if tenant not in tenants:
            log.warning("key file lists tenant %r that the tenant table does not have; ignored", tenant)
            continue
        for digest in digests:
            if digest not in ambiguous:
                key_index[digest] = (tenant, digest)
    return key_index, ambiguous


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
        #: The snapshot last handed on, which the next reuses the unchanged tenants of.
        self._last: GatewaySnapshot | None = None

    def load_initial(self) -> GatewaySnapshot:
        """The first snapshot; raises (with the reason) so the process fails to start on bad config."""
        self._last = build_snapshot(*self.watcher.load())
        gc.collect()  # at start-up, before anything is served: nothing frozen is garbage
        gc.freeze()
        return self._last

    def _check(self) -> GatewaySnapshot | None:
        config = self.watcher.poll()
        if config is None:
            return None
        snapshot = build_snapshot(*config, previous=self._last)
        # The table's objects (tens of thousands at 10,000 tenants) live until the next reload: out of the
        # cyclic collector's reach, whose full passes over them held the GIL 0.11 s and stalled every
        # request (benchmarks/gateway/reload.py). They are still freed by reference counting; a table's
        # objects form no cycles. The young generations are collected first, so that the cyclic garbage of
        # the requests served meanwhile is not frozen with it (a few milliseconds: the table's own objects
        # were promoted while they were built).
        gc.collect(1)
        gc.freeze()
        return snapshot

    async def poll_once(self) -> bool:
        """Check both files once; ``True`` when a new snapshot took effect."""
        snapshot = await asyncio.to_thread(self._check)
        if snapshot is None:
            return False
        self._last = snapshot
        self._on_change(snapshot)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # a reloader bug must not stop reloads forever
                log.exception("config reload iteration failed")
