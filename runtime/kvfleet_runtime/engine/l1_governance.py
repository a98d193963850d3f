"""Per-tenant governance of LMCache's L1 (the CPU tier): quotas, burst cap and TTL per cache salt.

LMCache 0.5.6 runs its L1 under one global policy (``LRU`` or ``ARC``): no per-salt quota, TTL or
accounting. kvfleet runs the LMCache server through ``engine/lmcache_server.py``, which swaps LMCache's
L1 eviction controller for one that hosts an :class:`L1Governor`: the same
:class:`~kvfleet_runtime.kv.policy.TierPolicy` that governs vLLM's HBM blocks and the simulator, here
keyed by LMCache object key, one policy tenant per cache salt, entry sizes in bytes.

Limits per salt (:func:`compute_l1_limits`, by the rules of ``kv.limits`` for the CPU tier): a salted
tenant has its own salt; shared tenants use the pool's salt, whose quota is the **sum** of theirs, TTL the
**max**, SLA tier the highest (the same rules as the NVMe quotas in ``lmcache_sync``). Quota = the tenant
table's ``quota.cpu_bytes``; burst = the pool's ``burst_cap`` of the L1 size, never below the quota;
TTL = ``ttl.cpu_seconds``. A salt that is not in the table (for example the empty salt of a request sent
to an engine directly) gets quota 0, so it is the first to go under pressure.

A salt that leaves the table (tenant deleted) has all its L1 objects deleted in the next cycle
(:meth:`L1Governor.take_removed`); other salts keep theirs.

One cycle (:meth:`L1Governor.select`, once a second, like LMCache's own loop) picks victims in this order:

1. ``ttl``: entries idle past their salt's CPU TTL (:meth:`TierPolicy.expire`), whether or not L1 is full;
2. ``over_quota``: a salt holding more than its burst cap loses its own least recently used entries
   (:meth:`TierPolicy.trim_to_burst`), also whether or not L1 is full;
3. when L1 is at or above LMCache's ``trigger_watermark``: the policy order (expired, then the salt
   furthest over its quota, then global LRU with premium reservations last) until usage is back to
   ``trigger_watermark - eviction_ratio`` of the L1 size.

Entries LMCache refuses to delete right now (read-locked, or a write in flight) are given back with
:meth:`L1Governor.restore` and may go in a later cycle. Keys are tracked from the moment LMCache reports a
finished write; a reservation that is never finished is LMCache's own business (it reclaims it).

No LMCache import here: this module is pure apart from a lock (LMCache calls in from several threads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from kvfleet_runtime.config import KeyFile, KVTier, TenantTable, derive_cache_salt
from kvfleet_runtime.kv.limits import (
    TenantLimits,
    build_default_limits,
    build_group_limits,
    group_by_salt_id,
)
from kvfleet_runtime.kv.policy import EvictionReason, TierPolicy, Victim

__all__ = ["L1Governor", "L1Limits", "SaltL1Usage", "compute_l1_limits"]


@dataclass(frozen=True)
class L1Limits:
    """What each cache salt may keep in one LMCache L1, and whose salt it is."""

    per_salt: Mapping[str, TenantLimits]
    tenants_of: Mapping[str, tuple[str, ...]]
    #: Limits of any salt not in the table.
    default: TenantLimits


def compute_l1_limits(table: TenantTable, keys: KeyFile, pool: str, capacity_bytes: int) -> L1Limits:
    """L1 limits for the salts of the tenants served by ``pool``, on an L1 of ``capacity_bytes``."""
    if pool not in table.pools:
        raise ValueError(f"pool {pool!r} is not in the tenant table (pools: {sorted(table.pools)})")
    burst_cap = table.pools[pool].burst_cap
    per_salt: dict[str, TenantLimits] = {}
    tenants_of: dict[str, tuple[str, ...]] = {}
    for salt_id, members in group_by_salt_id(table, pool).items():
        salt = derive_cache_salt(keys.salt_key, salt_id)
        per_salt[salt] = build_group_limits(members, KVTier.CPU, capacity_bytes, burst_cap)
        tenants_of[salt] = tuple(m.name for m in members)
    default = build_default_limits(KVTier.CPU, capacity_bytes, burst_cap)
    return L1Limits(per_salt=per_salt, tenants_of=tenants_of, default=default)


@dataclass(frozen=True)
class SaltL1Usage:
    """One salt in L1 right now, and what the governor has evicted of it so far."""

    resident_bytes: int
    limits: TenantLimits
    evictions: Mapping[EvictionReason, int] = field(default_factory=dict)


class L1Governor:
    """A thread-safe :class:`TierPolicy` over one LMCache L1.

    LMCache calls ``on_stored``/``on_used``/``on_removed`` from its own threads while it holds its L1 lock;
    the eviction loop calls ``select`` and ``restore`` and must never hold this lock while it calls into
    LMCache (the governor never calls out, so the two locks are never taken in the other order).
    """

    def __init__(
        self, capacity_bytes: int, limits: L1Limits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._limits = limits
        self._policy = TierPolicy(KVTier.CPU, capacity_bytes, dict(limits.per_salt), limits.default)
        #: Salts a reload removed from the table whose objects are still to be deleted.
        self._removed: set[str] = set()

    @property
    def limits(self) -> L1Limits:
        return self._limits

    def set_limits(self, limits: L1Limits) -> None:
        """Apply a reloaded tenant table at once. A salt that left the table falls back to the default
        limits, and its objects are handed out by :meth:`take_removed` to be deleted."""
        with self._lock:
            gone = set(self._limits.per_salt) - set(limits.per_salt)
            self._removed = (self._removed | gone) - set(limits.per_salt)
            for salt in gone:
                self._policy.set_limits(salt, None)
            self._policy.default_limits = limits.default
            for salt, salt_limits in limits.per_salt.items():
                self._policy.set_limits(salt, salt_limits)
            self._limits = limits

    # -- LMCache's events -----------------------------------------------------------------------------
    def on_stored(self, entries: Iterable[tuple[Hashable, str, int]]) -> None:
        """``(key, cache_salt, size_bytes)`` for each object that became resident (or was rewritten).

        LMCache reports a request's chunks in prefix order. Like its own LRU, the last chunk becomes the
        least recently used: a tenant that loses chunks loses its tails first and keeps usable prefixes.
        """
        with self._lock:
            now = self._clock()
            for key, salt, size in reversed(list(entries)):
                if not self._policy.touch(key, now):
                    self._policy.insert(key, salt, now, size)

    def on_used(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            now = self._clock()
            for key in reversed(list(keys)):  # prefix order, as on_stored
                self._policy.touch(key, now)

    def on_removed(self, keys: Iterable[Hashable]) -> None:
        """Objects LMCache deleted (on the governor's request or its own: clear, expired reservations)."""
        with self._lock:
            for key in keys:
                self._policy.remove(key)

    # -- the eviction loop ----------------------------------------------------------------------------
    def select(self, used_bytes: int, total_bytes: int, watermark: float, ratio: float) -> list[Victim]:
        """This cycle's victims (already forgotten by the policy; delete them from LMCache).

        ``used_bytes``/``total_bytes`` are LMCache's own figures for the L1 (they include objects still
        being written, which the policy does not track yet).
        """
        with self._lock:
            now = self._clock()
            victims = self._policy.expire(now) + self._policy.trim_to_burst(now)
            if total_bytes > 0:
                used_after = used_bytes - sum(v.size for v in victims)
                if used_after >= watermark * total_bytes:
                    target = max(0.0, watermark - ratio) * total_bytes
                    to_free = int(used_after - target)
                    victims += self._policy.make_room(self._policy.free + to_free, now)
            return victims

    def take_removed(self) -> list[tuple[Hashable, str, int]]:
        """``(key, salt, size)`` of every object of a salt that left the table (forgotten by the policy;
        delete them from LMCache, and hand back with ``on_stored`` the ones it refuses: they are taken
        again next cycle, until the salt holds nothing)."""
        with self._lock:
            out: list[tuple[Hashable, str, int]] = []
            for salt in sorted(self._removed):
                keys = self._policy.entry_keys(salt)
                if not keys:
                    self._removed.discard(salt)
                for key in keys:
                    info = self._policy.get(key)
                    if info is not None and self._policy.remove(key):
                        out.append((key, salt, info.size))
            return out

    def restore(self, victims: Iterable[Victim]) -> None:
        """Victims LMCache could not delete (in use): track them again, as just used, and uncount them."""
        with self._lock:
            now = self._clock()
            for victim in victims:
                if victim.key in self._policy:
                    continue
                self._policy.insert(victim.key, victim.tenant, now, victim.size)
                counted = (victim.tenant, victim.reason)
                self._policy.evictions[counted] = self._policy.evictions.get(counted, 1) - 1

    # -- reporting ------------------------------------------------------------------------------------
    def usage(self) -> dict[str, SaltL1Usage]:
        """Every salt that holds entries or has limits, with its resident bytes and evictions."""
        with self._lock:
            return {
                salt: SaltL1Usage(
                    resident_bytes=self._policy.usage(salt).size,
                    limits=self._policy.limits(salt),
                    evictions=self._policy.evictions_of(salt),
                )
                for salt in self._policy.tenants()
            }

    @property
    def tracked_bytes(self) -> int:
        with self._lock:
            return self._policy.used
