"""Per-tenant KV quotas on the real LMCache server, with real vLLM-CPU connected through LMCacheMPConnector.

vLLM runs with a 64-block KV cache (2,016 tokens), so two ~1,400-token filler prompts push a tenant's
blocks out of vLLM and its next request can only get cached tokens from LMCache. Quotas are applied by
the real sync code (``apply_lmcache_sync``), not by raw HTTP calls.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_helpers import LMCACHE_CHUNK_BYTES, SALT_KEY_HEX, keys, make_prompt, table, tenant

from engine_fixtures import LMCacheServer, VllmServer, http_json
from kvfleet_runtime.config import derive_cache_salt, dump_json
from kvfleet_runtime.engine.lmcache_sync import (
    EndpointState,
    LMCacheClient,
    LMCacheSyncMetrics,
    SyncPlan,
    apply_lmcache_sync,
    compute_salt_quotas,
)

_seeds = itertools.count(5000)
SALT_KEY = bytes.fromhex(SALT_KEY_HEX)


def salt_of(name: str) -> str:
    return derive_cache_salt(SALT_KEY, f"salt-{name}")


@dataclass
class Stack:
    lmcache: LMCacheServer
    vllm: VllmServer
    state: EndpointState
    metrics: LMCacheSyncMetrics

    def sync(self, *tenants_: object) -> SyncPlan:
        tbl = table(*tenants_)  # type: ignore[arg-type]
        desired = compute_salt_quotas(tbl, keys(*tbl.tenants), "shared")

        async def once() -> SyncPlan:
            self.state.client = LMCacheClient(self.lmcache.http_url)
            try:
                return await apply_lmcache_sync(self.state, desired, self.metrics)
            finally:
                await self.state.client.close()

        return asyncio.run(once())

    def usage(self, salt: str) -> int:
        body = http_json("GET", f"{self.lmcache.http_url}/quota/{salt}")
        return round(body["current_usage_gb"] * (1 << 30))

    def cached(self, prompt: str, salt: str) -> tuple[int, int]:
        usage = self.vllm.complete(prompt, cache_salt=salt)["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def flush_vllm(self) -> None:
        """Push every earlier block out of vLLM's 64-block cache with unsalted filler prompts."""
        for _ in range(2):
            self.vllm.complete(make_prompt(next(_seeds)), cache_salt="filler")


@pytest.fixture(scope="module")
def stack(
    lmcache_factory: Callable[..., LMCacheServer], vllm_factory: Callable[..., VllmServer]
) -> Iterator[Stack]:
    lmc = lmcache_factory(cpu_size_gb=0.25, nvme=True)
    vllm = vllm_factory(num_gpu_blocks_override=64, lmcache=lmc)
    yield Stack(lmc, vllm, EndpointState(client=None), LMCacheSyncMetrics())  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def test_tenant_bytes_stay_within_quota_plus_one_chunk(stack: Stack) -> None:
    quota = 3 * LMCACHE_CHUNK_BYTES
    plan = stack.sync(tenant("qa", nvme_bytes=quota))
    assert salt_of("qa") in plan.put
    salt = salt_of("qa")
    # Four distinct ~1,400-token prompts: 20 chunks offered against a 3-chunk quota.
    for _ in range(4):
        stack.cached(make_prompt(next(_seeds)), salt)
    assert wait_until(lambda: stack.usage(salt) <= quota + LMCACHE_CHUNK_BYTES)
    # Settled, not a lucky sample: stays bounded over several eviction cycles, and is not empty.
    for _ in range(4):
        time.sleep(0.5)
        assert 0 < stack.usage(salt) <= quota + LMCACHE_CHUNK_BYTES
    stack.sync(tenant("qa", nvme_bytes=quota))
    sample = stack.metrics.registry.get_sample_value(
        "kvfleet_lmcache_tenant_bytes",
        {"endpoint": stack.lmcache.http_url, "tenant": "qa", "kv_tier": "nvme"},
    )
    assert sample is not None and 0 < sample <= quota + LMCACHE_CHUNK_BYTES
    # The CPU tier is not quota-bound (L1 is one shared LRU pool): its per-tenant figure is an estimate
    # from LMCache's per-salt chunk counters, and all 20 chunks fit in the 0.25 GiB L1.
    cpu = stack.metrics.registry.get_sample_value(
        "kvfleet_lmcache_tenant_bytes", {"endpoint": stack.lmcache.http_url, "tenant": "qa", "kv_tier": "cpu"}
    )
    assert cpu is not None and cpu >= 10 * LMCACHE_CHUNK_BYTES


