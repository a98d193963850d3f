"""The tenant-aware block pool against vLLM's real BlockPool, KVCacheManager and Request classes.

Requests go through vLLM's own code paths (``get_computed_blocks`` -> ``record_prefix_cache_stats`` ->
``allocate_slots`` -> ``free``) exactly as its scheduler calls them; the pool under test is installed the
way the plugin installs it (vLLM's coordinator constructs it by name). Only time is controlled (a fake
clock passed to the pool), because TTLs of seconds cannot be waited for in a unit test.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from components import missing_component
from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
    derive_cache_salt,
    dump_json,
)
from kvfleet_runtime.engine.attribution import (
    SHARED_PREFIX,
    UNATTRIBUTED,
    Attribution,
    build_attribution,
)
from kvfleet_runtime.engine.metrics import (
    EVICTIONS,
    PREFIX_HIT_TOKENS,
    PREFIX_QUERIED_TOKENS,
    TENANT_QUOTA_BLOCKS,
    TENANT_RESIDENT_BLOCKS,
    build_metric_families,
)
from kvfleet_runtime.engine.plugin_config import (
    PluginSettings,
    TenantSource,
    describe_installed_pool,
    load_plugin_settings,
)

try:
    import torch
    from vllm import SamplingParams
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from kvfleet_runtime.engine.block_pool import TenantAwareBlockPool, TenantAwareKVCacheManager
    from kvfleet_runtime.engine.vllm_plugin import check_vllm_version

    HAVE_VLLM = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_VLLM = False


@pytest.fixture(autouse=True)
def require_vllm() -> None:
    if not HAVE_VLLM:
        missing_component("vLLM CPU build", "make test (hack/install-engine.sh)")


BLOCK = 16
SALT_KEY_HEX = "ab" * 32
POOL = "shared"

if HAVE_VLLM:
    init_none_hash(sha256)
    HASHER = get_request_block_hasher(BLOCK, sha256)


# ----------------------------------------------------------------------------------------- builders
def tenant(
    name: str,
    quota: int,
    burst: int | None = None,
    *,
    ttl: float = 1000.0,
    sla: SlaTier = SlaTier.STANDARD,
    isolation: Isolation = Isolation.SALTED,
    salt_id: str | None = None,
    pool: str = POOL,
) -> TenantEntry:
    return tenant_entry(
        name,
        tier=sla,
        isolation=isolation,
        salt_id=salt_id or ("pool-salt" if isolation is Isolation.SHARED else f"salt-{name}"),
        pool=pool,
        models=["tiny"],
        hbm=quota,
        hbm_burst=burst,
        ttl=TierTTLs(hbm_seconds=ttl),
    )


def table_of(*tenants: TenantEntry, burst_cap: float = 1.0) -> TenantTable:
    return tenant_table(
        *tenants,
        pools=[
            pool_entry(name, block_size=BLOCK, hbm_blocks=64, burst_cap=burst_cap) for name in {POOL, "other"}
        ],
        model_deployment="md",
        served_model_name="tiny",
        pool_salt_id="pool-salt",
    )


KEYS = KeyFile(salt_key_hex=SALT_KEY_HEX, key_hashes={})


def salt_of(salt_id: str) -> str:
    return derive_cache_salt(KEYS.salt_key, salt_id)


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    """vLLM's KV cache manager over a tenant-aware pool, driven like vLLM's scheduler drives it."""

    manager: Any
    pool: TenantAwareBlockPool
    clock: Clock
    running: dict[str, Request] = field(default_factory=dict)
    ids: Iterator[int] = field(default_factory=itertools.count)

    def request(self, tokens: list[int], salt: str | None) -> Request:
        return Request(
            request_id=f"r{next(self.ids)}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt=salt,
            block_hasher=HASHER,
        )

    def start(self, tokens: list[int], salt: str | None) -> tuple[Request, int] | None:
        """Admit a request (prefix lookup + allocation + caching); None when the pool is too full."""
        req = self.request(tokens, salt)
        blocks, hits, _ = self.manager.get_computed_blocks(req)
        out = self.manager.allocate_slots(
            req, req.num_tokens - hits, num_new_computed_tokens=hits, new_computed_blocks=blocks
        )
        if out is None:
            return None
        self.manager.record_prefix_cache_stats(req, hits)
        req.num_computed_tokens = req.num_tokens
        self.running[req.request_id] = req
        return req, hits

    def finish(self, req: Request) -> None:
        self.manager.free(req)
        del self.running[req.request_id]

    def run(self, tokens: list[int], salt: str | None) -> int:
        """One request start to finish; returns its prefix-cache hit in tokens."""
        started = self.start(tokens, salt)
        assert started is not None, "the pool could not hold the request"
        self.finish(started[0])
        return started[1]


def build_engine(
    attribution_of: Callable[[int], Attribution], num_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> Engine:
    clock = Clock()
    holder: dict[str, TenantAwareBlockPool] = {}

    class Pool(TenantAwareBlockPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, attribution=attribution_of(num_blocks - 1), clock=clock, **kwargs)
            holder["pool"] = self

    # Exactly the plugin's hook: vLLM's coordinator builds its pool by this name.
    monkeypatch.setattr(kv_cache_coordinator, "BlockPool", Pool)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    manager = TenantAwareKVCacheManager(
        config, max_model_len=BLOCK * num_blocks, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )
    return Engine(manager, holder["pool"], clock)


def attribution_for(table: TenantTable) -> Callable[[int], Attribution]:
    return lambda capacity: build_attribution(table, KEYS, POOL, capacity)


def prompt(seed: int, n_blocks: int) -> list[int]:
    """A prompt of ``n_blocks`` full blocks plus one token (the last token is always recomputed)."""
    return [(seed * 7919 + i) % 4000 + 1 for i in range(n_blocks * BLOCK + 1)]


def check_invariants(engine: Engine) -> None:
    """vLLM's pool invariants plus the plugin's accounting, counted from vLLM's own structures."""
    pool = engine.pool
    blocks = [b for b in pool.blocks if not b.is_null]
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    # free queue == exactly the blocks with ref_cnt 0, once each; the count matches
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids) == {b.block_id for b in blocks if b.ref_cnt == 0}
    assert all(b.ref_cnt >= 0 for b in blocks)
    # ref counts == number of running requests holding the block
    held: dict[int, int] = {}
    for req in engine.running.values():
        for block in engine.manager.coordinator.single_type_managers[0].req_to_blocks[req.request_id]:
            held[block.block_id] = held.get(block.block_id, 0) + 1
    assert {b.block_id: b.ref_cnt for b in blocks if b.ref_cnt} == held
    # hash map consistency: every mapped block carries that hash; every hashed block is mapped
    hashed = {b.block_id: b.block_hash for b in blocks if b.block_hash is not None}
    mapped: dict[int, Any] = {}
    for key, value in pool.cached_block_hash_to_block._cache.items():
        for block in value.values() if isinstance(value, dict) else [value]:
            mapped[block.block_id] = key
    assert mapped == hashed
    # the policy holds exactly the hashed blocks, pinned exactly when referenced
    policy = pool.policy
    assert set(policy.entry_keys()) == set(hashed)
    for block_id in hashed:
        info = policy.get(block_id)
        assert info is not None
        assert (info.pins > 0) == (pool.blocks[block_id].ref_cnt > 0)
    # per-tenant resident blocks sum to the cached blocks vLLM holds
    tenants = pool.snapshot().tenants
    assert sum(t.resident_blocks for t in tenants.values()) == len(hashed)
    assert sum(t.pinned_blocks for t in tenants.values()) == sum(
        1 for b in blocks if b.block_hash is not None and b.ref_cnt > 0
    )
    assert pool.num_cached_free_blocks() == sum(
        1 for b in blocks if b.block_hash is not None and b.ref_cnt == 0
    )
    vllm_view = pool.count_vllm_blocks()
    assert vllm_view["cached_blocks"] == len(hashed)
    assert vllm_view["fallbacks"] == 0


