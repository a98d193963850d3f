"""The KV policy core: which cached entries of one tier stay and which go, per tenant.

Pure and synchronous: no I/O, no clock (the caller passes ``now`` in seconds, any monotonic origin), no
vLLM or LMCache import. One :class:`TierPolicy` governs one tier of one cache (a replica's HBM block pool,
an LMCache CPU or NVMe store, or a simulated tier). It is hosted by the vLLM block-pool plugin, the
LMCache integration and the simulator (``kvfleet simulate``), so all three evict the same way.

Model
-----
An *entry* is one cached unit, keyed by any hashable id (for vLLM's block pool use
``KVCacheBlock.block_id``; for LMCache a chunk key), owned by one tenant, with a ``size`` (1 for an HBM
block, bytes for a CPU/NVMe chunk) and a last-use time. An entry is *pinned* while running requests
reference it (vLLM: ``ref_cnt > 0``); pinned entries are never victims, exactly like vLLM's free queue
only ever holds ``ref_cnt == 0`` blocks. Pins nest (``pin`` twice needs ``unpin`` twice), mirroring
``ref_cnt``. Idle time is ``now - last_use``; ``unpin`` to zero and ``touch`` set ``last_use = now``.

Every tenant has :class:`~kvfleet_runtime.kv.limits.TenantLimits` for the tier: a ``quota`` (the
guarantee; for premium tenants a reservation), a ``burst`` cap (default 50% of the tier, never below the
quota), a TTL and an SLA tier. ``kv.limits`` derives them from the tenant table. Tenants without limits get
``default_limits`` (quota 0 unless configured, so an unknown tenant is always over quota and goes first:
LMCache's allowlist semantics).

Victim order (``select_victims`` / ``make_room``), one victim at a time:

0. (only with ``requester``) if the requesting tenant would exceed its burst cap, its own LRU entries
   (reason ``over_quota``, or ``ttl`` if that entry is also expired): a tenant at its burst cap recycles
   its own cache instead of taking others'.
1. ``ttl``: unpinned entries idle longer than their tenant's TTL for this tier, oldest ``last_use`` first.
2. ``over_quota``: the least recently used entry of the tenant furthest above its quota. Ranking: tenants
   above their burst cap first, then by ``(usage - quota) / quota`` (quota 0 counts as infinitely over),
   ties broken by SLA tier (``config.SLA_ORDER``: basic before standard before premium). Re-ranked after
   every victim, so two over-quota tenants are trimmed towards the same relative overshoot.
3. ``lru``: the global least recently used unpinned entry, except that premium tenants at or under their
   quota (reservations) are taken only when nothing else is left.

Consequence (property-tested): a tenant at or under its quota never loses an entry to another tenant
while an expired entry or an over-quota tenant's unpinned entry exists.

Complexity: ``insert``, ``touch``, ``pin``, ``unpin``, ``remove`` are O(1) (a dict and one per-tenant
``OrderedDict`` in LRU order, no allocation besides the entry itself). ``select_victims(k)`` is
O(T + k log T) where T is the number of tenants with evictable entries: the oldest entry of each tenant's
LRU is also its most idle one, so the first victim comes from a scan over the T tenant heads and further
ones from heaps over those heads (lazy deletion); nothing depends on the number of entries.
Per-tenant accounting (entries, size) is maintained incrementally.

How the vLLM block-pool plugin calls it (one ``TierPolicy`` for the replica's HBM, ``size=1``):

* ``cache_full_blocks(request, ...)``: ``insert(block_id, tenant, now, pinned=True)`` for each block
  that became cached (the request still holds it).
* a prefix-cache hit (``touch(blocks)``, ref_cnt += 1): ``pin(block_id)`` for a cached block; count the hit.
* ``free_blocks(ordered_blocks)`` (ref_cnt -= 1): ``unpin(block_id, now)`` in vLLM's order (it frees a
  request's blocks tail first, so tails become least recently used first).
* ``get_new_blocks(n)``: use free blocks that carry no hash first; for the rest,
  ``select_victims(k, now, requester=tenant)`` and evict those blocks from vLLM's hash map (then take them
  off the free queue). ``now`` must never go backwards (it is clamped to the largest value seen).
* a cached block evicted or reset by vLLM itself: ``remove(block_id)`` (not counted as a policy eviction).
* per-tenant metrics: ``usage(tenant)``, ``evictions`` (by tenant and reason), ``limits(tenant)``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from kvfleet_runtime.config import SLA_RANK, KVTier, SlaTier
from kvfleet_runtime.kv.limits import TenantLimits, build_default_limits

__all__ = [
    "AdmitResult",
    "EntryInfo",
    "EvictionReason",
    "TenantUsage",
    "TierPolicy",
    "Victim",
    "total_size",
]


class EvictionReason(StrEnum):
    """Why an entry was evicted (a metric label)."""

    TTL = "ttl"
    OVER_QUOTA = "over_quota"
    LRU = "lru"


@dataclass(frozen=True, slots=True)
class Victim:
    """An entry the policy evicted (already removed from the store when returned)."""

    key: Hashable
    tenant: str
    size: int
    reason: EvictionReason
    idle_seconds: float


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What a tenant holds on the tier right now."""

    entries: int
    size: int
    pinned_entries: int


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """A read-only view of one entry."""

    tenant: str
    size: int
    last_use: float
    pins: int


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """Result of :meth:`TierPolicy.admit`: whether the entry went in, and what was evicted for it."""

    admitted: bool
    victims: list[Victim]


