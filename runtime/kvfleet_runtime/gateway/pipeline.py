"""The request pipeline every front door runs, stage by stage, in this order:

1. ``authenticate``: the ``Authorization`` header names exactly one tenant (401/400/403 otherwise), before
   any of the body is read.
2. ``open``: the tenant's gate and policy; the request rate has room (429), and the body is reserved in
   the memory budget per tenant and per process as it arrives (``BodyReservation``; 429/503). The front
   door reads the body, bounded in size (413) and time (408).
3. ``parse``: decode, validate, check the model, bound the cost and rewrite (server-side ``cache_salt``,
   the tenant's priority, client fields stripped): ``rewrite.prepare_request``, inline for small bodies
   and in a worker process for large ones (400/403).
4. ``admit``: the tenant's budget (tokens per minute, concurrency, KV) and then the pool's fair queue
   (strict priority between tiers, VTC within one); a bounded wait, or a 429 with ``Retry-After``.
5. ``plan_route`` and ``pick``: the replica by prefix affinity, scoped by the salt, within the load
   bound; with the engines' KV events (``--kv-events-port``), another one under that bound holding a
   longer cached prefix of the tenant's own blocks (``kv_events``, ``kv_index``,
   ``kv.placement.select_precise``) (503 when none is healthy).
6. forward: the front door's own (the aiohttp gateway's client in ``server.py``, Envoy for the Endpoint
   Picker in ``epp.py``).
7. ``account``: the engine's ``usage`` settles the token estimate and the tenant's fair-queuing counter and
   is counted (``finish`` ends the request: its slot released, its outcome and duration counted).

A stage that refuses raises ``refusals.Refusal``; ``refused`` counts it (the front door answers it). The
pipeline also owns what the stages read: the tenant table (reloaded when its files change), one gate per
tenant, one router and one fair queue per pool, and the engines' health (active checks every
``health_interval_s``; a replica whose answer failed is suspected until one passes).

Nothing here logs a prompt, a completion, a key or a header value; errors are logged by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfleet_runtime.config import SLA_ORDER, SLA_RANK
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.admission import (
    BodyBudget,
    BodyBudgetExceeded,
    BodyReservation,
    BudgetLimits,
    EngineQueue,
    EngineRequest,
    GateLimits,
    GateSlot,
    RequestTooLarge,
    TenantGate,
    Throttled,
)
from kvfleet_runtime.gateway.kv_events import KvEventFeeds, pool_event_addresses, tokenize
from kvfleet_runtime.gateway.kv_index import chain_keys
from kvfleet_runtime.gateway.metrics import GatewayMetrics, RequestSeries
from kvfleet_runtime.gateway.refusals import (
    AMBIGUOUS_KEY,
    BAD_REQUEST,
    BODY_TOO_LARGE,
    GATEWAY_BUSY,
    MALFORMED_KEY,
    NO_HEALTHY_REPLICA,
    UNAUTHENTICATED,
    Refusal,
    RefusalKind,
    refusal_of,
    refusal_of_throttle,
)
from kvfleet_runtime.gateway.rewrite import (
    UPSTREAM_SESSION_HEADERS,
    BadRequest,
    Endpoint,
    PreparedRequest,
    RequestPolicy,
    extract_usage,
    prepare_request,
)
from kvfleet_runtime.gateway.routing import PoolRouter, ReplicaState, build_pool_router
from kvfleet_runtime.gateway.settings import GatewaySettings
from kvfleet_runtime.gateway.shared_store import SharedLimits, settings_from_env
from kvfleet_runtime.gateway.state import AuthFailure, GatewaySnapshot, SnapshotReloader, TenantRuntime
from kvfleet_runtime.kv.fairness import TokenCost
from kvfleet_runtime.kv.placement import select_precise

log = logging.getLogger("kvfleet.gateway")

#: Health checks in a row that must time out before a replica that was healthy is marked unhealthy.
PROBE_TIMEOUTS_TO_FAIL = 3
#: How much lower the parse workers' CPU priority is than the event loop's.
PARSE_WORKER_NICENESS = 10

_WRONG_KEY = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
#: Per way authentication fails, the refusal.
_AUTH_REFUSALS: dict[AuthFailure, tuple[RefusalKind, str]] = {
    AuthFailure.MISSING: (UNAUTHENTICATED, _WRONG_KEY),
    AuthFailure.UNKNOWN: (UNAUTHENTICATED, _WRONG_KEY),
    AuthFailure.MALFORMED: (MALFORMED_KEY, "the Authorization header is not valid UTF-8"),
    AuthFailure.AMBIGUOUS: (
        AMBIGUOUS_KEY,
        "this API key is not assigned to exactly one tenant, so it is refused; ask your administrator "
        "for a new key",
    ),
}


@dataclass(slots=True)
class OpenRequest:
    """A tenant's request past ``open``: what the later stages read. ``reservation`` holds its body's
    bytes in the memory budget until ``release`` (once the body has been handed on, or refused)."""

    tenant: TenantRuntime
    gate: TenantGate
    policy: RequestPolicy
    reservation: BodyReservation
    arrived: float


@dataclass(slots=True)
class AdmittedRequest:
    """A request past ``admit``: it holds a slot in its tenant's gate (and on its pool's engines) until
    ``Pipeline.finish``."""

    tenant: TenantRuntime
    gate: TenantGate
    prepared: PreparedRequest
    slot: GateSlot
    series: RequestSeries
    arrived: float
    #: What the KV index knows of the request's prefix (``Pipeline.plan_route``); ``None``: affinity.
    route: RoutePlan | None = None


@dataclass(slots=True)
class RoutePlan:
    """A request's block keys and how many leading blocks each replica holds; ``pick`` fills in the
    replica it chose by them and how many blocks it expects cached there."""

    keys: list[int]
    depths: dict[str, int]
    block_size: int
    replica: str | None = None
    predicted_blocks: int = 0


class UsageTracker:
    """Accumulates what the answer reports, to count tokens and reconcile the token estimate."""

    __slots__ = ("cached", "completion", "prompt", "seen")

    def __init__(self) -> None:
        self.seen = False
        self.prompt = 0
        self.completion = 0
        self.cached = 0

    def take(self, payload: Any) -> None:
        usage = extract_usage(payload)
        if usage is not None:
            self.seen = True
            self.prompt, self.completion, self.cached = usage


class Pipeline:
    """The tenancy every front door enforces: the stages above and the state they read."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.snapshot: GatewaySnapshot | None = None
        self.gates: dict[str, TenantGate] = {}
        self.policies: dict[str, RequestPolicy] = {}
        self.routers: dict[str, PoolRouter] = {}
        self.engine_queues: dict[str, EngineQueue] = {}
        #: The client the health checks use (and the aiohttp front door forwards with).
        self.session: aiohttp.ClientSession | None = None
        self.watcher = SnapshotReloader(
            settings.config_path,
            settings.keys_path,
            on_change=self.apply_snapshot,
            on_failure=lambda which: self.metrics.reload_failures.labels(which).inc(),
            interval_s=settings.reload_interval_s,
        )
        self.body_budget = BodyBudget(settings.total_body_bytes, settings.tenant_body_bytes)
        self._parse_pool: ProcessPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._health_wakeup = asyncio.Event()
        #: Health checks in a row that timed out, by (pool, replica URL).
        self._probe_timeouts: dict[tuple[str, str], int] = {}
        #: The rate limits' split with the other gateway replicas (``--shared-store``); ``None``: 1/N each.
        self.shared_limits: SharedLimits | None = None
        if settings.shared_store_url is not None:
            self.shared_limits = SharedLimits(
                settings_from_env(
                    settings.shared_store_url, settings.shared_store_ca, settings.shared_store_sync_s
                ),
                gates=lambda: self.gates,
                engine_queues=lambda: self.engine_queues,
                scope=lambda: self.snapshot.table.model_deployment if self.snapshot else "-",
                metrics=self.metrics,
            )
            self.metrics.shared_store_up.set_function(self.shared_limits.is_up)
            self.metrics.shared_store_replicas.set_function(lambda: float(self._shared_replicas()))
        #: The engines' KV events and the index they feed (``--kv-events-port``, or the table's
        #: ``kv_events_endpoints``); ``None`` until some replica publishes any: affinity only.
        self.kv_feeds: KvEventFeeds | None = None

    def _shared_replicas(self) -> int:
        return self.shared_limits.replicas_seen if self.shared_limits is not None else 0

    # -- configuration ------------------------------------------------------------------------------
    def apply_snapshot(self, snapshot: GatewaySnapshot) -> None:
        """Swap in a new configuration; in-flight requests keep the objects they already hold. It runs on
        the event loop, so it touches only what changed: a tenant the reload kept (the same
        ``TenantRuntime``, ``build_snapshot``) keeps its policy and gate as they are."""
        routers = {
            name: build_pool_router(name, pool.endpoints, self.routers.get(name))
            for name, pool in snapshot.table.pools.items()
        }
        before = self.snapshot.tenants if self.snapshot is not None else {}
        policies: dict[str, RequestPolicy] = {}
        for name, tenant in snapshot.tenants.items():
            policy = self.policies.get(name)
            if before.get(name) is tenant and policy is not None and name in self.gates:
                policies[name] = policy
                continue
            limits = self._limits_for(tenant)
            gate = self.gates.get(name)
            if gate is None:
                demand = self.shared_limits.demand_recorder(name) if self.shared_limits else None
                self.gates[name] = TenantGate(limits, demand=demand)
            else:
                gate.update_limits(limits)
            policies[name] = self._policy_for(tenant, limits)
        self.routers = routers
        self._follow_kv_events(snapshot)
        self._update_engine_queues(snapshot, before)
        self.policies = policies
        self.snapshot = snapshot
        self.metrics.set_model_deployment(snapshot.table.model_deployment)
        for name in set(self.gates) - set(snapshot.tenants):
            # Its keys are already gone; a gate with requests still in flight goes when the last ends.
            self._forget_gate_if_removed(name, self.gates[name])
        self.metrics.reloads.inc()
        self._health_wakeup.set()
        log.info(
            "configuration loaded: %d tenants, %d pools", len(snapshot.tenants), len(snapshot.table.pools)
        )

    def _follow_kv_events(self, snapshot: GatewaySnapshot) -> None:
        """Follow the KV events of every replica that publishes them (precise routing)."""
        port = self.settings.kv_events_port
        addresses = {
            name: pool_event_addresses(pool.endpoints, pool.kv_events_endpoints, port)
            for name, pool in snapshot.table.pools.items()
        }
        if self.kv_feeds is None and any(addresses.values()):
            self.kv_feeds = KvEventFeeds(self.metrics, self.settings.kv_index_ttl_s)
            if self._tasks:  # started already: a reload brought the first publisher
                self._tasks.append(asyncio.create_task(self.kv_feeds.expire_loop(), name="kvfleet-kv-expiry"))
        if self.kv_feeds is not None:
            self.kv_feeds.sync(addresses)

    def _update_engine_queues(
        self, snapshot: GatewaySnapshot, before: Mapping[str, TenantRuntime] | None = None
    ) -> None:
        """One ``EngineQueue`` per pool, its limit scaled to the pool's replicas; counters survive reloads.
        A tenant of ``before`` (the snapshot replaced) that the reload kept, on the same queue, keeps its
        counter's reading as it is."""
        per_replica = self.settings.engine_in_flight_per_replica
        cost = TokenCost(self.settings.fair_input_weight, self.settings.fair_output_weight)
        previous = self.engine_queues
        before = before or {}
        queues: dict[str, EngineQueue] = {}
        for name, pool in snapshot.table.pools.items():
            limit = per_replica * max(1, len(pool.endpoints)) if per_replica > 0 else None
            queue = self.engine_queues.get(name) or EngineQueue(limit, self.settings.fair_queuing, cost)
            queue.set_limit(limit)
            queues[name] = queue
            for tier in SLA_ORDER:
                depth = self.metrics.engine_queue_depth.labels(name, tier.value)
                depth.set_function(functools.partial(queue.fair.waiting, SLA_RANK[tier]))
        self.engine_queues = queues
        for tenant in snapshot.tenants.values():
            queue = queues[tenant.pool.name]
            if before.get(tenant.name) is tenant and previous.get(tenant.pool.name) is queue:
                continue
            label = self.metrics.tenant_label(tenant.name)
            if label != m.OTHER_TENANTS:
                counter = self.metrics.fair_virtual_tokens.labels(label)
                counter.set_function(functools.partial(queue.fair.counter, tenant.name))

    def _limits_for(self, tenant: TenantRuntime) -> GateLimits:
        rl = tenant.entry.rate_limits
        return GateLimits(
            requests_per_minute=rl.requests_per_minute,
            tokens_per_minute=rl.tokens_per_minute,
            max_concurrent=rl.max_concurrent,
            kv_budget_tokens=tenant.kv_budget_tokens,
            max_queue=self.settings.max_queue,
            max_queue_wait_s=self.settings.max_queue_wait_s,
            replicas=self.settings.replicas,
        )

    def _policy_for(self, tenant: TenantRuntime, limits: GateLimits) -> RequestPolicy:
        return RequestPolicy(
            tenant=tenant.name,
            cache_salt=tenant.cache_salt,
            priority=tenant.entry.priority,
            models=tenant.models,
            affinity_chars=self.settings.affinity_prefix_chars,
            media_domains=self.settings.allowed_media_domains,
            budget=BudgetLimits(
                kv_burst_blocks=tenant.kv_burst_blocks,
                block_size=tenant.pool.block_size,
                tokens_per_minute=limits.tokens_share,
                max_model_len=tenant.max_model_len,
                default_max_tokens=self.settings.default_max_tokens,
            ),
        )

    def _forget_gate_if_removed(self, name: str, gate: TenantGate) -> None:
        """Drop the gate of a tenant a reload removed once its last in-flight request has finished."""
        snapshot = self.snapshot
        removed = snapshot is not None and name not in snapshot.tenants
        if removed and gate.in_flight == 0 and gate.queued == 0 and self.gates.get(name) is gate:
            del self.gates[name]

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the tenant table, open the engines' client, check every replica once, and keep both
        current (the table's files watched, the replicas checked) until ``stop``."""
        self.apply_snapshot(await asyncio.to_thread(self.watcher.load_initial))
        connector = aiohttp.TCPConnector(
            limit=self.settings.upstream_connections,
            limit_per_host=0,
            # Below uvicorn's (vLLM's server) 5 s keep-alive, so the gateway closes idle connections first
            # (a pooled connection the engine has closed would fail the request: it is never re-sent).
            keepalive_timeout=4.0,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.settings.connect_timeout_s,
                sock_read=self.settings.upstream_read_timeout_s,
            ),
            auto_decompress=False,
            headers=UPSTREAM_SESSION_HEADERS,
        )
        await self.check_health_once()
        self._tasks = [
            asyncio.create_task(self.watcher.run(), name="kvfleet-config-watcher"),
            asyncio.create_task(self._health_loop(), name="kvfleet-health"),
        ]
        if self.shared_limits is not None:
            await self.shared_limits.sync_once()
            self._tasks.append(asyncio.create_task(self.shared_limits.run(), name="kvfleet-shared-store"))
        if self.kv_feeds is not None:
            self._tasks.append(asyncio.create_task(self.kv_feeds.expire_loop(), name="kvfleet-kv-expiry"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.shared_limits is not None:
            await self.shared_limits.close()
        if self.kv_feeds is not None:
            await self.kv_feeds.close()
        if self.session is not None:
            await self.session.close()
        if self._parse_pool is not None:
            pool, self._parse_pool = self._parse_pool, None
            await asyncio.to_thread(pool.shutdown, True, cancel_futures=True)

    def _pool(self) -> ProcessPoolExecutor:
        if self._parse_pool is None:
            # spawn: the gateway has threads (to_thread, the resolver), which fork would copy mid-lock.
            # The workers run at a lower CPU priority (nice 10): when parsing competes with the event
            # loop for a CPU, the loop, which serves every tenant, wins.
            self._parse_pool = ProcessPoolExecutor(
                self.settings.parse_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=os.nice,
                initargs=(PARSE_WORKER_NICENESS,),
            )
        return self._parse_pool

    async def warm_parse_workers(self) -> None:
        """Start the parse workers now rather than on the first large body."""
        if self.settings.parse_workers > 0:
            pool = self._pool()
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(loop.run_in_executor(pool, os.getpid) for _ in range(self.settings.parse_workers))
            )

    def readiness(self) -> tuple[bool, str]:
        if self.snapshot is None:
            return False, "no valid tenant table loaded"
        for router in self.routers.values():
            if router.healthy:
                return True, "ready"
        return False, "no healthy engine replica in any pool"

    # -- health -------------------------------------------------------------------------------------
    async def _probe(self, pool: str, replica: ReplicaState) -> None:
        """One health check. A refused connection or an answer other than 200 marks the replica unhealthy
        at once; a check that times out only on the ``PROBE_TIMEOUTS_TO_FAIL``-th in a row (Kubernetes'
        failureThreshold): under CPU saturation a healthy engine, or this gateway's own event loop, can
        be slower than the timeout, and a pool whose only replica is dropped answers every tenant 503."""
        assert self.session is not None
        key = (pool, replica.url)
        try:
            async with self.session.get(
                replica.url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout_s),
            ) as resp:
                await resp.read()
                healthy = resp.status == 200
                replica.last_error = "" if healthy else f"health check answered {resp.status}"
            self._probe_timeouts.pop(key, None)
        except TimeoutError:
            timeouts = self._probe_timeouts[key] = self._probe_timeouts.get(key, 0) + 1
            healthy = replica.healthy and timeouts < PROBE_TIMEOUTS_TO_FAIL
            replica.last_error = f"health check timed out ({timeouts} in a row)"
        except (aiohttp.ClientError, OSError) as exc:
            self._probe_timeouts.pop(key, None)
            healthy = False
            replica.last_error = f"health check failed: {type(exc).__name__}"
        if healthy != replica.healthy or not replica.checked:
            log.info("replica %s of pool %s is %s", replica.url, pool, "healthy" if healthy else "unhealthy")
        replica.healthy = healthy
        replica.checked = True
        self.metrics.replica_healthy.labels(pool, replica.url).set(1 if healthy else 0)

    async def check_health_once(self) -> None:
        probes = [
            self._probe(name, r) for name, router in self.routers.items() for r in router.replicas.values()
        ]
        if probes:
            await asyncio.gather(*probes)

    async def _health_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.health_interval_s):
                    await self._health_wakeup.wait()
            self._health_wakeup.clear()
            await self.check_health_once()

    def mark_down(self, pool: str, replica: ReplicaState, why: str) -> None:
        """A replica that refused a connection: down at once (nothing was sent to it)."""
        replica.healthy = False
        replica.last_error = why
        self.metrics.replica_healthy.labels(pool, replica.url).set(0)

    def suspect(self, pool: str, replica: ReplicaState, why: str) -> None:
        """Passive health: a replica that broke or timed out an answer takes no new requests until a
        health check passes again; one is run at once, so a replica that is fine is back within a probe."""
        if replica.healthy:
            log.warning("replica %s of pool %s marked unhealthy: %s", replica.url, pool, why)
        self.mark_down(pool, replica, why)
        self._health_wakeup.set()

    # -- 1. authenticate ----------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> TenantRuntime:
        """The tenant the ``Authorization`` header's key belongs to; a ``Refusal`` (counted) otherwise."""
        snapshot = self.snapshot
        found = AuthFailure.UNKNOWN if snapshot is None else snapshot.authenticate(authorization)
        if isinstance(found, TenantRuntime):
            return found
        refusal = Refusal(*_AUTH_REFUSALS[found])
        self.refused(refusal, None, m.UNKNOWN_MODEL)
        raise refusal

    # -- 2. open ------------------------------------------------------------------------------------
    def open(self, tenant: TenantRuntime, arrived: float) -> OpenRequest:
        """The tenant's request begins: its gate and policy, its request rate checked (before the body:
        a tenant over its rate costs no read or parse), an empty body reservation. Refusals are counted;
        after this, the caller releases the reservation and counts its refusals with ``refused``."""
        gate = self.gates.get(tenant.name)
        policy = self.policies.get(tenant.name)
        if gate is None or policy is None:  # removed by a reload between auth and here
            refusal = Refusal(UNAUTHENTICATED, "this API key is no longer valid")
            self.refused(refusal, tenant, m.UNKNOWN_MODEL)
            raise refusal
        try:
            gate.check_request_rate()
        except Throttled as exc:
            refusal = refusal_of_throttle(exc)
            self.refused(refusal, tenant, m.UNKNOWN_MODEL)
            raise refusal from None
        return OpenRequest(tenant, gate, policy, self.body_budget.reserve(tenant.name, 0), arrived)

    def body_too_large(self) -> Refusal:
        return Refusal(BODY_TOO_LARGE, f"request body larger than {self.settings.max_body_bytes} bytes")

    def hold_body(self, request: OpenRequest, amount: int) -> None:
        """Reserve ``amount`` more bytes of body in the memory budget (``Refusal`` when there is no room:
        the tenant's share is a 429, the process's a 503)."""
        try:
            request.reservation.grow(amount)
        except BodyBudgetExceeded as exc:
            if exc.scope == "tenant":
                raise refusal_of_throttle(Throttled("body_bytes", 1.0, exc.message)) from None
            raise Refusal(GATEWAY_BUSY, exc.message + "; retry shortly") from None

    @staticmethod
    def check_body_complete(size: int, length: int | None) -> None:
        """``Refusal(BAD_REQUEST)`` for a body read that is empty or shorter than its ``Content-Length``."""
        if not size:
            raise Refusal(BAD_REQUEST, "the request body is empty; send a JSON object")
        if length is not None and size != length:
            raise Refusal(BAD_REQUEST, f"the request body ended after {size} of its {length} bytes")

    # -- 3. parse, bound and rewrite -----------------------------------------------------------------
    async def parse(
        self, request: OpenRequest, raw: bytes | bytearray, endpoint: Endpoint
    ) -> PreparedRequest:
        """``prepare_request`` inline for small bodies, in a worker process for large ones."""
        policy = request.policy
        try:
            if len(raw) <= self.settings.inline_parse_bytes or self.settings.parse_workers <= 0:
                return prepare_request(raw, endpoint, policy)
            pool = self._pool()
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    pool, prepare_request, raw, endpoint, policy
                )
            except BrokenProcessPool:
                log.error("a body-parsing worker died; starting new ones")
                if self._parse_pool is pool:
                    self._parse_pool = None
                    pool.shutdown(wait=False, cancel_futures=True)
                raise Refusal(GATEWAY_BUSY, "the gateway could not parse the request; retry") from None
        except (BadRequest, RequestTooLarge) as exc:
            raise refusal_of(exc) from None

    # -- 4. admit: budget, then the pool's fair queue --------------------------------------------------
    async def admit(self, request: OpenRequest, prepared: PreparedRequest) -> AdmittedRequest:
        """A slot in the tenant's gate and on its pool's engines (a bounded wait), or a counted 429."""
        tenant, gate = request.tenant, request.gate
        budget = prepared.budget
        series = self.metrics.series(tenant.name, prepared.model, tenant.tier)
        engine = EngineRequest(
            self.engine_queues[tenant.pool.name],
            tenant.name,
            tenant.rank,
            tenant.entry.fair_share_weight,
            budget.prompt_tokens,
        )
        try:
            slot = await gate.acquire(budget.token_estimate, budget.kv_tokens, engine)
        except Throttled as exc:
            self._forget_gate_if_removed(tenant.name, gate)
            refusal = refusal_of_throttle(exc)
            self.refused(refusal, tenant, prepared.model)
            raise refusal from None
        series.queue_time.observe(slot.queued_s)
        series.in_flight.inc()
        series.kv_in_flight.set(gate.kv_in_flight)
        return AdmittedRequest(tenant, gate, prepared, slot, series, request.arrived)

    # -- 5. pick ------------------------------------------------------------------------------------
    async def plan_route(self, admitted: AdmittedRequest) -> None:
        """Precise routing's part, before ``pick``: when the index holds blocks of this tenant's salt in
        a pool of two replicas or more, the engine tokenizes the request and the index says how many
        leading blocks each healthy replica holds (``admitted.route``). Anything short of that leaves
        the request to affinity; nothing here refuses it."""
        feeds, tenant = self.kv_feeds, admitted.tenant
        router = self.routers.get(tenant.pool.name)
        if feeds is None or router is None or len(router.replicas) < 2 or self.session is None:
            return
        index = feeds.indexes.get(tenant.pool.name)
        healthy = router.healthy
        if index is None or not healthy or not index.knows(tenant.cache_salt):
            return
        # Any healthy replica tokenizes alike (one model, one template): the least loaded.
        loads = router.loads()
        asked = min(sorted(healthy), key=lambda url: loads.get(url, 0))
        timeout = self.settings.tokenize_timeout_s
        tokens = await tokenize(self.session, asked, admitted.prepared.payload, timeout)
        if tokens is None:
            return
        block_size = tenant.pool.block_size
        # vLLM computes a prompt's last token whatever it holds: a hit is at most len - 1 tokens.
        keys = chain_keys(tenant.cache_salt, tokens[:-1], block_size)
        admitted.route = RoutePlan(keys, index.match(keys, healthy), block_size)

    def pick(self, admitted: AdmittedRequest, tried: set[str], slow: int = 0) -> ReplicaState:
        """The replica for the request's salted prefix by affinity within the load bound, or another under
        that bound holding a longer cached prefix of it (``plan_route``; ``select_precise``), not one of
        ``tried``; ``Refusal(NO_HEALTHY_REPLICA)`` when there is none (``slow``: of the tried, how many
        did not accept within the connect timeout, for the message)."""
        tenant = admitted.tenant
        pool = tenant.pool.name
        router = self.routers.get(pool)
        plan = admitted.route
        key = (tenant.cache_salt + "\x00" + admitted.prepared.affinity_text).encode()
        if router is not None and plan is not None and plan.depths and len(router.replicas) > 1:
            url, indexed = select_precise(
                router.ring,
                key,
                plan.depths,
                healthy=router.healthy,
                loads=router.loads(),
                exclude=tried,
                load_factor=self.settings.load_factor,
            )
            if url is not None:
                plan.replica, plan.predicted_blocks = (url, plan.depths[url]) if indexed else (None, 0)
                self.metrics.route_decisions.labels(pool, "precise" if indexed else "affinity").inc()
                return router.replicas[url]
        replica = router.choose(key, tried, self.settings.load_factor) if router else None
        if replica is not None:
            if plan is not None:
                plan.replica, plan.predicted_blocks = None, 0
            if self.kv_feeds is not None:
                self.metrics.route_decisions.labels(pool, "affinity").inc()
            return replica
        pool = tenant.pool.name
        reason = (
            f"no healthy engine replica in pool {pool!r}"
            if not tried
            else f"no replica of pool {pool!r} could be connected to ({len(tried) - slow} refused or "
            f"unreachable, {slow} did not accept within {self.settings.connect_timeout_s:g} s)"
        )
        raise Refusal(NO_HEALTHY_REPLICA, reason)

    # -- 7. account ---------------------------------------------------------------------------------
    def account(self, admitted: AdmittedRequest, usage: UsageTracker, outcome: str) -> None:
        """What the engine reported settles the estimate and the fair-queuing counter, and is counted; a
        request no engine ran (refused by it, or sent to none) is settled at nothing."""
        if usage.seen:
            self._check_prediction(admitted, usage.cached)
            admitted.slot.settle_usage(usage.prompt, usage.completion)
            series = admitted.series
            series.prompt_tokens.inc(usage.prompt)
            series.completion_tokens.inc(usage.completion)
            series.cached_prompt_tokens.inc(usage.cached)
        elif outcome in ("client_error", "unavailable"):
            admitted.slot.settle_usage(0, 0)

    def _check_prediction(self, admitted: AdmittedRequest, cached_tokens: int) -> None:
        """A precise decision against what the engine then reported cached: counted (the dashboards
        compare the two), and blocks the index expected but the engine did not have are dropped."""
        plan = admitted.route
        if plan is None or plan.replica is None or self.kv_feeds is None:
            return
        pool = admitted.tenant.pool.name
        self.metrics.route_predicted_cached.labels(pool).inc(plan.predicted_blocks * plan.block_size)
        self.metrics.route_reported_cached.labels(pool).inc(cached_tokens)
        cached_blocks = cached_tokens // plan.block_size
        index = self.kv_feeds.indexes.get(pool)
        if cached_blocks < plan.predicted_blocks and index is not None:
            dropped = index.correct(plan.replica, plan.keys[: plan.predicted_blocks], cached_blocks)
            if dropped:
                self.metrics.kv_index_resets.labels(pool, "corrected").inc(dropped)

    def finish(self, admitted: AdmittedRequest, outcome: str) -> None:
        """The request is over: its slot released, its outcome and duration counted."""
        admitted.slot.release()
        series = admitted.series
        series.in_flight.dec()
        series.kv_in_flight.set(admitted.gate.kv_in_flight)
        series.outcomes[outcome].inc()
        series.duration.observe(time.perf_counter() - admitted.arrived)
        self._forget_gate_if_removed(admitted.tenant.name, admitted.gate)

    # -- refusals -----------------------------------------------------------------------------------
    def refused(self, refusal: Refusal, tenant: TenantRuntime | None, model: str) -> None:
        """Count a refusal before admission: a limit's under ``throttled_total``, the rest under
        ``rejected_total`` and ``requests_total`` (``tenant`` None: no key matched)."""
        kind = refusal.kind
        refusal.counted = True
        if tenant is None:
            self.metrics.count_rejected(m.UNAUTHENTICATED, kind.reason)
            self.metrics.count_request(m.UNAUTHENTICATED, model, m.NO_TIER, kind.outcome)
        elif kind.throttle:
            self.metrics.count_throttled(tenant.name, model, tenant.tier, refusal.code)
        else:
            self.metrics.count_rejected(tenant.name, kind.reason)
            self.metrics.count_request(tenant.name, model, tenant.tier, kind.outcome)

    def unavailable(self, admitted: AdmittedRequest, refusal: Refusal) -> None:
        """Count an admitted request that no engine could be sent (its outcome is ``unavailable``)."""
        self.metrics.count_rejected(admitted.tenant.name, refusal.kind.reason)

    def limit_headers(self, tenant: TenantRuntime) -> dict[str, str]:
        """``x-ratelimit-*`` for the tenant, as OpenAI sends them on every answer."""
        gate = self.gates.get(tenant.name)
        return gate.rate_limit_headers() if gate is not None else {}


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Group a byte stream into complete SSE events (each ending with a blank line). An event the stream
    ends in the middle of is dropped, as the SSE standard says: forwarded, it reached the client as a
    complete event holding half a JSON object."""
    splitter = SseSplitter()
    async for chunk in chunks:
        events = splitter.feed(chunk)
        if events is not None:
            yield events


class SseSplitter:
    """``sse_events`` one chunk at a time (for a front door that is handed chunks, not a stream)."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> list[bytes] | None:
        """The events ``chunk`` completes (None while none is complete)."""
        buffer = self.buffer + chunk
        if b"\n\n" not in buffer and b"\r\n\r\n" not in buffer:
            self.buffer = buffer
            return None
        parts = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        self.buffer = parts.pop()
        return [p + b"\n\n" for p in parts if p.strip()]


def event_json(event: bytes) -> Any:
    """The JSON of an SSE event's ``data:`` line (None for ``[DONE]`` or what is not JSON)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                try:
                    return json.loads(data)
                except ValueError:
                    return None
    return None


def is_done_event(event: bytes) -> bool:
    return event.startswith(b"data: [DONE]") or event.startswith(b"data:[DONE]")