# ----------------------------------------------------------------------------------------- attribution
def test_salted_tenants_are_their_own_accounting_tenants() -> None:
    table = table_of(tenant("a", 4, 8, ttl=20.0), tenant("b", 2))
    attr = build_attribution(table, KEYS, POOL, 100)
    assert attr.tenant_of(salt_of("salt-a")) == "a"
    assert attr.tenant_of(salt_of("salt-b")) == "b"
    assert attr.limits["a"].quota == 4 and attr.limits["a"].burst == 8
    assert attr.limits["a"].ttl_seconds == 20.0
    assert attr.members["a"] == ("a",)


def test_shared_tenants_form_one_group_with_combined_limits() -> None:
    table = table_of(
        tenant("s1", 3, 5, ttl=10.0, isolation=Isolation.SHARED, sla=SlaTier.BASIC),
        tenant("s2", 4, 6, ttl=40.0, isolation=Isolation.SHARED, sla=SlaTier.PREMIUM),
        tenant("c", 1),
    )
    attr = build_attribution(table, KEYS, POOL, 100)
    group = SHARED_PREFIX + "pool-salt"
    assert attr.tenant_of(salt_of("pool-salt")) == group
    assert attr.members[group] == ("s1", "s2")
    limits = attr.limits[group]
    assert (limits.quota, limits.burst, limits.ttl_seconds, limits.sla) == (7, 11, 40.0, SlaTier.PREMIUM)