class _Entry:
    __slots__ = ("last_use", "pins", "seq", "size", "tenant")

    def __init__(self, tenant: _Tenant, size: int, last_use: float, seq: int, pins: int) -> None:
        self.tenant = tenant
        self.size = size
        self.last_use = last_use
        self.seq = seq
        self.pins = pins


class _Tenant:
    __slots__ = ("entries", "limits", "lru", "name", "pinned", "size")

    def __init__(self, name: str, limits: TenantLimits) -> None:
        self.name = name
        self.limits = limits
        #: Unpinned entries, least recently used first: its head is also the tenant's most idle entry.
        self.lru: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.entries = 0
        self.size = 0
        self.pinned = 0

    def over_score(self) -> tuple[int, float]:
        """(above burst, relative overshoot); larger is evicted first. Only meaningful when over quota."""
        quota = self.limits.quota
        ratio = math.inf if quota == 0 else (self.size - quota) / quota
        return (1 if self.size > self.limits.burst else 0, ratio)

    def is_over_quota(self) -> bool:
        return self.size > self.limits.quota

    def is_reserved(self) -> bool:
        return self.limits.sla is SlaTier.PREMIUM and self.size <= self.limits.quota


class TierPolicy:
    """Per-tenant governed eviction for one tier of one cache. See the module docstring for the contract.

    ``capacity`` (in the tier's unit) is used by :meth:`make_room`/:meth:`admit` and to report
    :attr:`free`; :meth:`insert` never refuses, because in vLLM the block pool owns allocation.
    """

    def __init__(
        self,
        tier: KVTier,
        capacity: int,
        limits: Mapping[str, TenantLimits] | None = None,
        default_limits: TenantLimits | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        self._default_limits = default_limits or build_default_limits(tier, capacity)
        self._limits: dict[str, TenantLimits] = dict(limits or {})
        self._tenants: dict[str, _Tenant] = {}
        self._entries: dict[Hashable, _Entry] = {}
        self._used = 0
        self._seq = 0
        self._clock = -math.inf
        #: Evictions made by the policy, by (tenant, reason).
        self.evictions: dict[tuple[str, EvictionReason], int] = {}

    # ----------------------------------------------------------------------------------------- state
    @property
    def used(self) -> int:
        """Total size of all entries (pinned or not)."""
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> EntryInfo | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return EntryInfo(entry.tenant.name, entry.size, entry.last_use, entry.pins)

    def tenants(self) -> list[str]:
        """Tenants that hold entries or have limits set."""
        return sorted(set(self._limits) | {name for name, t in self._tenants.items() if t.entries})

    def usage(self, tenant: str) -> TenantUsage:
        state = self._tenants.get(tenant)
        if state is None:
            return TenantUsage(0, 0, 0)
        return TenantUsage(state.entries, state.size, state.pinned)

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self._default_limits)

    @property
    def default_limits(self) -> TenantLimits:
        """Limits of every tenant without its own; assigning applies at once to those tenants."""
        return self._default_limits

    @default_limits.setter
    def default_limits(self, limits: TenantLimits) -> None:
        self._default_limits = limits
        for name, state in self._tenants.items():
            if name not in self._limits:
                state.limits = limits

    def set_limits(self, tenant: str, limits: TenantLimits | None) -> None:
        """Change (or with ``None`` drop back to the default) a tenant's limits; takes effect at once."""
        if limits is None:
            self._limits.pop(tenant, None)
        else:
            self._limits[tenant] = limits
        state = self._tenants.get(tenant)
        if state is not None:
            state.limits = self.limits(tenant)

    def entry_keys(self, tenant: str | None = None) -> list[Hashable]:
        """Keys of all entries (or one tenant's), in no particular order. O(n): not for the hot path."""
        if tenant is None:
            return list(self._entries)
        return [k for k, e in self._entries.items() if e.tenant.name == tenant]

    def evictions_of(self, tenant: str) -> dict[EvictionReason, int]:
        return {reason: self.evictions.get((tenant, reason), 0) for reason in EvictionReason}

    # -------------------------------------------------------------------------------------- hot path
    def insert(self, key: Hashable, tenant: str, now: float, size: int = 1, pinned: bool = False) -> None:
        """Add a new entry used at ``now``. Raises ``KeyError`` if ``key`` is already present."""
        if key in self._entries:
            raise KeyError(f"entry {key!r} is already in the {self.tier} tier")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(tenant, self.limits(tenant))
        self._clock = max(self._clock, now)
        self._seq += 1
        entry = _Entry(state, size, self._clock, self._seq, 1 if pinned else 0)
        self._entries[key] = entry
        state.entries += 1
        state.size += size
        self._used += size
        if pinned:
            state.pinned += 1
        else:
            state.lru[key] = entry

    def touch(self, key: Hashable, now: float) -> bool:
        """Mark ``key`` used at ``now`` (most recently used). Returns whether it was present."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._clock = max(self._clock, now)
        self._seq += 1
        entry.last_use = self._clock
        entry.seq = self._seq
        if entry.pins == 0:
            entry.tenant.lru.move_to_end(key)
        return True

    def pin(self, key: Hashable) -> None:
        """A running request references ``key``: it cannot be evicted until unpinned. Nests."""
        entry = self._entries[key]
        entry.pins += 1
        if entry.pins == 1:
            del entry.tenant.lru[key]
            entry.tenant.pinned += 1

    def unpin(self, key: Hashable, now: float) -> None:
        """Drop one reference; at zero the entry becomes evictable as the most recently used."""
        entry = self._entries[key]
        if entry.pins == 0:
            raise ValueError(f"entry {key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._clock = max(self._clock, now)
            self._seq += 1
            entry.last_use = self._clock
            entry.seq = self._seq
            entry.tenant.pinned -= 1
            entry.tenant.lru[key] = entry

    def remove(self, key: Hashable) -> bool:
        """Forget ``key`` (evicted or reset by its host, not by this policy). Returns whether present."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._account_removal(key, entry)
        return True

    def clear(self) -> None:
        """Forget every entry (vLLM's ``reset_prefix_cache``); eviction counters are kept."""
        self._entries.clear()
        for state in self._tenants.values():
            state.lru.clear()
            state.entries = state.size = state.pinned = 0
        self._used = 0

    def drop_tenant(self, tenant: str) -> list[Hashable]:
        """Remove a tenant's unpinned entries (tenant deleted); returns their keys. Pinned ones stay."""
        state = self._tenants.get(tenant)
        if state is None:
            return []
        keys = list(state.lru)
        for key in keys:
            self._account_removal(key, self._entries.pop(key))
        return keys

    # -------------------------------------------------------------------------------------- eviction
    def select_victims(self, n: int, now: float, requester: str | None = None) -> list[Victim]:
        """Evict up to ``n`` entries in policy order and return them (fewer if too few are unpinned).

        ``requester`` is the tenant that needs the room; if it would exceed its burst cap by taking
        ``n`` more units, its own least recently used entries go first.
        """
        return self._evict(now, requester, max_victims=n, need=None)

    def make_room(self, size: int, now: float, requester: str | None = None) -> list[Victim]:
        """Evict in policy order until ``free >= size`` (or nothing evictable is left)."""
        if self.free >= size:
            return []
        return self._evict(now, requester, max_victims=None, need=size)

    def admit(
        self, key: Hashable, tenant: str, now: float, size: int = 1, pinned: bool = False
    ) -> AdmitResult:
        """``make_room`` for ``size`` on behalf of ``tenant``, then ``insert`` if it fits."""
        if size > self.capacity:
            return AdmitResult(False, [])
        victims = self.make_room(size, now, requester=tenant)
        if self.free < size:
            return AdmitResult(False, victims)
        self.insert(key, tenant, now, size, pinned)
        return AdmitResult(True, victims)

    def trim_to_burst(self, now: float) -> list[Victim]:
        """Evict each tenant's own least recently used unpinned entries while it holds more than its burst.

        For hosts that store without asking the policy first (LMCache's L1 allocates on its own, then
        reports the write): the burst cap is enforced after the fact, on the offending tenant only.
        """
        selection = _Selection(self, now)
        victims: list[Victim] = []
        for state in list(self._tenants.values()):
            while state.size > state.limits.burst and state.lru:
                head = next(iter(state.lru.values()))
                expired = now - head.last_use > state.limits.ttl_seconds
                reason = EvictionReason.TTL if expired else EvictionReason.OVER_QUOTA
                victim = selection.evict_head(state, reason)
                if victim is not None:
                    victims.append(victim)
        return victims

    def expire(self, now: float) -> list[Victim]:
        """Evict every unpinned entry idle past its tenant's TTL (for proactive, TTL-driven expiry)."""
        return _Selection(self, now).drain_expired()

    # ------------------------------------------------------------------------------------- internals
    def _evict(
        self, now: float, requester: str | None, max_victims: int | None, need: int | None
    ) -> list[Victim]:
        selection = _Selection(self, now)
        victims: list[Victim] = []
        incoming = need if need is not None else (max_victims or 0)
        own = self._tenants.get(requester) if requester is not None else None
        while (max_victims is None or len(victims) < max_victims) and (need is None or self.free < need):
            victim: Victim | None = None
            # Stage 0: a requester that would end above its burst cap recycles its own entries first.
            if own is not None and own.lru and own.size + incoming > own.limits.burst:
                head = next(iter(own.lru.values()))
                expired = now - head.last_use > own.limits.ttl_seconds
                victim = selection.evict_head(
                    own, EvictionReason.TTL if expired else EvictionReason.OVER_QUOTA
                )
            if victim is None:
                # The first victim by a scan over the tenants' heads (cheaper than building heaps when
                # one entry is needed, the common case); further victims of the same call via heaps.
                victim = selection.scan_one() if not victims else selection.next_victim()
            if victim is None:
                break
            victims.append(victim)
        return victims

    def _account_removal(self, key: Hashable, entry: _Entry) -> None:
        state = entry.tenant
        if entry.pins:
            state.pinned -= 1
        else:
            del state.lru[key]
        state.entries -= 1
        state.size -= entry.size
        self._used -= entry.size

    def _evict_entry(self, key: Hashable, entry: _Entry, reason: EvictionReason, now: float) -> Victim:
        del self._entries[key]
        self._account_removal(key, entry)
        name = entry.tenant.name
        self.evictions[(name, reason)] = self.evictions.get((name, reason), 0) + 1
        return Victim(key, name, entry.size, reason, max(0.0, now - entry.last_use))


