"""The gateway replicas' shared store: Redis (or Valkey, which speaks the same protocol), through which
they split each tenant's rate limits by where its traffic lands (``gateway.shares`` holds the rules).

Every ``sync_interval_s`` a replica runs one script on the store (one round trip, atomic there): it
writes its tenants' decayed demand under its own replica id, stamps the id with the store's clock, drops
the ids not stamped for ``replica_ttl_s`` (a replica that died), and reads back every live replica's
demand. From that it sets each tenant gate's fractions (``TenantGate.set_fractions``). Requests never wait
on the store: they spend the local token buckets, whose rates the sync moves.

**When the store cannot be reached** (refused, timed out, an error answer) the sync keeps trying every
interval; once no sync has succeeded for ``fallback_after_s`` (0.75 s; each try gives up after half
of it, so the fallback comes within a second of the store going away), every gate goes back to
its static ``1 / replicas`` share (``GateLimits``), ``kvfleet_gateway_shared_store_up`` reads 0 and the
log says so once. No request fails because of it: they only ever read local buckets. The first sync that
succeeds again restores the split.

Keys (one set per ModelDeployment, so several can share one store; the braces are a Redis Cluster hash tag,
which keeps a ModelDeployment's two keys in one slot): ``kvfleet:{<md>}:demand`` (hash: replica id ->
demand payload) and ``kvfleet:{<md>}:seen`` (sorted set: replica id -> the store's time of its last sync,
in ms). Both expire when no replica has synced for ten ``replica_ttl_s``.

Secured like the rest of the product: the password comes from the environment (a Secret), never from a
flag or the log; ``rediss://`` URLs use TLS, verified against ``ca_file`` when given (else the system's
CAs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from kvfleet_runtime.config import without_credentials
from kvfleet_runtime.gateway.shares import (
    FLOOR,
    Demand,
    DemandMeter,
    EngineDemand,
    ReplicaReport,
    decode_report,
    demand_fraction,
    encode_report,
    engine_split,
)

if TYPE_CHECKING:
    from kvfleet_runtime.gateway.admission import EngineQueue, TenantGate
    from kvfleet_runtime.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

#: The environment variable holding the store's password (the chart fills it from a Secret).
PASSWORD_ENV = "KVFLEET_SHARED_STORE_PASSWORD"  # noqa: S105 - the variable's name, not a password

#: KEYS: the demand hash, the seen set. ARGV: replica id, its payload, the replica TTL in ms.
#: Returns the hash's fields and values, flat, after the dead replicas are dropped.
SYNC_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
redis.call('PEXPIRE', KEYS[1], ttl * 10)
redis.call('PEXPIRE', KEYS[2], ttl * 10)
return redis.call('HGETALL', KEYS[1])
"""


@dataclass(frozen=True)
class SharedStoreSettings:
    """Where the store is and how the replicas use it."""

    url: str
    password: str | None = None
    ca_file: str | None = None
    sync_interval_s: float = 0.2
    fallback_after_s: float = 0.75
    #: A replica that has not synced for this long is dropped from the split.
    replica_ttl_s: float = 3.0
    #: The demand's time constant (``shares.DemandMeter``).
    demand_tau_s: float = 3.0
    floor: float = FLOOR

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "--shared-store wants a redis://, rediss:// (TLS) or unix:// URL, "
                f"got {without_credentials(self.url)!r}"
            )
        if not 0 < self.sync_interval_s <= self.fallback_after_s / 3:
            raise ValueError(
                f"the sync interval must be > 0 and at most a third of the fallback delay "
                f"({self.fallback_after_s:g} s), got {self.sync_interval_s:g} s"
            )
        if self.replica_ttl_s <= self.sync_interval_s:
            raise ValueError("the replica TTL must be longer than the sync interval")


def settings_from_env(
    url: str, ca_file: str | None, sync_interval_s: float, env: Mapping[str, str] = os.environ
) -> SharedStoreSettings:
    """The store's settings from the gateway's flags and the password in ``$KVFLEET_SHARED_STORE_PASSWORD``
    (from a Secret: never a flag)."""
    return SharedStoreSettings(
        url=url,
        password=env.get(PASSWORD_ENV) or None,
        ca_file=ca_file,
        sync_interval_s=sync_interval_s,
    )