def test_a_single_shared_tenant_is_still_the_group() -> None:
    # Adding a second shared tenant later must not rename the accounting tenant.
    table = table_of(tenant("s1", 3, isolation=Isolation.SHARED))
    attr = build_attribution(table, KEYS, POOL, 100)
    assert attr.tenant_of(salt_of("pool-salt")) == SHARED_PREFIX + "pool-salt"


def test_group_burst_is_capped_by_the_pool_burst_cap() -> None:
    table = table_of(
        tenant("s1", 10, 60, isolation=Isolation.SHARED),
        tenant("s2", 10, 60, isolation=Isolation.SHARED),
        burst_cap=0.5,
    )
    limits = build_attribution(table, KEYS, POOL, 100).limits[SHARED_PREFIX + "pool-salt"]
    assert (limits.quota, limits.burst) == (20, 50)


def test_unknown_salt_no_salt_and_other_pools_are_unattributed() -> None:
    table = table_of(tenant("a", 4), tenant("elsewhere", 4, pool="other"))
    attr = build_attribution(table, KEYS, POOL, 100)
    assert attr.tenant_of(None) == UNATTRIBUTED
    assert attr.tenant_of("not-a-salt") == UNATTRIBUTED
    assert attr.tenant_of(salt_of("salt-elsewhere")) == UNATTRIBUTED
    assert attr.limits[UNATTRIBUTED].quota == 0
    with pytest.raises(ValueError, match="not in the tenant table"):
        build_attribution(table, KEYS, "nope", 100)


