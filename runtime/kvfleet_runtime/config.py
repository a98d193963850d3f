"""The runtime configuration contract: the tenant table and the key file.

The operator renders these two documents (a ConfigMap holding the tenant table, a Secret holding the
API-key hashes and the salt key); the gateway, the engine plugin and the LMCache quota sync read them.
This module is the only place their shape is defined. Field names are snake_case on the wire (the
operator imports these models and serialises them with ``model_dump_json``).

Security contract:
  * API keys never appear here, only their SHA-256 hashes (keys are >= 256 bits of randomness, so a
    fast hash is enough; a slow KDF would only add latency to every request).
  * The cache salt a request carries into vLLM/LMCache is ``HMAC-SHA256(salt_key, salt_id)``; the
    salt key lives in the Secret, so a salt cannot be predicted from the (non-secret) tenant table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

TENANT_TABLE_FILENAME = "tenants.json"
KEY_FILE_FILENAME = "keys.json"
SCHEMA_VERSION = 1

#: The ports of an engine pod and of the gateway, defined here only: the operator's Pod, Service and
#: NetworkPolicy builders, the defaults of ``EngineSettings``/``LMCacheSettings`` below and
#: ``kvfleet engine launch`` all import them.
ENGINE_PORT = 8000  # vLLM's OpenAI server
PLUGIN_METRICS_PORT = 8001  # the pod's metrics: the plugin's, vLLM's, LMCache's, the sync's; no inference
LMCACHE_SYNC_METRICS_PORT = 8002  # the LMCache quota sync's metrics (pod loopback; re-exported on 8001)
PLUGIN_DEBUG_PORT = 8003  # the engine plugin's /debug/kv (pod loopback only)
KV_EVENTS_PORT = 5557  # vLLM's KV events (ZMQ PUB; token ids: this ModelDeployment's gateways only)
LMCACHE_PORT = 6555  # LMCache's ZMQ port, where vLLM's LMCacheMPConnector connects (pod loopback)
LMCACHE_HTTP_PORT = 6556  # LMCache's HTTP API (loopback): /healthcheck, /status, /quota, /cache, /metrics
SHARED_TIER_PORT = 6557  # the pool's shared KV tier (RESP, from the pool's engine pods only)
SHARED_TIER_METRICS_PORT = 6558  # the shared KV tier's Prometheus metrics (serves no KV)
GATEWAY_PORT = 8080  # the gateway's OpenAI endpoint
GATEWAY_METRICS_PORT = 8081  # the gateway's Prometheus metrics (serves no inference API)
EPP_PORT = 9002  # the Endpoint Picker's ext_proc gRPC port (GIE's convention)
EPP_METRICS_PORT = 9090  # the Endpoint Picker's Prometheus metrics
ENVOY_ADMIN_PORT = 9901  # Envoy's admin interface, on loopback only (/ready)
#: LMCache's default chunk, in tokens (``lmcache server --chunk-size``). LMCache stores, evicts and
#: enforces quotas in whole chunks, so "within quota" means within quota plus one chunk.
DEFAULT_LMCACHE_CHUNK_TOKENS = 256


class SlaTier(StrEnum):
    """Service tier a tenant bought. It sets scheduling priority and the eviction order on ties."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BASIC = "basic"


#: The SLA order, from the tier that gives way first to the one that gives way last: evicted first when
#: tenants tie (``kv.policy``), served last (``TIER_PRIORITY``), and the tier a group of tenants sharing a
#: cache salt takes (``kv.limits``). Every ranking of SLA tiers derives from this tuple.
SLA_ORDER: tuple[SlaTier, ...] = (SlaTier.BASIC, SlaTier.STANDARD, SlaTier.PREMIUM)
#: Rank in ``SLA_ORDER``: a higher rank keeps its KV longer and is served sooner.
SLA_RANK: dict[SlaTier, int] = {tier: rank for rank, tier in enumerate(SLA_ORDER)}
#: vLLM's ``--scheduling-policy priority`` serves lower values first (premium 0, standard 10, basic 20).
TIER_PRIORITY: dict[SlaTier, int] = {
    tier: 10 * (len(SLA_ORDER) - 1 - SLA_RANK[tier]) for tier in reversed(SLA_ORDER)
}
#: Fraction of a tier any one tenant may hold while others need room, unless the pool sets its own.
DEFAULT_BURST_CAP = 0.5