def test_salts_never_read_each_others_kv(stack: Stack) -> None:
    big = 64 * LMCACHE_CHUNK_BYTES
    stack.sync(tenant("ia", nvme_bytes=big), tenant("ib", nvme_bytes=big))
    prompt = make_prompt(next(_seeds))
    n, first = stack.cached(prompt, salt_of("ia"))
    assert first == 0
    stack.flush_vllm()
    # Same prompt, other tenant: LMCache holds it for "ia" only.
    _, other = stack.cached(prompt, salt_of("ib"))
    assert other == 0
    stack.flush_vllm()
    external_before = stack.vllm.metric_value("vllm:external_prefix_cache_hits_total")
    _, own = stack.cached(prompt, salt_of("ia"))
    assert own >= 5 * 256, "the owner gets its chunks back from LMCache after vLLM evicted them"
    assert stack.vllm.metric_value("vllm:external_prefix_cache_hits_total") - external_before >= own - n % 256


def test_removed_tenant_data_is_gone_from_every_tier(stack: Stack) -> None:
    big = 64 * LMCACHE_CHUNK_BYTES
    keep, gone = tenant("rk", nvme_bytes=big), tenant("rg", nvme_bytes=big)
    stack.sync(keep, gone)
    prompt_gone, prompt_keep = make_prompt(next(_seeds)), make_prompt(next(_seeds))
    stack.cached(prompt_gone, salt_of("rg"))
    stack.cached(prompt_keep, salt_of("rk"))
    assert wait_until(lambda: stack.usage(salt_of("rg")) > 0), "the tenant's data reached the NVMe tier"
    stack.flush_vllm()
    _, before = stack.cached(prompt_gone, salt_of("rg"))
    assert before > 0, "control: while the tenant exists LMCache serves its KV"

    plan = stack.sync(keep)
    assert plan.delete == (salt_of("rg"),)
    assert plan.clear_l1
    assert wait_until(lambda: stack.usage(salt_of("rg")) == 0)
    stack.flush_vllm()
    _, after = stack.cached(prompt_gone, salt_of("rg"))
    assert after == 0, "nothing of the removed tenant is left in L1 (CPU) or L2 (NVMe)"
    # The remaining tenant keeps its NVMe data (L1 was cleared, L2 was not).
    stack.flush_vllm()
    _, kept = stack.cached(prompt_keep, salt_of("rk"))
    assert kept > 0


def test_nvme_ttl_expiry_drops_an_idle_tenant_and_rearms_on_activity(stack: Stack) -> None:
    """The NVMe TTL is enforced per salt by the sync (LMCache has no TTL): idle past it -> quota 0."""
    big = 64 * LMCACHE_CHUNK_BYTES
    idle, busy = tenant("ti", nvme_bytes=big, nvme_ttl=3.0), tenant("tb", nvme_bytes=big, nvme_ttl=3.0)
    stack.sync(idle, busy)
    stack.cached(make_prompt(next(_seeds)), salt_of("ti"))
    stack.cached(make_prompt(next(_seeds)), salt_of("tb"))
    assert wait_until(lambda: stack.usage(salt_of("ti")) > 0 and stack.usage(salt_of("tb")) > 0)
    stack.sync(idle, busy)  # both seen active now
    time.sleep(2.0)
    stack.cached(make_prompt(next(_seeds)), salt_of("tb"))  # only "tb" stays active
    time.sleep(1.5)
    plan = stack.sync(idle, busy)
    assert plan.expired_now == (salt_of("ti"),)
    assert plan.put == {salt_of("ti"): 0}
    assert wait_until(lambda: stack.usage(salt_of("ti")) == 0)
    assert stack.usage(salt_of("tb")) > 0
    # Activity re-arms the quota: new data is kept again.
    stack.cached(make_prompt(next(_seeds)), salt_of("ti"))
    plan = stack.sync(idle, busy)
    assert plan.put == {salt_of("ti"): big}


def test_sync_cli_once_applies_the_table(stack: Stack, tmp_path: Path) -> None:
    tbl = table(tenant("cli", nvme_bytes=4 * LMCACHE_CHUNK_BYTES), lmcache_endpoints=[stack.lmcache.http_url])
    (tmp_path / "tenants.json").write_text(dump_json(tbl))
    (tmp_path / "keys.json").write_text(dump_json(keys("cli")))
    files = ["--config", str(tmp_path / "tenants.json"), "--keys", str(tmp_path / "keys.json")]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfleet_runtime",
            "engine",
            "lmcache-sync",
            "--once",
            "--pool",
            "shared",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    listed = http_json("GET", stack.lmcache.http_url + "/quota")["users"]
    assert set(listed) == {salt_of("cli")}
    assert round(listed[salt_of("cli")]["limit_gb"] * (1 << 30)) == 4 * LMCACHE_CHUNK_BYTES
