"""Keep each LMCache server's per-salt quotas in sync with the tenant table; export per-tenant tier usage.

What LMCache 0.5.6 (server mode) offers, and so what this module can govern:

* **L2 (the NVMe tier, an ``fs`` adapter with ``IsolatedLRU``)**: per-``cache_salt`` byte quotas through
  ``PUT /quota/{salt}`` ``{"limit_gb": x}`` / ``DELETE /quota/{salt}`` / ``GET /quota``. Quotas are soft:
  every ~1 s LMCache evicts a salt at or above its quota (a fraction of that salt's own LRU list, at
  least one chunk), so usage stays within quota plus what was written in one cycle. A salt with data but
  no quota is evicted completely (allowlist semantics). Usage per salt is exact (``GET /quota``).
* **L1 (the CPU tier)**: stock LMCache has one shared memory pool with global LRU, and no per-salt
  quota, TTL or per-salt delete for it (``IsolatedLRU`` cannot run on L1). kvfleet's launcher therefore
  runs the server through ``engine/lmcache_server.py``, which governs L1 per salt itself (quota, burst
  cap, CPU TTL, removal; see ``engine/l1_governance.py``) and exports exact per-salt bytes
  (``kvfleet_lmcache_l1_bytes``). Against a stock server the sync falls back to what LMCache offers:
  ``POST /cache/clear`` (all unlocked L1 objects) when a tenant is removed, and a per-salt *estimate* of
  L1 bytes from LMCache's chunk counters (``lmcache_mp_l1_write_chunks_total -
  lmcache_mp_l1_evicted_chunks_total``).

Decisions:

* Shared tenants send one salt; its NVMe quota is the **sum** of their quotas (each tenant brought its
  entitlement to a jointly used cache; max would let the group hold less than any two members
  bought) and its TTL the **max** of theirs (data one member still uses must not expire because
  another member's TTL is shorter): the group rules of ``kv.limits``. Usage of a shared salt is
  attributed to its tenants in equal parts, so per-tenant series add up to the true total.
* TTL expiry is done here because LMCache has none: the granularity is the **salt** (tenant), not the
  chunk. A salt is active when any of LMCache's per-salt counters moves (lookups, L1 writes/reads, L2
  stores) or its L2 usage changes; when it has been idle longer than its NVMe TTL, its quota is set to
  0 so LMCache drops all of its L2 data within a cycle, and the quota comes back on its next activity.
  CPU-tier TTLs are enforced per chunk by the governed L1 (see above), not by the sync.

Pure core: ``compute_salt_quotas``, ``compute_sync_plan``, ``parse_quota_listing``,
``parse_lmcache_metrics``, ``compute_tenant_usage``. Thin shell: ``LMCacheClient`` (aiohttp) and
``run_lmcache_sync`` (the loop; the tenant table and key file come from the runtime's one watcher,
``config_watch.RuntimeConfigWatcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvfleet_runtime.config import KeyFile, KVTier, TenantTable, derive_cache_salt
from kvfleet_runtime.config_watch import RuntimeConfigWatcher
from kvfleet_runtime.kv.limits import group_by_salt_id, group_quota, group_ttl

log = logging.getLogger(__name__)

GIB = 1 << 30
#: LMCache's URL stand-in for the empty (unsalted) cache salt.
DEFAULT_SALT_SENTINEL = "_default"
#: Series of kvfleet's governed L1 (``engine/lmcache_server.py``), labelled by ``cache_salt`` like LMCache's.
L1_GOVERNANCE_PREFIX = "kvfleet_lmcache_l1_"
#: Exact bytes per salt in a governed L1; its presence tells the sync the server governs L1 itself.
L1_GOVERNED_BYTES = "kvfleet_lmcache_l1_bytes"
#: The memory tier a tenant's bytes are on (``cpu``, ``nvme``: ``config.KVTier``). Never plain ``tier``:
#: the gateway's series carry the tenant's SLA tier as ``sla_tier``.
KV_TIER_LABEL = "kv_tier"
#: Per-salt counters that move whenever a salt's KV is looked up, written or read.
ACTIVITY_COUNTERS = (
    "lmcache_mp_lookup_requested_tokens_total",
    "lmcache_mp_l1_write_chunks_total",
    "lmcache_mp_l1_read_chunks_total",
    "lmcache_mp_l2_store_submitted_objects_chunks_total",
)


@dataclass(frozen=True)
class SaltQuota:
    """What one cache salt may keep in LMCache, and whose it is."""

    salt: str
    tenants: tuple[str, ...]
    nvme_bytes: int
    cpu_bytes: int
    nvme_ttl_seconds: float
    cpu_ttl_seconds: float
    #: Each tenant's own quotas (for the per-tenant quota metric).
    tenant_nvme_bytes: Mapping[str, int] = field(default_factory=dict)
    tenant_cpu_bytes: Mapping[str, int] = field(default_factory=dict)


def compute_salt_quotas(table: TenantTable, keys: KeyFile, pool: str | None = None) -> dict[str, SaltQuota]:
    """Desired LMCache quota per salt for the tenants served by ``pool`` (all pools when ``None``).

    Shared tenants collapse onto the pool salt: NVMe/CPU quotas are summed, TTLs take the max.
    """
    out: dict[str, SaltQuota] = {}
    for salt_id, tenants in group_by_salt_id(table, pool).items():
        salt = derive_cache_salt(keys.salt_key, salt_id)
        out[salt] = SaltQuota(
            salt=salt,
            tenants=tuple(t.name for t in tenants),
            nvme_bytes=group_quota(tenants, KVTier.NVME),
            cpu_bytes=group_quota(tenants, KVTier.CPU),
            nvme_ttl_seconds=group_ttl(tenants, KVTier.NVME),
            cpu_ttl_seconds=group_ttl(tenants, KVTier.CPU),
            tenant_nvme_bytes={t.name: t.quota.nvme_bytes for t in tenants},
            tenant_cpu_bytes={t.name: t.quota.cpu_bytes for t in tenants},
        )
    return out


def bytes_to_limit_gb(n_bytes: int) -> float:
    """The ``limit_gb`` LMCache expects (it multiplies by 2**30 and truncates: round up to stay >= n)."""
    gb = n_bytes / GIB
    while int(gb * GIB) < n_bytes:
        gb = math.nextafter(gb, math.inf)
    return gb


@dataclass(frozen=True)
class QuotaState:
    """One salt as ``GET /quota`` reports it."""

    limit_bytes: int
    usage_bytes: int


def parse_quota_listing(body: Mapping[str, Any]) -> dict[str, QuotaState]:
    """``GET /quota`` -> salt -> QuotaState (bytes; LMCache reports GiB floats)."""
    out: dict[str, QuotaState] = {}
    for url_salt, entry in dict(body.get("users", {})).items():
        salt = "" if url_salt == DEFAULT_SALT_SENTINEL else url_salt
        out[salt] = QuotaState(
            limit_bytes=round(float(entry.get("limit_gb", 0.0)) * GIB),
            usage_bytes=round(float(entry.get("current_usage_gb", 0.0)) * GIB),
        )
    return out


@dataclass
class SaltActivity:
    """What the loop last saw of a salt, to tell activity from idleness."""

    last_active: float
    fingerprint: tuple[float, ...] = ()
    expired: bool = False


@dataclass(frozen=True)
class SyncPlan:
    """What to do on one LMCache endpoint in one cycle."""

    #: salt -> limit in bytes (PUT /quota).
    put: Mapping[str, int]
    #: Salts whose quota must go (DELETE /quota): their L2 data is evicted by allowlist.
    delete: tuple[str, ...]
    #: True when a salt disappeared: its L1 (CPU) data can only be dropped by clearing L1.
    clear_l1: bool
    #: Salts that just passed their NVMe TTL (for the expiry counter).
    expired_now: tuple[str, ...] = ()


def compute_sync_plan(
    desired: Mapping[str, SaltQuota],
    current: Mapping[str, QuotaState],
    activity: Mapping[str, SaltActivity],
    now: float,
    *,
    known_salts: Iterable[str] = (),
) -> SyncPlan:
    """Bring ``current`` (the server's quotas) to ``desired``, honouring NVMe TTLs.

    ``activity`` is updated by the caller (``observe_activity``) before planning. ``known_salts`` are
    salts this sync ever managed (so a salt removed from the table while the server forgot its quota
    still triggers the L1 clear once).
    """
    put: dict[str, int] = {}
    expired_now: list[str] = []
    for salt, quota in desired.items():
        act = activity.get(salt)
        idle_for = now - act.last_active if act is not None else 0.0
        target = quota.nvme_bytes
        if idle_for > quota.nvme_ttl_seconds:
            target = 0
            if act is not None and not act.expired:
                expired_now.append(salt)
        state = current.get(salt)
        # LMCache stores limit_gb as a float; allow a byte of rounding before re-sending.
        if state is None or abs(state.limit_bytes - target) > 1:
            put[salt] = target
    removed = sorted(s for s in current if s not in desired)
    gone = set(removed) | {s for s in known_salts if s not in desired}
    return SyncPlan(put=put, delete=tuple(removed), clear_l1=bool(gone), expired_now=tuple(expired_now))


def parse_lmcache_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> metric name -> cache_salt -> value (summed over other labels).

    Only series with a ``cache_salt`` label are kept; unlabelled totals are under salt ``"*"``.
    """
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, brace, labels = head.partition("{")
        if not name.startswith(("lmcache_mp_", L1_GOVERNANCE_PREFIX)):
            continue
        salt = "*"
        if brace:
            for part in labels.rstrip("}").split(","):
                key, _, raw = part.partition("=")
                if key.strip() == "cache_salt":
                    salt = raw.strip().strip('"')
        try:
            number = float(value)
        except ValueError:
            continue
        per_salt = out.setdefault(name, {})
        per_salt[salt] = per_salt.get(salt, 0.0) + number
    return out


def observe_activity(
    activity: dict[str, SaltActivity],
    salts: Iterable[str],
    metrics: Mapping[str, Mapping[str, float]],
    usage: Mapping[str, QuotaState],
    now: float,
) -> None:
    """Mark salts whose counters or L2 usage moved since the last cycle as active at ``now``."""
    for salt in salts:
        fp = tuple(metrics.get(name, {}).get(salt, 0.0) for name in ACTIVITY_COUNTERS)
        state = usage.get(salt)
        fp += (float(state.usage_bytes) if state else 0.0,)
        act = activity.get(salt)
        if act is None:
            activity[salt] = SaltActivity(last_active=now, fingerprint=fp)
        elif fp != act.fingerprint:
            # A salt that was just emptied by expiry changes its usage to 0: that is not activity.
            emptied = act.expired and fp[:-1] == act.fingerprint[:-1]
            act.fingerprint = fp
            if not emptied:
                act.last_active = now
                act.expired = False


def compute_l1_bytes_by_salt(
    metrics: Mapping[str, Mapping[str, float]], baseline: Mapping[str, float]
) -> dict[str, int]:
    """Each salt's bytes in L1 (CPU): exact from a governed L1 (``kvfleet_lmcache_l1_bytes``); otherwise
    an estimate, resident chunks x average chunk size.

    Resident chunks = writes - evictions - ``baseline`` (what was resident when L1 was last cleared;
    a clear is not counted as eviction). Average chunk size = L1 bytes in use / resident chunks.
    """
    if L1_GOVERNED_BYTES in metrics:
        return {salt: round(n) for salt, n in metrics[L1_GOVERNED_BYTES].items() if salt != "*"}
    writes = metrics.get("lmcache_mp_l1_write_chunks_total", {})
    evicted = metrics.get("lmcache_mp_l1_evicted_chunks_total", {})
    resident = {
        salt: max(0.0, w - evicted.get(salt, 0.0) - baseline.get(salt, 0.0))
        for salt, w in writes.items()
        if salt != "*"
    }
    used = sum(metrics.get("lmcache_mp_l1_memory_usage_bytes", {}).values())
    total = sum(resident.values())
    if total <= 0 or used <= 0:
        return {salt: 0 for salt in resident}
    per_chunk = used / total
    return {salt: round(n * per_chunk) for salt, n in resident.items()}


def compute_l1_baseline(metrics: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Per-salt ``writes - evictions`` at the moment L1 is cleared (see ``compute_l1_bytes_by_salt``)."""
    writes = metrics.get("lmcache_mp_l1_write_chunks_total", {})
    evicted = metrics.get("lmcache_mp_l1_evicted_chunks_total", {})
    return {salt: w - evicted.get(salt, 0.0) for salt, w in writes.items() if salt != "*"}


def compute_tenant_usage(
    desired: Mapping[str, SaltQuota], bytes_by_salt: Mapping[str, int]
) -> dict[str, int]:
    """Attribute each salt's bytes to its tenants in equal parts (integers that add up to the total)."""
    out: dict[str, int] = {}
    for salt, quota in desired.items():
        total = int(bytes_by_salt.get(salt, 0))
        n = len(quota.tenants)
        for i, tenant in enumerate(quota.tenants):
            out[tenant] = total // n + (1 if i < total % n else 0)
    return out


# ---------------------------------------------------------------------------------------------------
# Thin shell: HTTP client, metrics, the loop.
# ---------------------------------------------------------------------------------------------------


class LMCacheClient:
    """The few LMCache HTTP calls the sync needs (one aiohttp session per endpoint)."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    @staticmethod
    def _url_salt(salt: str) -> str:
        return DEFAULT_SALT_SENTINEL if salt == "" else salt

    async def list_quotas(self) -> dict[str, QuotaState]:
        async with self._session.get(self.base_url + "/quota") as resp:
            resp.raise_for_status()
            return parse_quota_listing(await resp.json())

    async def put_quota(self, salt: str, limit_bytes: int) -> None:
        body = {"limit_gb": bytes_to_limit_gb(limit_bytes)}
        async with self._session.put(f"{self.base_url}/quota/{self._url_salt(salt)}", json=body) as resp:
            resp.raise_for_status()

    async def delete_quota(self, salt: str) -> None:
        async with self._session.delete(f"{self.base_url}/quota/{self._url_salt(salt)}") as resp:
            resp.raise_for_status()

    async def clear_l1(self) -> None:
        async with self._session.post(
            self.base_url + "/cache/clear", json={"tier": "l1", "force": False}
        ) as resp:
            resp.raise_for_status()

    async def metrics_text(self) -> str:
        async with self._session.get(self.base_url + "/metrics") as resp:
            resp.raise_for_status()
            return await resp.text()

    async def close(self) -> None:
        await self._session.close()


class LMCacheSyncMetrics:
    """Prometheus series the sync exports (own registry, so tests and several syncs do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["endpoint", "tenant", KV_TIER_LABEL]
        self.tenant_bytes = Gauge(
            "kvfleet_lmcache_tenant_bytes",
            "Bytes of a tenant's KV in LMCache per tier (nvme exact; cpu estimated from chunk counters; "
            "a shared salt's bytes are split equally among its tenants).",
            labels,
            registry=self.registry,
        )
        self.quota_bytes = Gauge(
            "kvfleet_lmcache_quota_bytes",
            "A tenant's LMCache quota per tier from the tenant table (nvme is enforced by LMCache).",
            labels,
            registry=self.registry,
        )
        self.ttl_expirations = Counter(
            "kvfleet_lmcache_ttl_expirations_total",
            "Times a tenant's data on a tier was dropped for being idle past its TTL.",
            labels,
            registry=self.registry,
        )
        self.removals = Counter(
            "kvfleet_lmcache_salt_removals_total",
            "Salts removed from an LMCache endpoint (quota deleted and L1 cleared).",
            ["endpoint"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvfleet_lmcache_sync_errors_total",
            "Sync cycles that failed for an endpoint.",
            ["endpoint"],
            registry=self.registry,
        )
        self.last_success = Gauge(
            "kvfleet_lmcache_sync_last_success_timestamp_seconds",
            "Unix time of the last successful sync of an endpoint.",
            ["endpoint"],
            registry=self.registry,
        )


@dataclass
class EndpointState:
    """What the loop remembers about one LMCache endpoint between cycles."""

    client: LMCacheClient
    activity: dict[str, SaltActivity] = field(default_factory=dict)
    known_salts: set[str] = field(default_factory=set)
    l1_baseline: dict[str, float] = field(default_factory=dict)


async def apply_lmcache_sync(
    state: EndpointState,
    desired: Mapping[str, SaltQuota],
    metrics: LMCacheSyncMetrics | None = None,
    now: float | None = None,
) -> SyncPlan:
    """One cycle on one endpoint: observe, plan, apply, export. Returns the plan that was applied."""
    now = time.monotonic() if now is None else now
    client = state.client
    current = await client.list_quotas()
    parsed = parse_lmcache_metrics(await client.metrics_text())
    observe_activity(state.activity, desired, parsed, current, now)
    plan = compute_sync_plan(desired, current, state.activity, now, known_salts=state.known_salts)
    for salt, limit in plan.put.items():
        await client.put_quota(salt, limit)
    for salt in plan.delete:
        await client.delete_quota(salt)
    # A stock L1 cannot drop one salt: clear it all. A governed L1 drops the removed salt's objects itself
    # (and only those) on its next cycle.
    clear_l1 = plan.clear_l1 and L1_GOVERNED_BYTES not in parsed
    if clear_l1:
        await client.clear_l1()
        state.l1_baseline = compute_l1_baseline(parsed)
    for salt in plan.expired_now:
        state.activity[salt].expired = True
    for salt in set(state.known_salts) - set(desired):
        state.activity.pop(salt, None)
    state.known_salts = set(desired)
    if metrics is not None:
        _export(metrics, client.base_url, desired, current, parsed, state, plan, cleared_l1=clear_l1)
    return plan


def _export(
    m: LMCacheSyncMetrics,
    endpoint: str,
    desired: Mapping[str, SaltQuota],
    current: Mapping[str, QuotaState],
    parsed: Mapping[str, Mapping[str, float]],
    state: EndpointState,
    plan: SyncPlan,
    *,
    cleared_l1: bool,
) -> None:
    nvme = compute_tenant_usage(desired, {s: q.usage_bytes for s, q in current.items()})
    l1 = {} if cleared_l1 else compute_l1_bytes_by_salt(parsed, state.l1_baseline)
    cpu = compute_tenant_usage(desired, l1)
    # Series of removed tenants must disappear, not freeze at their last value.
    m.tenant_bytes.clear()
    m.quota_bytes.clear()
    for quota in desired.values():
        for tenant in quota.tenants:
            m.tenant_bytes.labels(endpoint, tenant, KVTier.NVME).set(nvme.get(tenant, 0))
            m.tenant_bytes.labels(endpoint, tenant, KVTier.CPU).set(cpu.get(tenant, 0))
            m.quota_bytes.labels(endpoint, tenant, KVTier.NVME).set(quota.tenant_nvme_bytes.get(tenant, 0))
            m.quota_bytes.labels(endpoint, tenant, KVTier.CPU).set(quota.tenant_cpu_bytes.get(tenant, 0))
        if quota.salt in plan.expired_now:
            for tenant in quota.tenants:
                m.ttl_expirations.labels(endpoint, tenant, KVTier.NVME).inc()
    if plan.delete or plan.clear_l1:
        m.removals.labels(endpoint).inc(max(1, len(plan.delete)))
    m.last_success.labels(endpoint).set(time.time())


def endpoints_for(table: TenantTable, pool: str | None) -> list[str]:
    """LMCache endpoints of ``pool`` (of every pool when ``None``) from the tenant table."""
    pools = [table.pools[pool]] if pool is not None else list(table.pools.values())
    return [url for p in pools for url in p.lmcache_endpoints]


async def run_lmcache_sync(
    watcher: RuntimeConfigWatcher,
    *,
    pool: str | None,
    endpoints: Sequence[str] = (),
    interval_s: float = 2.0,
    metrics: LMCacheSyncMetrics | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """The loop: every ``interval_s`` re-read the config if it changed (``watcher``; the last good pair
    stays in force) and sync every endpoint.

    ``endpoints`` overrides the pool's ``lmcache_endpoints``. Errors on one endpoint are counted and
    logged; the others keep syncing. Dedicated tenants only ever reach their own pool's LMCache, so a
    sync per pool (``pool``) is the normal deployment.
    """
    stop = stop or asyncio.Event()
    states: dict[str, EndpointState] = {}
    try:
        while not stop.is_set():
            await watcher.poll_async()
            if (config := watcher.current) is not None:
                desired = compute_salt_quotas(config.table, config.keys, pool)
                urls = list(endpoints) or endpoints_for(config.table, pool)
                for url in urls:
                    state = states.get(url)
                    if state is None:
                        state = states[url] = EndpointState(LMCacheClient(url))
                    try:
                        await apply_lmcache_sync(state, desired, metrics)
                    except Exception as exc:  # noqa: BLE001 - one bad endpoint must not stop the others
                        log.warning("lmcache sync of %s failed: %s", url, exc)
                        if metrics is not None:
                            metrics.errors.labels(url).inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
    finally:
        for state in states.values():
            await state.client.close()


__all__ = [
    "KV_TIER_LABEL",
    "EndpointState",
    "LMCacheClient",
    "LMCacheSyncMetrics",
    "QuotaState",
    "SaltQuota",
    "SyncPlan",
    "apply_lmcache_sync",
    "bytes_to_limit_gb",
    "compute_salt_quotas",
    "compute_sync_plan",
    "parse_lmcache_metrics",
    "parse_quota_listing",
    "run_lmcache_sync",
]