class Isolation(StrEnum):
    """How a tenant's KV cache is separated from other tenants' (see docs/security.md)."""

    SHARED = "shared"  # shares the pool salt: common prefixes are reused across shared tenants
    SALTED = "salted"  # its own cache salt on the shared pool
    DEDICATED = "dedicated"  # its own engine pods on its own GPU group


class KVTier(StrEnum):
    """Where a KV block lives."""

    HBM = "hbm"
    CPU = "cpu"
    NVME = "nvme"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


NonNegInt = Annotated[int, Field(ge=0)]
KeyHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
PosFloat = Annotated[float, Field(gt=0)]
Port = Annotated[int, Field(gt=0, lt=65536)]


class TierTTLs(_Model):
    """Idle time after which a tenant's cached KV on a tier becomes the first eviction candidate.

    The defaults are kvfleet's default TTLs (HBM 30 s, CPU 10 min, NVMe a day), defined here only.
    """

    hbm_seconds: PosFloat = 30.0
    cpu_seconds: PosFloat = 600.0
    nvme_seconds: PosFloat = 86_400.0

    def for_tier(self, tier: KVTier) -> float:
        return {KVTier.HBM: self.hbm_seconds, KVTier.CPU: self.cpu_seconds, KVTier.NVME: self.nvme_seconds}[
            tier
        ]


class KVQuota(_Model):
    """A tenant's resolved KV quota per tier, in the units each tier's host counts in.

    ``hbm_blocks`` is the guarantee (what a premium tenant reserves); ``hbm_burst_blocks`` is the most it
    may hold while others need room (the burst cap, default 50% of the pool).
    """

    hbm_blocks: NonNegInt
    hbm_burst_blocks: NonNegInt
    cpu_bytes: NonNegInt = 0
    nvme_bytes: NonNegInt = 0

    @model_validator(mode="after")
    def _burst_covers_guarantee(self) -> Self:
        if self.hbm_burst_blocks < self.hbm_blocks:
            raise ValueError(
                f"hbm_burst_blocks ({self.hbm_burst_blocks}) must be >= hbm_blocks ({self.hbm_blocks})"
            )
        return self

    def for_tier(self, tier: KVTier) -> int:
        return {KVTier.HBM: self.hbm_blocks, KVTier.CPU: self.cpu_bytes, KVTier.NVME: self.nvme_bytes}[tier]


class RateLimits(_Model):
    """Admission limits at the gateway; ``None`` means unlimited."""

    requests_per_minute: Annotated[int, Field(gt=0)] | None = None
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None
    max_concurrent: Annotated[int, Field(gt=0)] | None = None


