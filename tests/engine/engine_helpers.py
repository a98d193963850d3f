"""Prompts and tenant tables shared by the engine tests."""

from __future__ import annotations

import random

from kvfleet_runtime.config import (
    DEFAULT_LMCACHE_CHUNK_TOKENS,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
)

#: Tokens per vLLM block in every engine test (CPU needs a multiple of 32).
BLOCK = 32
#: The tiny model's KV bytes per token (2 layers x K,V x 2 KV heads x 32 dims x 2 bytes).
KV_BYTES_PER_TOKEN = 512
#: Every engine test's LMCache runs with the default chunk (the fixture's ``chunk_size``).
LMCACHE_CHUNK_TOKENS = DEFAULT_LMCACHE_CHUNK_TOKENS
LMCACHE_CHUNK_BYTES = LMCACHE_CHUNK_TOKENS * KV_BYTES_PER_TOKEN
SALT_KEY_HEX = "ab" * 32

_WORDS = (
    "tenant",
    "cache",
    "prompt",
    "system",
    "user",
    "model",
    "token",
    "block",
    "prefix",
    "request",
    "quota",
    "memory",
    "tier",
    "engine",
    "gateway",
    "policy",
    "eviction",
    "premium",
    "standard",
    "basic",
    "shared",
    "salted",
    "dedicated",
    "report",
    "result",
    "value",
)


def make_prompt(seed: int, n_words: int = 700) -> str:
    """A deterministic prompt of ~2 tokens per word; different seeds share no prefix."""
    rng = random.Random(seed)
    return f"Document {seed}: " + " ".join(
        f"{rng.choice(_WORDS)}{rng.randint(0, 99)}" for _ in range(n_words)
    )


def tenant(
    name: str,
    *,
    isolation: Isolation = Isolation.SALTED,
    nvme_bytes: int = 0,
    nvme_ttl: float = 86_400.0,
    cpu_bytes: int = 1 << 20,
    cpu_ttl: float = 600.0,
) -> TenantEntry:
    return TenantEntry(
        name=name,
        tier=SlaTier.STANDARD,
        priority=10,
        isolation=isolation,
        salt_id="pool" if isolation is Isolation.SHARED else f"salt-{name}",
        pool="shared",
        models=["tiny"],
        quota=KVQuota(hbm_blocks=8, hbm_burst_blocks=32, cpu_bytes=cpu_bytes, nvme_bytes=nvme_bytes),
        ttl=TierTTLs(cpu_seconds=cpu_ttl, nvme_seconds=nvme_ttl),
    )


def table(*tenants: TenantEntry, lmcache_endpoints: list[str] | None = None) -> TenantTable:
    return TenantTable(
        model_deployment="ns/tiny",
        served_model_name="tiny",
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared",
                block_size=BLOCK,
                hbm_blocks_per_replica=64,
                lmcache_endpoints=lmcache_endpoints or [],
                cpu_bytes_per_replica=1 << 28,
                nvme_bytes_per_replica=1 << 30,
            )
        },
        tenants={t.name: t for t in tenants},
    )


def keys(*names: str) -> KeyFile:
    return KeyFile(salt_key_hex=SALT_KEY_HEX, key_hashes={n: [] for n in names})