def test_cached_blocks_belong_to_the_requests_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_of(tenant("a", 10), tenant("s1", 5, isolation=Isolation.SHARED))
    engine = build_engine(attribution_for(table), 64, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-a"))
    engine.run(prompt(2, 2), salt_of("pool-salt"))
    engine.run(prompt(3, 1), None)
    engine.run(prompt(4, 4), "forged-salt")
    usage = {t: engine.pool.policy.usage(t).entries for t in ("a", SHARED_PREFIX + "pool-salt", UNATTRIBUTED)}
    assert usage == {"a": 3, SHARED_PREFIX + "pool-salt": 2, UNATTRIBUTED: 5}
    check_invariants(engine)


# ----------------------------------------------------------------------------------------- eviction
def test_stock_lru_order_when_everyone_is_within_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 usable blocks; a and b within quota, nothing expired: the policy's global LRU = vLLM's order.
    table = table_of(tenant("a", 8), tenant("b", 8))
    engine = build_engine(attribution_for(table), 9, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-a"))  # oldest
    engine.clock.now = 1
    engine.run(prompt(2, 3), salt_of("salt-b"))
    engine.clock.now = 2
    engine.run(prompt(3, 4), salt_of("salt-b"))  # needs 4 (+1 partial): evicts a's 3 blocks first
    # 2 free blocks carry no hash; the other 3 come from a, the least recently used, by plain LRU.
    assert engine.pool.policy.usage("a").entries == 0
    assert engine.pool.policy.evictions == {("a", "lru"): 3}
    assert engine.pool.policy.usage("b").entries == 3 + 4
    check_invariants(engine)


def test_victim_order_is_ttl_then_over_quota_then_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_of(tenant("quick", 20, ttl=5.0), tenant("hog", 1), tenant("calm", 20))
    engine = build_engine(attribution_for(table), 13, monkeypatch)  # 12 usable blocks
    engine.run(prompt(1, 2), salt_of("salt-calm"))  # t=0, the oldest: stock LRU would take these
    engine.clock.now = 1
    engine.run(prompt(2, 3), salt_of("salt-hog"))  # over its quota of 1
    engine.clock.now = 2
    engine.run(prompt(3, 2), salt_of("salt-quick"))  # expires at t > 7
    engine.clock.now = 10
    # 7 blocks cached, 5 free without a hash; 8 full blocks + 1 partial need 4 victims
    engine.run(prompt(4, 8), salt_of("salt-calm"))
    ev = engine.pool.policy.evictions
    assert ev == {("quick", "ttl"): 2, ("hog", "over_quota"): 2}, ev
    # calm's old prefix is still cached: a repeat hits in full
    assert engine.run(prompt(1, 2), salt_of("salt-calm")) == 2 * BLOCK
    check_invariants(engine)


def test_within_quota_tenant_keeps_its_blocks_under_a_flood(monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_of(tenant("victim", 4, 8), tenant("flood", 2, 8))
    engine = build_engine(attribution_for(table), 17, monkeypatch)  # 16 usable blocks
    victim_prompt = prompt(100, 4)
    engine.run(victim_prompt, salt_of("salt-victim"))
    for i in range(30):
        engine.clock.now = i + 1
        engine.run(prompt(i, 3), salt_of("salt-flood"))
        if i % 5 == 4:
            assert engine.run(victim_prompt, salt_of("salt-victim")) == 4 * BLOCK
    assert engine.pool.policy.usage("victim").entries == 4
    assert engine.pool.policy.evictions_of("victim") == dict.fromkeys(
        engine.pool.policy.evictions_of("victim"), 0
    )
    check_invariants(engine)


def test_stock_vllm_loses_the_victims_blocks_under_the_same_flood(monkeypatch: pytest.MonkeyPatch) -> None:
    # The control for the test above, with vLLM's own pool: the flood takes the victim's prefix.
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=17, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    manager = KVCacheManager(
        config, max_model_len=BLOCK * 17, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )
    engine = Engine(manager, manager.block_pool, Clock())
    victim_prompt = prompt(100, 4)
    engine.run(victim_prompt, salt_of("salt-victim"))
    hits = []
    for i in range(30):
        engine.run(prompt(i, 3), salt_of("salt-flood"))
        if i % 5 == 4:
            hits.append(engine.run(victim_prompt, salt_of("salt-victim")))
    assert hits.count(4 * BLOCK) < len(hits)


def test_over_quota_tenant_loses_its_own_blocks_first(monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_of(tenant("big", 2, 12), tenant("small", 6))
    engine = build_engine(attribution_for(table), 13, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-small"))  # small's blocks are the oldest
    for i in range(6):  # 12 blocks of big's: more than fit next to small's 3
        engine.clock.now = i + 1
        engine.run(prompt(10 + i, 2), salt_of("salt-big"))
    ev = engine.pool.policy.evictions
    assert ev.get(("small", "lru"), 0) == ev.get(("small", "over_quota"), 0) == 0
    assert ev.get(("big", "over_quota"), 0) > 0
    assert engine.pool.policy.usage("small").entries == 3
    check_invariants(engine)


def test_requester_at_its_burst_cap_recycles_its_own_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both over quota 0; "greedy" sits at its burst cap of 4, so its own allocation takes its own blocks
    # even though "other" (quota 0 as well) has older ones.
    table = table_of(tenant("greedy", 0, 4), tenant("other", 0, 8))
    engine = build_engine(attribution_for(table), 9, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-other"))
    engine.clock.now = 1
    engine.run(prompt(2, 4), salt_of("salt-greedy"))
    engine.clock.now = 2
    engine.run(prompt(3, 2), salt_of("salt-greedy"))
    assert engine.pool.policy.evictions.get(("greedy", "over_quota"), 0) >= 2
    check_invariants(engine)


def test_requests_still_get_exactly_the_blocks_they_need(monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_of(tenant("a", 2), tenant("b", 2))
    engine = build_engine(attribution_for(table), 9, monkeypatch)
    started = [engine.start(prompt(i, 2), salt_of("salt-a" if i % 2 else "salt-b")) for i in range(2)]
    assert all(s is not None for s in started)
    assert engine.start(prompt(9, 4), salt_of("salt-a")) is None  # 6 needed, 2 free: vLLM says no
    check_invariants(engine)
    for s in started:
        assert s is not None
        engine.finish(s[0])
    check_invariants(engine)


def test_reset_prefix_cache_clears_the_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(attribution_for(table_of(tenant("a", 8))), 17, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-a"))
    assert engine.manager.reset_prefix_cache()
    assert len(engine.pool.policy) == 0
    check_invariants(engine)
    assert engine.run(prompt(1, 3), salt_of("salt-a")) == 0


def test_evict_blocks_from_a_connector_is_mirrored(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(attribution_for(table_of(tenant("a", 8))), 17, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-a"))
    ids = set(engine.pool.policy.entry_keys())
    engine.manager.evict_blocks({int(i) for i in ids})  # type: ignore[call-overload]
    assert len(engine.pool.policy) == 0
    assert engine.pool.policy.evictions == {}  # not a policy eviction
    check_invariants(engine)


# ----------------------------------------------------------------------------------------- counters
def test_hits_and_queried_tokens_per_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(attribution_for(table_of(tenant("a", 16), tenant("b", 16))), 33, monkeypatch)
    engine.run(prompt(1, 3), salt_of("salt-a"))
    engine.run(prompt(1, 3), salt_of("salt-a"))
    engine.run(prompt(1, 3), salt_of("salt-b"))  # same tokens, other salt: no hit
    snap = engine.pool.snapshot()
    assert snap.queries == {"a": 2, "b": 1}
    assert snap.queried_tokens == {"a": 2 * (3 * BLOCK + 1), "b": 3 * BLOCK + 1}
    assert snap.hit_tokens == {"a": 3 * BLOCK, "b": 0}
    assert snap.hit_blocks == {"a": 3, "b": 0}
    families = {f.name: f for f in build_metric_families(snap)}
    resident = {s.labels["tenant"]: s.value for s in families[TENANT_RESIDENT_BLOCKS].samples}
    assert resident["a"] == 3 and resident["b"] == 3 and resident[UNATTRIBUTED] == 0
    quota = {s.labels["tenant"]: s.value for s in families[TENANT_QUOTA_BLOCKS].samples}
    assert quota["a"] == 16
    hits = {s.labels["tenant"]: s.value for s in families[PREFIX_HIT_TOKENS.removesuffix("_total")].samples}
    assert hits["a"] == 3 * BLOCK
    assert PREFIX_QUERIED_TOKENS.removesuffix("_total") in families
    assert EVICTIONS.removesuffix("_total") in families


# ----------------------------------------------------------------------------------------- reload
def write_config(tmp: Path, table: TenantTable) -> PluginSettings:
    (tmp / "tenants.json").write_text(dump_json(table))
    (tmp / "keys.json").write_text(json.dumps(KEYS.model_dump(mode="json")))
    return PluginSettings(tmp / "tenants.json", tmp / "keys.json", POOL, metrics_port=0)


def test_reload_changes_limits_and_keeps_accounting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = write_config(tmp_path, table_of(tenant("a", 8), tenant("b", 8)))
    source = TenantSource(settings, capacity=16)
    engine = build_engine(lambda _capacity: source.load(), 17, monkeypatch)
    engine.pool._source = source  # reload as the engine's pool does (it reads the env otherwise)
    engine.run(prompt(1, 3), salt_of("salt-a"))
    assert source.poll(0.0) is None  # unchanged
    # b leaves the table, a's quota drops; a garbage write in between keeps the old table in force
    (tmp_path / "tenants.json").write_text("{not json")
    engine.clock.now = 2.0
    engine.run(prompt(2, 1), salt_of("salt-b"))
    assert source.reloads == {"ok": 0, "error": 1}
    assert engine.pool.policy.usage("b").entries == 1
    (tmp_path / "tenants.json").write_text(dump_json(table_of(tenant("a", 1))))
    engine.clock.now = 4.0
    engine.run(prompt(3, 1), salt_of("salt-a"))
    assert source.reloads == {"ok": 1, "error": 1}
    assert engine.pool.policy.limits("a").quota == 1
    assert engine.pool.policy.limits("b").quota == 0  # gone from the table: default (unattributed) limits
    assert engine.pool.policy.usage("a").entries == 4 and engine.pool.policy.usage("b").entries == 1
    check_invariants(engine)


def test_poll_is_rate_limited(tmp_path: Path) -> None:
    settings = write_config(tmp_path, table_of(tenant("a", 8)))
    source = TenantSource(settings, capacity=16)
    source.load()
    assert source.poll(10.0) is None
    (tmp_path / "tenants.json").write_text(dump_json(table_of(tenant("a", 2))))
    assert source.poll(10.5) is None  # within the second: not even stat'ed
    new = source.poll(11.0)
    assert new is not None and new.limits["a"].quota == 2


@pytest.fixture
def restore_vllm_logging() -> Iterator[None]:
    """Undo a test's ``configure_logging`` (vLLM's logger state and the log record factory)."""
    vllm_logger = logging.getLogger("vllm")
    saved = (list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate)
    factory = logging.getLogRecordFactory()
    try:
        yield
    finally:
        vllm_logger.handlers[:] = saved[0]
        vllm_logger.setLevel(saved[1])
        vllm_logger.propagate = saved[2]
        logging.setLogRecordFactory(factory)


def test_a_pool_built_from_the_plugin_environment_says_so_in_vllms_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    restore_vllm_logging: None,
) -> None:
    shared = Isolation.SHARED
    tenants = (tenant("a", 8), tenant("s1", 2, isolation=shared), tenant("s2", 2, isolation=shared))
    settings = write_config(tmp_path, table_of(*tenants))
    monkeypatch.setenv("KVFLEET_TENANT_TABLE", str(settings.tenant_table))
    monkeypatch.setenv("KVFLEET_KEY_FILE", str(settings.key_file))
    monkeypatch.setenv("KVFLEET_POOL", POOL)
    monkeypatch.setenv("KVFLEET_PLUGIN_METRICS_PORT", "0")
    # vLLM's own logging set-up, as its engine-core process applies it before it builds the pool (here
    # its handler writes to the test's captured stdout).
    configure_logging(LoggingConfig(configure_logging=True, log_level="INFO"))
    pool = TenantAwareBlockPool(17, True, BLOCK)
    line = describe_installed_pool(POOL, pool.attribution, 0)
    assert "pool 'shared', 3 tenants (2 accounting tenants), 16 KV blocks" in line
    out = capsys.readouterr().out
    logged = [x for x in out.splitlines() if line in x]
    assert len(logged) == 1, out
    assert " INFO " in logged[0] and "pid=" in logged[0]  # formatted by vLLM's handler, like its own lines


def test_plugin_settings_from_env() -> None:
    assert load_plugin_settings({}) is None
    with pytest.raises(RuntimeError, match="missing"):
        load_plugin_settings({"KVFLEET_TENANT_TABLE": "/t"})
    settings = load_plugin_settings(
        {"KVFLEET_TENANT_TABLE": "t.json", "KVFLEET_KEY_FILE": "k.json", "KVFLEET_POOL": "p"}
    )
    assert settings is not None and settings.metrics_port is None and settings.metrics_host == "0.0.0.0"
    with pytest.raises(RuntimeError, match="not a port"):
        load_plugin_settings(
            {
                "KVFLEET_TENANT_TABLE": "t",
                "KVFLEET_KEY_FILE": "k",
                "KVFLEET_POOL": "p",
                "KVFLEET_PLUGIN_METRICS_PORT": "x",
            }
        )


def test_version_pin() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3+cpu")
    for bad in ("0.31.2", "0.33.0", "0.320.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.32\.x only, but vLLM {bad}"):
            check_vllm_version(bad)