class TenantEntry(_Model):
    """One tenant as the data plane sees it."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    tier: SlaTier
    priority: int
    isolation: Isolation
    #: Input to the salt HMAC. Salted and dedicated tenants have their own; shared tenants use the pool's.
    salt_id: Annotated[str, Field(min_length=1)]
    #: The pool (key of ``TenantTable.pools``) that serves this tenant.
    pool: Annotated[str, Field(min_length=1)]
    #: Served model names this tenant may call.
    models: Annotated[list[str], Field(min_length=1)]
    quota: KVQuota
    ttl: TierTTLs = TierTTLs()
    rate_limits: RateLimits = RateLimits()
    #: Weight in the gateway's fair queuing within the tier (``kv.fairness``); the Tenant's
    #: ``fairShareWeight``.
    fair_share_weight: PosFloat = 1.0


class LMCacheSettings(_Model):
    """The LMCache server that runs next to each engine replica (server mode, see docs/operations.md).

    ``kvfleet engine launch`` turns every field into an ``lmcache server`` flag
    (``engine.launcher.build_lmcache_args``), except ``nvme_bytes`` (see there). A pool without this
    section runs no LMCache server.
    """

    #: ``--l1-size-gb``: the CPU memory tier (L1). The launcher gives L1 at least 1/8 GiB, because an
    #: NVMe-only pool still stages chunks in L1 on their way to L2.
    cpu_bytes: Annotated[int, Field(gt=0)]
    #: Not an LMCache flag: LMCache's ``fs`` L2 adapter has no capacity setting. The volume holds this
    #: much, and the per-salt quotas (``engine.lmcache_sync``) keep the tier within it.
    nvme_bytes: NonNegInt = 0
    #: ``--l2-adapter`` ``{"type": "fs", "base_path": ...}``: the NVMe (L2) tier's directory inside the
    #: pod; ``None`` disables the tier.
    nvme_path: str | None = None
    #: ``--chunk-size``: tokens per LMCache chunk.
    chunk_size: Annotated[int, Field(gt=0)] = DEFAULT_LMCACHE_CHUNK_TOKENS
    #: The L2 adapter's ``eviction_policy``. ``IsolatedLRU`` enforces the per-salt quotas; L1 always runs
    #: LMCache's global ``LRU`` (``IsolatedLRU`` raises on L1), governed per tenant by kvfleet.
    eviction_policy: Literal["IsolatedLRU", "LRU", "ARC", "noop"] = "IsolatedLRU"
    #: ``--port``: the ZMQ port vLLM's LMCacheMPConnector talks to.
    port: Port = LMCACHE_PORT
    #: ``--http-port``: the HTTP API (quotas, clear, status, metrics).
    http_port: Port = LMCACHE_HTTP_PORT
    #: The pool's shared KV tier (``kvfleet engine shared-tier``, one per pool): an ``--l2-adapter``
    #: ``{"type": "resp", "host": ..., "port": ...}`` after the NVMe one, so every chunk this replica
    #: stores also goes there and a chunk no local tier holds is read from there. ``None``: no shared tier.
    shared_host: str | None = None
    #: The shared tier's port (``SHARED_TIER_PORT``).
    shared_port: Port = SHARED_TIER_PORT


class EngineSettings(_Model):
    """How the launcher starts vLLM for a pool. The operator renders it from the ModelDeployment.

    ``kvfleet engine launch`` turns every field into a vLLM flag (``engine.launcher.build_vllm_args``),
    except ``plugin_metrics_port``, which the engine plugin reads from this table itself.
    """

    #: ``--model``: a local path (PVC mount) or a Hugging Face id.
    model: Annotated[str, Field(min_length=1)]
    revision: str | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, Field(ge=1)] = 1
    data_parallel_size: Annotated[int, Field(ge=1)] = 1
    enable_expert_parallel: bool = False
    #: ``--max-model-len``, further capped to what the pool's KV cache holds (the launcher's
    #: ``resolve_replica``).
    max_model_len: Annotated[int, Field(gt=0)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    kv_cache_dtype: Literal["auto", "fp8_e5m2", "fp8_e4m3"] = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: Annotated[int, Field(gt=0)] | None = None
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    #: Test and CPU-demo knob: a fixed number of KV blocks instead of the pool's
    #: ``hbm_blocks_per_replica`` (which is what the operator sized and admitted quotas against).
    num_gpu_blocks_override: Annotated[int, Field(gt=0)] | None = None
    #: Appended to vLLM's command line verbatim (after every flag above).
    extra_args: list[str] = []
    #: ``--port`` of vLLM's OpenAI server.
    port: Port = ENGINE_PORT
    #: Where vLLM publishes its KV events (``--kv-events-config``, ZMQ, every interface) for the gateways'
    #: precise routing; ``None``: it publishes none.
    kv_events_port: Port | None = None
    #: Not a vLLM flag: where the engine plugin serves its per-tenant KV metrics (``plugin_config`` reads
    #: it from this table).
    plugin_metrics_port: Port = PLUGIN_METRICS_PORT
    lmcache: LMCacheSettings | None = None


class PoolEntry(_Model):
    """A set of interchangeable engine replicas."""

    name: Annotated[str, Field(min_length=1)]
    #: Base URLs of the engine replicas (``http://host:port``); the gateway health-checks each.
    endpoints: list[str] = []
    #: Base URLs of each replica's LMCache HTTP API, same order as ``endpoints``.
    lmcache_endpoints: list[str] = []
    #: Where each replica publishes its KV events (``tcp://host:port``), same order as ``endpoints``, for
    #: replicas that do not all use the gateway's ``--kv-events-port`` (engines sharing one host); empty:
    #: that flag on each replica's host.
    kv_events_endpoints: list[str] = []
    #: Tokens per KV block (vLLM's ``--block-size``).
    block_size: Annotated[int, Field(gt=0)]
    #: KV blocks per replica as the operator sized them (vLLM's ``--num-gpu-blocks-override``).
    hbm_blocks_per_replica: NonNegInt
    cpu_bytes_per_replica: NonNegInt = 0
    nvme_bytes_per_replica: NonNegInt = 0
    #: Fraction of the pool any one tenant may hold while others need room.
    burst_cap: Annotated[float, Field(gt=0, le=1)] = DEFAULT_BURST_CAP
    dedicated_to: str | None = None
    #: How replicas of this pool start vLLM (absent when engines are managed outside kvfleet).
    engine: EngineSettings | None = None


class TenantTable(_Model):
    """Everything the data plane of one ModelDeployment needs except secrets."""

    schema_version: int = SCHEMA_VERSION
    model_deployment: Annotated[str, Field(min_length=1)]
    #: The model name clients ask for (vLLM's ``--served-model-name``).
    served_model_name: Annotated[str, Field(min_length=1)]
    #: Salt id of the shared pool (input to the salt HMAC for `shared` tenants).
    pool_salt_id: Annotated[str, Field(min_length=1)]
    pools: dict[str, PoolEntry]
    tenants: dict[str, TenantEntry]

    @model_validator(mode="after")
    def _references_resolve(self) -> Self:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not supported (want {SCHEMA_VERSION})")
        for key, tenant in self.tenants.items():
            if key != tenant.name:
                raise ValueError(f"tenants[{key!r}].name is {tenant.name!r}; the key must equal the name")
            if tenant.pool not in self.pools:
                raise ValueError(
                    f"tenants[{key!r}].pool {tenant.pool!r} is not one of the pools {sorted(self.pools)}"
                )
            if tenant.isolation is Isolation.SHARED and tenant.salt_id != self.pool_salt_id:
                raise ValueError(f"tenants[{key!r}] is shared, so its salt_id must be the pool_salt_id")
        return self

    @classmethod
    def load(cls, path: Path) -> TenantTable:
        """Read and validate a tenant table file; raises ``ValueError`` with the reason on bad input."""
        return cls.model_validate_json(path.read_bytes())

    @classmethod
    def reload(cls, data: bytes, previous: LoadedTable | None) -> LoadedTable:
        """``data`` validated, reusing the entries of ``previous`` (the last table loaded) whose JSON did
        not change: a reload then validates only the tenants an edit touched, and the gateway can tell the
        unchanged ones by identity. Validation holds the GIL for as long as one call runs: the whole file at
        once (0.12 s at 10,000 tenants) would stall the event loop of the thread that serves requests; this
        decodes the JSON a tenant at a time (:func:`loads_in_steps`), compares each entry with the last and
        validates the changed ones alone, releasing the GIL every :data:`YIELD_EVERY` entries.

        The result equals ``model_validate_json(data)``: a changed entry is validated from its own JSON,
        the rest of the table too, then the table's own rules run on the whole; on any error the whole
        file is validated again, so the error is the one a full load reports."""
        if previous is None:
            table = cls.model_validate_json(data)
            return LoadedTable(table, json.loads(data)["tenants"])
        try:
            raw = loads_in_steps(data.decode(), "tenants")
        except (ValueError, UnicodeDecodeError):
            raw = None
        tenants = raw.get("tenants") if isinstance(raw, dict) else None
        if raw is None or not isinstance(tenants, dict):
            table = cls.model_validate_json(data)  # raises the file's own error
            return LoadedTable(table, json.loads(data)["tenants"])
        try:
            entries: dict[str, TenantEntry] = {}
            for i, (name, entry) in enumerate(tenants.items()):
                if i % YIELD_EVERY == 0:
                    time.sleep(0)  # let the thread that serves requests have the GIL
                old = previous.table.tenants.get(name)
                if old is not None and previous.raw_tenants.get(name) == entry:
                    entries[name] = old
                else:
                    entries[name] = TenantEntry.model_validate_json(json.dumps(entry))
            rest = cls.model_validate_json(json.dumps({**raw, "tenants": {}}))
            table = cls.model_validate({**dict(rest), "tenants": entries})
        except ValueError:
            table = cls.model_validate_json(data)  # raises the whole file's own error (or agrees)
        return LoadedTable(table, tenants)


#: Entries a reload decodes or compares between two releases of the GIL (about a millisecond's work).
YIELD_EVERY = 200
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def loads_in_steps(text: str, member: str) -> Any:
    """``json.loads(text)`` for a JSON object whose ``member`` is an object of many entries: that member is
    decoded one entry at a time, and the GIL is released every :data:`YIELD_EVERY` entries, so that a
    thread decoding a large tenant table (6.5 MB at 10,000 tenants: 30 ms in one call of ``json.loads``)
    never holds it long. Raises ``ValueError`` on what ``json.loads`` would refuse."""

    def skip(i: int) -> int:
        match = _WHITESPACE.match(text, i)
        return match.end() if match else i

    def value(_key: str, i: int) -> tuple[Any, int]:
        return _DECODER.raw_decode(text, i)

    count = 0

    def entry(key: str, i: int) -> tuple[Any, int]:
        nonlocal count
        count += 1
        if count % YIELD_EVERY == 0:
            time.sleep(0)
        return value(key, i)

    def members(i: int, each: Callable[[str, int], tuple[Any, int]]) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        i = skip(i + 1)
        if text.startswith("}", i):
            return out, i + 1
        while True:
            if not text.startswith('"', i):
                raise ValueError(f"expected a member name at character {i}")
            key, i = _DECODER.raw_decode(text, i)
            i = skip(i)
            if not text.startswith(":", i):
                raise ValueError(f"expected ':' at character {i}")
            out[key], i = each(key, skip(i + 1))
            i = skip(i)
            if text.startswith(",", i):
                i = skip(i + 1)
            elif text.startswith("}", i):
                return out, i + 1
            else:
                raise ValueError(f"expected ',' or '}}' at character {i}")

    def top(key: str, i: int) -> tuple[Any, int]:
        return members(i, entry) if key == member and text.startswith("{", i) else value(key, i)

    start = skip(0)
    if not text.startswith("{", start):
        return json.loads(text)
    result, end = members(start, top)
    if skip(end) != len(text):
        raise ValueError(f"extra data at character {skip(end)}")
    return result


class LoadedTable(NamedTuple):
    """A validated tenant table and its tenants' JSON as read (what :meth:`TenantTable.reload` compares)."""

    table: TenantTable
    raw_tenants: dict[str, Any]