def default_replica_id() -> str:
    """The pod's name (``HOSTNAME``) and a random suffix: a restarted container is a new replica."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{secrets.token_hex(3)}"


class SharedLimits:
    """Keeps this replica's gates' fractions in step with the other replicas' demand (module docstring).

    ``gates`` returns the gates to steer (tenant -> gate) and ``replicas`` the static replica count at
    each sync; ``scope`` names the ModelDeployment (the keys' hash tag)."""

    def __init__(
        self,
        settings: SharedStoreSettings,
        gates: Callable[[], Mapping[str, TenantGate]],
        scope: Callable[[], str],
        engine_queues: Callable[[], Mapping[str, EngineQueue]] = dict,
        metrics: GatewayMetrics | None = None,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id or default_replica_id()
        self.meter = DemandMeter(settings.demand_tau_s)
        self._gates = gates
        self._engine_queues = engine_queues
        self._scope = scope
        self._metrics = metrics
        self._clock = clock
        kwargs: dict[str, Any] = {
            "password": settings.password,
            "socket_timeout": settings.fallback_after_s / 2,
            "socket_connect_timeout": settings.fallback_after_s / 2,
            "decode_responses": False,
        }
        if settings.url.startswith("rediss://") and settings.ca_file:
            kwargs["ssl_ca_certs"] = settings.ca_file
        self._redis = aioredis.Redis.from_url(settings.url, **kwargs)
        self._script = self._redis.register_script(SYNC_SCRIPT)
        #: When a sync last succeeded (``None``: never, the static shares apply).
        self.last_ok: float | None = None
        #: Live replicas the last successful sync saw (this one included).
        self.replicas_seen = 0
        self.shared = False
        self._last_error: str | None = None
        #: (replica, pool, tenant) -> the weighted tokens that replica last reported serving the tenant.
        self._served_seen: dict[tuple[str, str, str], float] = {}

    def demand_recorder(self, tenant: str) -> Callable[[float, float], None]:
        """What a tenant's gate calls with each request's (requests, tokens)."""
        meter, clock = self.meter, self._clock

        def record(requests: float, tokens: float) -> None:
            meter.record(tenant, clock(), requests, tokens)

        return record

    def keys(self) -> tuple[str, str]:
        scope = self._scope()
        return f"kvfleet:{{{scope}}}:demand", f"kvfleet:{{{scope}}}:seen"

    async def sync_once(self) -> bool:
        """One round trip: publish, read, apply. False (and the static shares once the store has been
        unreachable for ``fallback_after_s``) when it failed."""
        now = self._clock()
        own = ReplicaReport(self.meter.snapshot(now), self._engine_demand())
        try:
            async with asyncio.timeout(self.settings.fallback_after_s / 2):
                flat = await self._script(
                    keys=list(self.keys()),
                    args=[self.replica_id, encode_report(own), int(self.settings.replica_ttl_s * 1000)],
                )
        except Exception as exc:  # noqa: BLE001 - any failure of the store is the same fallback
            self._failed(self._clock(), exc)
            return False
        others = self._decode_others(flat)
        self._charge_elsewhere(others)
        self._apply(own, list(others.values()))
        self.last_ok = now
        self.replicas_seen = 1 + len(others)
        if self._last_error is not None:
            log.info("shared store %s reachable again: the rate limits are split by demand", self._where())
            self._last_error = None
        self._observe("ok")
        return True

    def _engine_demand(self) -> dict[str, dict[str, EngineDemand]]:
        out: dict[str, dict[str, EngineDemand]] = {}
        for pool, queue in self._engine_queues().items():
            if queue.static_limit is None:
                continue
            fair = queue.fair
            tenants = {t: EngineDemand(rank, weight, n) for t, (rank, weight, n) in fair.demand().items()}
            for tenant, served in fair.served.items():
                now = tenants.get(tenant)
                profile = (now.rank, now.weight) if now is not None else fair.profile(tenant)
                if profile is not None:
                    tenants[tenant] = EngineDemand(*profile, now.requests if now else 0.0, served)
            out[pool] = tenants
        return out

    def _charge_elsewhere(self, others: Mapping[str, ReplicaReport]) -> None:
        """What each other replica served each tenant since the last sync, charged to the counters here;
        a replica seen for the first time sets its baseline (what it served before is old news)."""
        queues = self._engine_queues()
        for replica, report in others.items():
            for pool, tenants in report.engines.items():
                queue = queues.get(pool)
                for tenant, d in tenants.items():
                    key = (replica, pool, tenant)
                    before = self._served_seen.get(key)
                    self._served_seen[key] = d.served
                    if queue is not None and before is not None and d.served > before:
                        queue.fair.charge_elsewhere(tenant, d.served - before, d.weight)
        live = set(others)
        for key in [k for k in self._served_seen if k[0] not in live]:
            del self._served_seen[key]

    def _decode_others(self, flat: list[bytes]) -> dict[str, ReplicaReport]:
        others: dict[str, ReplicaReport] = {}
        for i in range(0, len(flat) - 1, 2):
            replica = flat[i].decode(errors="replace")
            if replica == self.replica_id:
                continue
            try:
                others[replica] = decode_report(flat[i + 1])
            except ValueError as exc:
                log.warning("shared store: replica %s published %s; left out of the split", replica, exc)
        return others

    def _apply(self, own: ReplicaReport, others: list[ReplicaReport]) -> None:
        floor = self.settings.floor
        idle = Demand()
        for tenant, gate in self._gates().items():
            mine = own.rates.get(tenant, idle)
            theirs = [o.rates.get(tenant, idle) for o in others]
            gate.set_fractions(
                (
                    demand_fraction(mine.requests, (d.requests for d in theirs), floor),
                    demand_fraction(mine.tokens, (d.tokens for d in theirs), floor),
                )
            )
        for pool, queue in self._engine_queues().items():
            if queue.static_limit is not None:
                theirs_engines = [o.engines.get(pool, {}) for o in others]
                queue.steer(*engine_split(queue.static_limit, own.engines.get(pool, {}), theirs_engines))
        self.shared = True

    def _failed(self, now: float, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._observe("error")
        if self.shared and (self.last_ok is None or now - self.last_ok >= self.settings.fallback_after_s):
            self.fall_back()
            log.warning(
                "shared store %s unreachable for %.1f s (%s): each replica enforces its static share "
                "(1/replicas) of every rate limit until it is back",
                self._where(),
                now - (self.last_ok or now),
                error,
            )
        elif self._last_error is None:
            log.warning("shared store %s: a sync failed (%s)", self._where(), error)
        self._last_error = error

    def fall_back(self) -> None:
        """Every gate back to its static share."""
        for gate in self._gates().values():
            gate.set_fractions(None)
        for queue in self._engine_queues().values():
            queue.steer(None)
        self.shared = False
        self.replicas_seen = 0

    def _observe(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.shared_store_syncs.labels(outcome).inc()

    def is_up(self) -> float:
        """1 while the rate limits are split through the store, 0 while the static shares apply."""
        return 1.0 if self.shared else 0.0

    def _where(self) -> str:
        return self.settings.url.split("@")[-1]  # never the password a URL may carry

    async def run(self) -> None:
        """Sync every interval until cancelled."""
        while True:
            started = self._clock()
            await self.sync_once()
            await asyncio.sleep(max(0.0, self.settings.sync_interval_s - (self._clock() - started)))

    async def close(self) -> None:
        """Leave the split at once (the other replicas take this one's share at their next sync), then
        close the connection."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.5):
                demand_key, seen_key = self.keys()
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.hdel(demand_key, self.replica_id)
                    pipe.zrem(seen_key, self.replica_id)
                    await pipe.execute()
        with contextlib.suppress(Exception):
            # Bounded too: a connection whose command the stopped sync task was cancelled in must not
            # hold the gateway's exit.
            async with asyncio.timeout(1.0):
                await self._redis.aclose()
