"""vLLM's block pool with per-tenant governed eviction (vLLM 0.32), and the hooks that feed it.

:class:`TenantAwareBlockPool` subclasses vLLM's ``BlockPool`` and changes one decision only: *which*
cached blocks ``get_new_blocks`` evicts when it needs room. Everything vLLM computes stays as it is: ref
counts, the free queue, the hash maps, the null block, the metrics collector, KV events, and the
contents and number of blocks a request gets. The choice is made by the KV policy core
(``kvfleet_runtime.kv.policy.TierPolicy``, one for the replica's HBM, one unit per block), in its order:
blocks idle past their tenant's HBM TTL, then the least recently used blocks of the tenant furthest
above its quota, then the global LRU.

How the pool keeps the policy in step with vLLM (invariants, checked by tests/unit/test_block_pool*.py):

* a block is a policy entry exactly while it has a (primary) block hash; its owner is the accounting
  tenant (``engine.attribution``) of the request that cached it. Every hash change in vLLM 0.32 goes
  through ``_insert_block_hash`` and ``_remove_cached_block_hashes`` (and ``reset_prefix_cache``), so
  those are the hooks; ``cache_full_blocks``, ``cache_partial_block`` and ``move_block_hashes`` only
  say whose block it is.
* an entry is pinned exactly while its block's ``ref_cnt > 0`` (``touch``: 0 -> 1 pins; ``free_blocks``
  and ``unpin_blocks``: 1 -> 0 unpins, in vLLM's order, so the tail of a request becomes least recently
  used first, as in vLLM's free queue).
* ``get_new_blocks(n)`` takes free blocks without a hash first (exactly the blocks vLLM would hand out
  without evicting anything), then asks the policy for victims among the cached free blocks and evicts
  their hashes through vLLM's own ``_maybe_evict_cached_block``. Only when the bookkeeping disagrees with
  vLLM (a bug) does it fall back to vLLM's LRU order for the rest, with an error in the log.

Per-tenant counters (prefix-cache queries, queried and hit tokens) come from
:class:`TenantAwareKVCacheManager`, which also tells the pool which tenant is allocating (the policy's
``requester``: a tenant at its burst cap recycles its own blocks first). The tenant table is re-read when
its file changes (checked at most once a second from ``get_new_blocks``/``cache_full_blocks``); blocks
keep their owner, and limits change at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.request import Request

from kvfleet_runtime.config import KVTier
from kvfleet_runtime.engine.attribution import UNATTRIBUTED, Attribution
from kvfleet_runtime.engine.metrics import PoolSnapshot, TenantSnapshot
from kvfleet_runtime.engine.metrics_server import ensure_metrics_server
from kvfleet_runtime.engine.plugin_config import (
    ENGINE_LOGGER,
    TenantSource,
    describe_installed_pool,
    load_plugin_settings,
)
from kvfleet_runtime.kv.policy import TierPolicy

__all__ = ["TenantAwareBlockPool", "TenantAwareKVCacheManager"]

logger = logging.getLogger(ENGINE_LOGGER)


class TenantAwareBlockPool(BlockPool):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """vLLM's ``BlockPool`` whose evictions follow kvfleet's per-tenant policy.

    Constructed by vLLM (``KVCacheCoordinator``) with vLLM's arguments only: the tenants then come from
    the plugin's environment (``engine.plugin_config``) and the metrics server is started. Tests pass
    ``attribution`` (and a ``clock``) instead and get no files, no reload and no server.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        medium: str = MEDIUM_GPU,
        *,
        attribution: Attribution | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            medium=medium,
        )
        self._clock = clock
        self.capacity = num_gpu_blocks - 1  # the null block is never available
        self._source: TenantSource | None = None
        if attribution is None:
            settings = load_plugin_settings(os.environ)
            if settings is None:
                raise RuntimeError(
                    "TenantAwareBlockPool needs the kvfleet plugin environment (KVFLEET_TENANT_TABLE, "
                    "KVFLEET_KEY_FILE, KVFLEET_POOL) or an explicit attribution"
                )
            self._source = TenantSource(settings, self.capacity)
            attribution = self._source.load()
        self._attribution = attribution
        self._policy = TierPolicy(
            KVTier.HBM, self.capacity, dict(attribution.limits), default_limits=attribution.unattributed
        )
        #: Block ids of policy entries whose block has ``ref_cnt > 0`` (mirrors the policy's pins).
        self._pinned: set[int] = set()
        #: Accounting tenant of the request whose blocks are being cached right now.
        self._ctx_tenant: str | None = None
        #: Accounting tenant of the request being allocated (set by TenantAwareKVCacheManager).
        self.requester: str | None = None
        self._queries: dict[str, int] = {}
        self._queried_tokens: dict[str, int] = {}
        self._hit_tokens: dict[str, int] = {}
        self._hit_blocks: dict[str, int] = {}
        self._fallbacks = 0
        if self._source is not None:
            assert self._source.table is not None
            settings = self._source.settings
            metrics_port = settings.resolve_metrics_port(self._source.table)
            ensure_metrics_server(
                settings.metrics_host,
                metrics_port,
                self,
                upstreams=settings.metrics_upstreams,
                debug_port=settings.debug_port,
            )
            # vLLM builds the pool in its engine-core process only: this line says, in the engine's own
            # log, that per-tenant governance is on there (register() runs in every vLLM process).
            logger.info(describe_installed_pool(settings.pool, attribution, metrics_port))

    # ------------------------------------------------------------------------------ attribution
    @property
    def policy(self) -> TierPolicy:
        """The policy core (read-only use: tests and metrics)."""
        return self._policy

    @property
    def attribution(self) -> Attribution:
        return self._attribution

    def tenant_of(self, request: Request) -> str:
        """The accounting tenant of a request (from its ``cache_salt``)."""
        return self._attribution.tenant_of(request.cache_salt)

    def apply_attribution(self, attribution: Attribution) -> None:
        """Switch to new tenants/limits; resident blocks keep their owners (accounting is never lost)."""
        self._attribution = attribution
        self._policy.default_limits = attribution.unattributed
        for name in set(self._policy.tenants()) | set(attribution.limits):
            self._policy.set_limits(name, attribution.limits.get(name))

    def _now(self) -> float:
        now = self._clock()
        if self._source is not None:
            new = self._source.poll(now)  # returns at once unless a second has passed
            if new is not None:
                self.apply_attribution(new)
        return now

    def record_prefix_query(self, request: Request, num_hits: int) -> None:
        """Count one admitted prefix-cache lookup of ``request`` that found ``num_hits`` cached tokens."""
        tenant = self.tenant_of(request)
        self._queries[tenant] = self._queries.get(tenant, 0) + 1
        self._queried_tokens[tenant] = self._queried_tokens.get(tenant, 0) + request.num_tokens
        self._hit_tokens[tenant] = self._hit_tokens.get(tenant, 0) + num_hits
        self._hit_blocks[tenant] = self._hit_blocks.get(tenant, 0) + num_hits // self.hash_block_size

    # ----------------------------------------------------------------------- hash bookkeeping hooks
    def cache_full_blocks(self, request: Request, *args: Any, **kwargs: Any) -> None:
        previous = self._ctx_tenant
        self._ctx_tenant = self.tenant_of(request)
        if self._source is not None:
            self._now()
        try:
            super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self._ctx_tenant = previous

    def cache_partial_block(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        previous = self._ctx_tenant
        self._ctx_tenant = self.tenant_of(request)
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self._ctx_tenant = previous

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        # The private copy keeps the cache entry of the block it copies, so it keeps its owner too.
        info = self._policy.get(src_block.block_id)
        previous = self._ctx_tenant
        if info is not None:
            self._ctx_tenant = info.tenant
        try:
            super().move_block_hashes(src_block, dst_block)
        finally:
            self._ctx_tenant = previous

    def _insert_block_hash(
        self, block_hash_with_group_id: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        had_hash = block.block_hash is not None
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        if had_hash or block.block_hash is None or block.is_null:
            return
        block_id = block.block_id
        if block_id in self._policy:  # cannot happen while the invariants hold; never double-count
            self._policy.remove(block_id)
            self._pinned.discard(block_id)
        pinned = block.ref_cnt > 0
        self._policy.insert(block_id, self._ctx_tenant or UNATTRIBUTED, self._clock(), pinned=pinned)
        if pinned:
            self._pinned.add(block_id)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        had_hash = block.block_hash is not None
        removed: list[BlockHashWithGroupId] = super()._remove_cached_block_hashes(block)
        # Policy victims are already gone from the policy (remove() is then a no-op).
        if had_hash and block.block_hash is None and self._policy.remove(block.block_id):
            self._pinned.discard(block.block_id)
        return removed

    def reset_prefix_cache(self) -> bool:
        done: bool = super().reset_prefix_cache()
        if done:
            self._policy.clear()
            self._pinned.clear()
        return done

    # ------------------------------------------------------------------------ ref-count hooks
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        becoming_used = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null]
        super().touch(blocks)
        for block in becoming_used:
            block_id = block.block_id
            if block_id not in self._pinned and block_id in self._policy:
                self._policy.pin(block_id)
                self._pinned.add(block_id)

    def _unpin_released(self, blocks: Iterable[KVCacheBlock]) -> None:
        pinned = self._pinned
        if not pinned:
            return
        now = self._clock()
        for block in blocks:
            block_id = block.block_id
            if block.ref_cnt == 0 and block_id in pinned and (block.pool is None or block.pool is self):
                pinned.discard(block_id)
                self._policy.unpin(block_id, now)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        self._unpin_released(blocks)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        listed = list(blocks)
        super().unpin_blocks(listed, on_reuse)
        self._unpin_released(listed)

    # ------------------------------------------------------------------------------ allocation
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (the eviction candidates)."""
        return len(self._policy) - len(self._pinned)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's ``get_new_blocks`` with the policy choosing which cached blocks to evict."""
        if not self.enable_caching or num_blocks <= 0:
            return list(super().get_new_blocks(num_blocks))
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        now = self._now()
        cached_free = self.num_cached_free_blocks()
        if cached_free == 0:
            # Nothing cached is free: vLLM's own order evicts nothing either.
            return list(super().get_new_blocks(num_blocks))
        ret: list[KVCacheBlock] = []
        want_plain = min(num_blocks, queue.num_free_blocks - cached_free)
        if want_plain > 0:
            # Blocks without a hash sit mostly at the head (vLLM prepends them); the scan skips the
            # cached ones and stops once it has what it needs.
            tail = queue.fake_free_list_tail
            node = queue.fake_free_list_head.next_free_block
            while len(ret) < want_plain and node is not None and node is not tail:
                if node.block_hash is None:
                    ret.append(node)
                node = node.next_free_block
            for block in ret:
                queue.remove(block)
        missing = num_blocks - len(ret)
        if missing > 0:
            for victim in self._policy.select_victims(missing, now, requester=self.requester):
                block = self.blocks[cast(int, victim.key)]
                queue.remove(block)
                ret.append(block)
            if len(ret) < num_blocks:
                self._fallbacks += 1
                logger.error(
                    "kvfleet: block pool bookkeeping disagrees with vLLM (%d blocks short); "
                    "falling back to vLLM's LRU order for them",
                    num_blocks - len(ret),
                )
                ret.extend(queue.popleft_n(num_blocks - len(ret)))
        # From here on exactly what vLLM's get_new_blocks does with the blocks it popped.
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        for block in ret:
            self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        return ret

    # ------------------------------------------------------------------------------ observation
    def snapshot(self) -> PoolSnapshot:
        """Per-tenant state and counters; safe to call from the metrics server's thread."""
        names: set[str] = set(self._attribution.limits)
        for _ in range(10):
            try:  # the scheduler thread may add a tenant while we iterate; retry then
                names |= set(self._policy.tenants())
                break
            except RuntimeError:
                continue
        tenants: dict[str, TenantSnapshot] = {}
        for name in names:
            usage = self._policy.usage(name)
            limits = self._policy.limits(name)
            tenants[name] = TenantSnapshot(
                usage.entries, usage.pinned_entries, limits.quota, limits.burst, limits.ttl_seconds
            )
        return PoolSnapshot(
            total_blocks=self.capacity,
            used_blocks=self.capacity - self.free_block_queue.num_free_blocks,
            cached_blocks=len(self._policy),
            tenants=tenants,
            queries=dict(self._queries),
            queried_tokens=dict(self._queried_tokens),
            hit_tokens=dict(self._hit_tokens),
            hit_blocks=dict(self._hit_blocks),
            evictions={(t, str(r)): n for (t, r), n in dict(self._policy.evictions).items()},
            reloads=dict(self._source.reloads) if self._source is not None else {},
        )

    def count_vllm_blocks(self) -> dict[str, int]:
        """vLLM's own view, counted from its data structures (not from the policy): O(blocks)."""
        cached = used = 0
        for block in self.blocks:
            if block.is_null:
                continue
            if block.block_hash is not None:
                cached += 1
            if block.ref_cnt > 0:
                used += 1
        return {
            "total_blocks": self.capacity,
            "free_blocks": self.free_block_queue.num_free_blocks,
            "used_blocks": used,
            "cached_blocks": cached,
            "hash_map_keys": len(self.cached_block_hash_to_block),
            "fallbacks": self._fallbacks,
        }


class TenantAwareKVCacheManager(KVCacheManager):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """vLLM's ``KVCacheManager`` that tells a tenant-aware pool who allocates and who hit the cache.

    Two thin overrides; behaviour is unchanged (with a stock pool it is exactly vLLM's manager).
    """

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        super().record_prefix_cache_stats(request, num_hits)
        pool = self.block_pool
        if isinstance(pool, TenantAwareBlockPool) and self.prefix_cache_lookup_enabled(request):
            pool.record_prefix_query(request, num_hits)

    def allocate_slots(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        if not isinstance(pool, TenantAwareBlockPool):
            return super().allocate_slots(request, *args, **kwargs)
        previous = pool.requester
        pool.requester = pool.tenant_of(request)
        try:
            return super().allocate_slots(request, *args, **kwargs)
        finally:
            pool.requester = previous