class KeyFile(_Model):
    """The secret half of the runtime configuration."""

    schema_version: int = SCHEMA_VERSION
    #: Hex-encoded key for the salt HMAC (32 bytes or more).
    salt_key_hex: Annotated[str, Field(min_length=64, pattern=r"^[0-9a-f]+$")]
    #: Tenant name -> SHA-256 hex digests of its valid API keys (two during a rotation).
    key_hashes: dict[
        str, Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]], Field(max_length=2)]
    ]

    @property
    def salt_key(self) -> bytes:
        return bytes.fromhex(self.salt_key_hex)

    @classmethod
    def load(cls, path: Path) -> KeyFile:
        return cls.model_validate_json(path.read_bytes())


#: A host name a media URL may name (``parse_media_hosts``): DNS labels of letters, digits and hyphens.
_MEDIA_HOST_RE = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def url_has_credentials(url: str) -> bool:
    """Whether ``url`` (``scheme://[user:password@]host...``) carries credentials in its authority: a URL is
    shown in flags, logs and conditions, so a password must travel apart (the shared store's)."""
    return "@" in url.split("//", 1)[-1].split("/", 1)[0]


def without_credentials(url: str) -> str:
    """``url`` from its host on: what may be shown of a URL that was refused."""
    return url.rsplit("@", maxsplit=1)[-1]