class _Selection:
    """Victim selection state for one call: heaps over tenant heads, built on first use (lazy deletion).

    Within one call entries are only removed, so a tenant's head only gets younger, its usage only drops
    and its over-quota score only falls: a stale heap item is detected on pop (head sequence or score no
    longer matches) and re-pushed with the current value.
    """

    __slots__ = ("_lru_heap", "_now", "_over_heap", "_policy", "_ttl_heap")

    def __init__(self, policy: TierPolicy, now: float) -> None:
        self._policy = policy
        self._now = now
        self._ttl_heap: list[tuple[float, int, str]] | None = None
        self._over_heap: list[tuple[int, float, int, str]] | None = None
        self._lru_heap: list[tuple[int, int, str]] | None = None

    def next_victim(self) -> Victim | None:
        return self._pop_expired() or self._pop_over_quota() or self._pop_lru()

    def scan_one(self) -> Victim | None:
        """The next victim by a linear scan over tenants: same order as the heaps, no heap built."""
        tenants = self._policy._tenants
        best_ttl: tuple[float, int, str] | None = None
        best_over: tuple[int, float, int, str] | None = None
        best_lru: tuple[int, int, str] | None = None
        for state in tenants.values():
            if not state.lru:
                continue
            ttl = self._expired_item(state)
            if ttl is not None and (best_ttl is None or ttl < best_ttl):
                best_ttl = ttl
            if best_ttl is None:
                over = self._over_item(state)
                if over is not None and (best_over is None or over < best_over):
                    best_over = over
                lru = self._lru_item(state)
                if lru is not None and (best_lru is None or lru < best_lru):
                    best_lru = lru
        if best_ttl is not None:
            return self.evict_head(tenants[best_ttl[2]], EvictionReason.TTL)
        if best_over is not None:
            return self.evict_head(tenants[best_over[3]], EvictionReason.OVER_QUOTA)
        if best_lru is not None:
            return self.evict_head(tenants[best_lru[2]], EvictionReason.LRU)
        return None

    def drain_expired(self) -> list[Victim]:
        out: list[Victim] = []
        while (victim := self._pop_expired()) is not None:
            out.append(victim)
        return out

    def evict_head(self, state: _Tenant, reason: EvictionReason) -> Victim | None:
        if not state.lru:
            return None
        key, entry = next(iter(state.lru.items()))
        victim = self._policy._evict_entry(key, entry, reason, self._now)
        self._after_eviction(state)
        return victim

    # -- stage 1: expired entries, oldest first
    def _expired_item(self, state: _Tenant) -> tuple[float, int, str] | None:
        if not state.lru:
            return None
        head = next(iter(state.lru.values()))
        if self._now - head.last_use > state.limits.ttl_seconds:
            return (head.last_use, head.seq, state.name)
        return None

    def _pop_expired(self) -> Victim | None:
        tenants = self._policy._tenants
        if self._ttl_heap is None:
            self._ttl_heap = [item for s in tenants.values() if (item := self._expired_item(s)) is not None]
            heapq.heapify(self._ttl_heap)
        heap = self._ttl_heap
        while heap:
            _, seq, name = heapq.heappop(heap)
            state = tenants[name]
            current = self._expired_item(state)
            if current is None:
                continue
            if current[1] != seq:  # the head moved (evicted by another stage): retry with the new head
                heapq.heappush(heap, current)
                continue
            return self.evict_head(state, EvictionReason.TTL)
        return None

    # -- stage 2: the tenant furthest over quota gives up its least recently used entry
    @staticmethod
    def _over_item(state: _Tenant) -> tuple[int, float, int, str] | None:
        if not state.lru or not state.is_over_quota():
            return None
        above_burst, ratio = state.over_score()
        return (-above_burst, -ratio, SLA_RANK[state.limits.sla], state.name)

    def _pop_over_quota(self) -> Victim | None:
        tenants = self._policy._tenants
        if self._over_heap is None:
            self._over_heap = [item for s in tenants.values() if (item := self._over_item(s)) is not None]
            heapq.heapify(self._over_heap)
        heap = self._over_heap
        while heap:
            item = heapq.heappop(heap)
            state = tenants[item[3]]
            current = self._over_item(state)
            if current is None:
                continue
            if current != item:  # its usage dropped since it was pushed: re-rank
                heapq.heappush(heap, current)
                continue
            return self.evict_head(state, EvictionReason.OVER_QUOTA)
        return None

    # -- stage 3: global LRU, premium reservations last
    @staticmethod
    def _lru_item(state: _Tenant) -> tuple[int, int, str] | None:
        if not state.lru:
            return None
        head = next(iter(state.lru.values()))
        return (1 if state.is_reserved() else 0, head.seq, state.name)

    def _pop_lru(self) -> Victim | None:
        tenants = self._policy._tenants
        if self._lru_heap is None:
            self._lru_heap = [item for s in tenants.values() if (item := self._lru_item(s)) is not None]
            heapq.heapify(self._lru_heap)
        heap = self._lru_heap
        while heap:
            item = heapq.heappop(heap)
            state = tenants[item[2]]
            current = self._lru_item(state)
            if current is None:
                continue
            if current != item:
                heapq.heappush(heap, current)
                continue
            return self.evict_head(state, EvictionReason.LRU)
        return None

    def _after_eviction(self, state: _Tenant) -> None:
        # Keep every heap that was built aware of this tenant's new head / score. Pushing a duplicate is
        # harmless: stale or duplicate items fail validation on pop.
        if self._ttl_heap is not None and (item := self._expired_item(state)) is not None:
            heapq.heappush(self._ttl_heap, item)
        if self._over_heap is not None and (over := self._over_item(state)) is not None:
            heapq.heappush(self._over_heap, over)
        if self._lru_heap is not None and (lru := self._lru_item(state)) is not None:
            heapq.heappush(self._lru_heap, lru)


def total_size(victims: Iterable[Victim]) -> int:
    """Sum of the victims' sizes."""
    return sum(v.size for v in victims)