def parse_media_hosts(value: str) -> tuple[str, ...]:
    """The hosts whose http(s) media URLs the gateway lets through and vLLM fetches from
    (``--allowed-media-domains`` of the gateway and of ``kvfleet engine launch``; the chart's
    ``allowedMediaHosts``), from a comma-separated list: lower-cased, sorted, without repeats (empty: none).
    Exact names: vLLM compares a URL's host with each as a whole. ``ValueError`` for anything else."""
    hosts = sorted({h.strip().lower() for h in value.split(",") if h.strip()})
    for host in hosts:
        if not _MEDIA_HOST_RE.match(host):
            raise ValueError(
                f"{host!r} is not a host name (letters, digits, hyphens and dots; no scheme, port or path)"
            )
    return tuple(hosts)


def hash_api_key(key: str) -> str:
    """The only form in which an API key is stored or compared."""
    return hashlib.sha256(key.encode()).hexdigest()


def derive_cache_salt(salt_key: bytes, salt_id: str) -> str:
    """The ``cache_salt`` for a salt id. Deterministic, so every gateway replica and engine agrees."""
    return hmac.new(salt_key, salt_id.encode(), hashlib.sha256).hexdigest()[:32]


def salt_to_tenants(table: TenantTable, keys: KeyFile) -> dict[str, list[str]]:
    """Map each cache salt in use to the tenants that send it (several for the shared pool salt)."""
    out: dict[str, list[str]] = {}
    for tenant in table.tenants.values():
        out.setdefault(derive_cache_salt(keys.salt_key, tenant.salt_id), []).append(tenant.name)
    return out


def dump_json(model: BaseModel) -> str:
    """Canonical JSON (sorted keys) so rendered ConfigMaps are byte-stable across reconciles."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, indent=2) + "\n"
