"""The gateway's HTTP shell: aiohttp server in front, pooled aiohttp client to the engines behind.

Request path (``/v1/chat/completions``, ``/v1/completions``):
  headers within the header timeout (408, connections.py) -> auth (401; 403 for a key listed by more
  than one tenant; 400 for a header that is not UTF-8), before any of the body is read (with
  ``Expect: 100-continue``, before the client sends it) -> the request rate has room (429) -> body read,
  bounded in size (413), time (408) and memory held per tenant and per process (429/503) -> decode,
  validate, model check, budget and rewrite (rewrite.prepare_request: 400/403; inline for small bodies,
  in a worker process for large ones) -> admission (429 + Retry-After, or a bounded wait) -> replica by
  prefix affinity (503 when none is healthy) -> upstream, failing over to the next replica only when the
  connection could not be established (nothing was sent; once a byte may have reached an engine the
  request is never sent again) -> answer streamed or buffered back with ``x-ratelimit-*`` headers,
  usage reconciled and counted. An engine that drops the connection before answering is a 502, one that
  sends nothing for ``upstream_read_timeout_s`` a 504; a stream that breaks ends with an OpenAI-shaped
  error event. Either way the replica takes no new request until a health check passes (active checks
  every ``health_interval_s``; one at once after a failure). SIGTERM drains (``serve``).

Every refusal on that path (the 4xx and 503s before a request is forwarded) is one kind of
``refusals.RefusalKind``: its status, OpenAI error and counted reason are in that table, and the handler
answers them all the same way (``refusal_response``). The process's settings are declared once, with their
flags, in ``settings.py``.

Metrics are served on their own port (``build_metrics_app``), never on the public one.

A client that disconnects cancels its handler (the runner is built with ``handler_cancellation``), which
closes the upstream connection, and vLLM aborts a request whose connection closed.

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
import resource
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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
from kvfleet_runtime.gateway.connections import ConnectionGuards, GuardedSite
from kvfleet_runtime.gateway.metrics import GatewayMetrics, RequestSeries
from kvfleet_runtime.gateway.refusals import (
    AMBIGUOUS_KEY,
    BODY_TIMEOUT,
    BODY_TOO_LARGE,
    GATEWAY_BUSY,
    MALFORMED_KEY,
    NO_HEALTHY_REPLICA,
    UNAUTHENTICATED,
    Refusal,
    refusal_of,
)
from kvfleet_runtime.gateway.rewrite import (
    UPSTREAM_SESSION_HEADERS,
    BadRequest,
    Endpoint,
    PreparedRequest,
    RequestPolicy,
    build_request_id,
    build_upstream_headers,
    extract_usage,
    prepare_request,
)
from kvfleet_runtime.gateway.routing import PoolRouter, ReplicaState, build_pool_router
from kvfleet_runtime.gateway.settings import GatewaySettings, per_source_connections
from kvfleet_runtime.gateway.state import AuthFailure, GatewaySnapshot, SnapshotReloader, TenantRuntime
from kvfleet_runtime.kv.fairness import TokenCost

log = logging.getLogger("kvfleet.gateway")
#: Where ``_authenticate`` leaves the tenant's name on the request (read by ``on_response_prepare``).
_TENANT_KEY: web.RequestKey[str] = web.RequestKey("kvfleet_tenant", str)

#: Health checks in a row that must time out before a replica that was healthy is marked unhealthy.
PROBE_TIMEOUTS_TO_FAIL = 3
#: After a drain: how long requests still in flight at the drain timeout get to finish being cancelled.
_CANCEL_GRACE_S = 1.0
#: How much lower the parse workers' CPU priority is than the event loop's.
PARSE_WORKER_NICENESS = 10


def error_response(
    status: int,
    message: str,
    err_type: str,
    code: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body (``{"error": {message, type, param, code}}``)."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json", headers=headers
    )


def refusal_response(refusal: Refusal, headers: dict[str, str] | None = None) -> web.Response:
    """The answer to ``refusal``: its kind's status, error body and headers, plus ``headers``."""
    kind = refusal.kind
    merged = {**dict(kind.headers), **(headers or {})}
    return error_response(
        kind.status, refusal.message, kind.err_type, kind.code, param=refusal.param, headers=merged
    )


def stream_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """The SSE event that ends a stream the engine broke: an error shaped as OpenAI's (the openai client
    raises ``APIError`` on it), and no ``[DONE]`` after it: ``[DONE]`` says the answer is complete, and a
    client that stops at it without reading what came before (or reads events by the last one) must not
    take a truncated answer for a whole one."""
    error = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


async def _nothing() -> None:
    return None


def _check_body_complete(size: int, length: int | None) -> None:
    """``BadRequest`` for a body read that is empty or shorter than its ``Content-Length``."""
    if not size:
        raise BadRequest("the request body is empty; send a JSON object")
    if length is not None and size != length:
        raise BadRequest(f"the request body ended after {size} of its {length} bytes")


class _UsageTracker:
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


class Gateway:
    """All gateway state; one per process (one per app in tests)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.snapshot: GatewaySnapshot | None = None
        self.gates: dict[str, TenantGate] = {}
        self.policies: dict[str, RequestPolicy] = {}
        self.routers: dict[str, PoolRouter] = {}
        self.engine_queues: dict[str, EngineQueue] = {}
        self.session: aiohttp.ClientSession | None = None
        self.watcher = SnapshotReloader(
            settings.config_path,
            settings.keys_path,
            on_change=self.apply_snapshot,
            on_failure=lambda which: self.metrics.reload_failures.labels(which).inc(),
            interval_s=settings.reload_interval_s,
        )
        self.body_budget = BodyBudget(settings.total_body_bytes, settings.tenant_body_bytes)
        closed = self.metrics.connections_closed
        self.guards = ConnectionGuards(
            settings.max_connections,
            settings.header_timeout_s,
            on_refused=closed.labels("over_limit").inc,
            on_header_timeout=closed.labels("header_timeout").inc,
            max_per_source=per_source_connections(settings),
            on_source_refused=closed.labels("over_source_limit").inc,
        )
        self.metrics.open_connections.set_function(lambda: self.guards.open)
        #: Where ``/metrics`` is served (set by ``running_gateway``).
        self.metrics_url = ""
        self._parse_pool: ProcessPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._health_wakeup = asyncio.Event()
        #: Set on SIGTERM (``begin_drain``): not ready, and every answer closes its connection.
        self.draining = False
        #: Completions being handled, from arrival to the last byte of a stream (what a drain waits for).
        self.proxying = 0
        #: Health checks in a row that timed out, by (pool, replica URL).
        self._probe_timeouts: dict[tuple[str, str], int] = {}
        #: Closes the public listener (set by ``running_gateway``).
        self.stop_listening: Callable[[], Awaitable[None]] = _nothing

    # -- configuration ------------------------------------------------------------------------------
    def apply_snapshot(self, snapshot: GatewaySnapshot) -> None:
        """Swap in a new configuration; in-flight requests keep the objects they already hold."""
        routers = {
            name: build_pool_router(name, pool.endpoints, self.routers.get(name))
            for name, pool in snapshot.table.pools.items()
        }
        policies: dict[str, RequestPolicy] = {}
        for name, tenant in snapshot.tenants.items():
            limits = self._limits_for(tenant)
            gate = self.gates.get(name)
            if gate is None:
                self.gates[name] = TenantGate(limits)
            else:
                gate.update_limits(limits)
            policies[name] = self._policy_for(tenant, limits)
        self.routers = routers
        self._update_engine_queues(snapshot)
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

    def _update_engine_queues(self, snapshot: GatewaySnapshot) -> None:
        """One ``EngineQueue`` per pool, its limit scaled to the pool's replicas; counters survive reloads."""
        per_replica = self.settings.engine_in_flight_per_replica
        cost = TokenCost(self.settings.fair_input_weight, self.settings.fair_output_weight)
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
            label = self.metrics.tenant_label(tenant.name)
            if label != m.OTHER_TENANTS:
                counter = self.metrics.fair_virtual_tokens.labels(label)
                queue = queues[tenant.pool.name]
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

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
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

    async def stop(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
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

    def _suspect(self, pool: str, replica: ReplicaState, why: str) -> None:
        """Passive health: a replica that broke or timed out an answer takes no new requests until a
        health check passes again; one is run at once, so a replica that is fine is back within a probe."""
        if replica.healthy:
            log.warning("replica %s of pool %s marked unhealthy: %s", replica.url, pool, why)
        replica.healthy = False
        replica.last_error = why
        self.metrics.replica_healthy.labels(pool, replica.url).set(0)
        self._health_wakeup.set()

    def begin_drain(self) -> None:
        """SIGTERM: report not ready and close every connection after its current answer."""
        self.draining = True
        self.guards.closing = True

    def requests_in_flight(self) -> int:
        """Requests being read or answered (streams until their last byte): what a drain waits for."""
        return self.guards.reading() + self.proxying

    async def wait_quiet(self, timeout_s: float, quiet_s: float = 0.25) -> bool:
        """Wait until no request has been in flight for ``quiet_s`` (True), at most ``timeout_s`` (False).

        While draining, every answer closes its connection, so a keep-alive client that sends one more
        request on its connection is told to close it; once all is quiet, what is left are connections
        nobody has used for ``quiet_s``, which the shutdown then closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        quiet_since: float | None = None
        while (now := loop.time()) < deadline:
            if self.requests_in_flight():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_s:
                return True
            await asyncio.sleep(0.05)
        return False

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: the gateway is shutting down"
        if self.snapshot is None:
            return False, "no valid tenant table loaded"
        for router in self.routers.values():
            if router.healthy:
                return True, "ready"
        return False, "no healthy engine replica in any pool"

    # -- handlers -----------------------------------------------------------------------------------
    async def handle_healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_readyz(self, _request: web.Request) -> web.Response:
        ready, reason = self.readiness()
        return web.json_response({"ready": ready, "reason": reason}, status=200 if ready else 503)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """The app's one ``on_response_prepare`` receiver: tells the connection guard the request is
        answered (``ConnectionGuards.response_prepared``) and counts every API answer by tenant and HTTP
        status (metering)."""
        self.guards.response_prepared(request, response)
        if request.path.startswith("/v1/"):
            self.metrics.count_response(request.get(_TENANT_KEY, m.UNAUTHENTICATED), response.status)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        payload = generate_latest(self.metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _authenticate(self, request: web.Request) -> TenantRuntime | web.Response:
        snapshot = self.snapshot
        if snapshot is None:
            found: TenantRuntime | AuthFailure = AuthFailure.UNKNOWN
        else:
            found = snapshot.authenticate(request.headers.get("Authorization"))
        if isinstance(found, TenantRuntime):
            request[_TENANT_KEY] = found.name  # for the responses-by-status count (``on_response_prepare``)
            return found
        refusal = _AUTH_REFUSALS[found]
        self.metrics.count_rejected(m.UNAUTHENTICATED, refusal.kind.reason)
        self.metrics.count_request(m.UNAUTHENTICATED, m.UNKNOWN_MODEL, m.NO_TIER, refusal.kind.outcome)
        return _closing(refusal_response(refusal))

    async def expect_continue(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: authenticate before telling the client to send its body."""
        refused = self._authenticate(request)
        if isinstance(refused, web.Response):
            return refused
        if request.headers.get("Expect", "").lower() != "100-continue" or request.version < (1, 1):
            return error_response(
                417, "only 'Expect: 100-continue' is supported", "invalid_request_error", "expectation_failed"
            )
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None

    async def handle_models(self, request: web.Request) -> web.Response:
        tenant = self._authenticate(request)
        if isinstance(tenant, web.Response):
            return tenant
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvfleet"}
            for model in sorted(tenant.models)
        ]
        gate = self.gates.get(tenant.name)  # x-ratelimit-* on every answer, as OpenAI sends them
        headers = gate.rate_limit_headers() if gate is not None else None
        return web.json_response({"object": "list", "data": data}, headers=headers)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        self.proxying += 1
        try:
            return await self._proxy(request, Endpoint.CHAT)
        finally:
            self.proxying -= 1

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        self.proxying += 1
        try:
            return await self._proxy(request, Endpoint.COMPLETIONS)
        finally:
            self.proxying -= 1

    def _refuse(
        self, tenant: TenantRuntime, gate: TenantGate | None, model: str, refusal: Refusal
    ) -> web.Response:
        """Every refusal answered and counted the same way (``refusals``: one table of kinds)."""
        self.metrics.count_rejected(tenant.name, refusal.kind.reason)
        self.metrics.count_request(tenant.name, model, tenant.tier, refusal.kind.outcome)
        return refusal_response(refusal, gate.rate_limit_headers() if gate is not None else None)

    def _throttled(self, tenant: TenantRuntime, gate: TenantGate, exc: Throttled, model: str) -> web.Response:
        self.metrics.count_throttled(tenant.name, model, tenant.tier, exc.reason)
        return error_response(
            429,
            exc.message,
            "rate_limit_error",
            exc.reason,
            headers={"Retry-After": exc.retry_after_header, **gate.rate_limit_headers()},
        )

    def _body_too_large(self) -> Refusal:
        return Refusal(BODY_TOO_LARGE, f"request body larger than {self.settings.max_body_bytes} bytes")

    async def _read_body(self, request: web.Request, reservation: BodyReservation) -> bytes | bytearray:
        """The whole body, reserved in the body budget before (or, without a length, as) it arrives."""
        limit = self.settings.max_body_bytes
        length = request.content_length
        if length is not None:
            if length > limit:
                raise self._body_too_large()
            reservation.grow(length)
            content = request.content
            if content.is_eof():
                # All of it has already arrived (a small body comes with its headers): nothing can be
                # waited for, so no timer is armed, and a body in one chunk is used as it is, not copied.
                whole = content.read_nowait()
                _check_body_complete(len(whole), length)
                return whole
        # One buffer of the announced size, filled as chunks arrive: a body is held once, not twice.
        body = bytearray(length or 0)
        size = 0
        async with asyncio.timeout(self.settings.body_timeout_s):
            while chunk := await request.content.readany():
                end = size + len(chunk)
                if end > limit:
                    raise self._body_too_large()
                if length is None:
                    reservation.grow(len(chunk))
                    body += chunk
                else:
                    body[size:end] = chunk  # aiohttp never delivers more than Content-Length
                size = end
        _check_body_complete(size, length)
        return body

    async def _prepare(
        self, raw: bytes | bytearray, endpoint: Endpoint, policy: RequestPolicy
    ) -> PreparedRequest:
        """``prepare_request`` inline for small bodies, in a worker process for large ones."""
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

    async def _proxy(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        arrived = time.perf_counter()
        tenant = self._authenticate(request)
        if isinstance(tenant, web.Response):
            return tenant
        model_label = m.UNKNOWN_MODEL
        gate = self.gates.get(tenant.name)
        policy = self.policies.get(tenant.name)
        if gate is None or policy is None:  # removed by a reload between auth and here
            gone = Refusal(UNAUTHENTICATED, "this API key is no longer valid")
            return self._refuse(tenant, None, model_label, gone)
        reservation = self.body_budget.reserve(tenant.name, 0)
        try:
            try:
                gate.check_request_rate()  # before the body: a tenant over its rate costs no read or parse
                raw = await self._read_body(request, reservation)
                prepared = await self._prepare(raw, endpoint, policy)
            except Throttled as exc:
                return self._throttled(tenant, gate, exc, model_label)
            except BodyBudgetExceeded as exc:
                if exc.scope == "tenant":
                    return self._throttled(
                        tenant, gate, Throttled("body_bytes", 1.0, exc.message), model_label
                    )
                refusal = Refusal(GATEWAY_BUSY, exc.message + "; retry shortly")
            except Refusal as exc:
                refusal = exc
            except TimeoutError:
                refusal = Refusal(
                    BODY_TIMEOUT, f"request body not received within {self.settings.body_timeout_s:g} s"
                )
            except (BadRequest, RequestTooLarge) as exc:
                refusal = refusal_of(exc)
            else:
                del raw
                return await self._admit_and_forward(
                    request, endpoint, tenant, gate, prepared, reservation, arrived
                )
            return self._refuse(tenant, gate, model_label, refusal)
        finally:
            reservation.release()

    async def _admit_and_forward(
        self,
        request: web.Request,
        endpoint: Endpoint,
        tenant: TenantRuntime,
        gate: TenantGate,
        prepared: PreparedRequest,
        reservation: BodyReservation,
        arrived: float,
    ) -> web.StreamResponse:
        model_label = prepared.model
        budget = prepared.budget
        series = self.metrics.series(tenant.name, model_label, tenant.tier)
        try:
            engine = EngineRequest(
                self.engine_queues[tenant.pool.name],
                tenant.name,
                tenant.rank,
                tenant.entry.fair_share_weight,
                budget.prompt_tokens,
            )
            admission = await gate.acquire(budget.token_estimate, budget.kv_tokens, engine)
        except Throttled as exc:
            self._forget_gate_if_removed(tenant.name, gate)
            return self._throttled(tenant, gate, exc, model_label)
        series.queue_time.observe(admission.queued_s)
        in_flight = series.in_flight
        kv_gauge = series.kv_in_flight
        in_flight.inc()
        kv_gauge.set(gate.kv_in_flight)
        outcome = "cancelled"
        try:
            response, outcome = await self._forward(
                request,
                endpoint=endpoint,
                tenant=tenant,
                prepared=prepared,
                admission=admission,
                series=series,
                arrived=arrived,
                limit_headers=gate.rate_limit_headers(),
                reservation=reservation,
            )
            return response
        finally:
            admission.release()
            in_flight.dec()
            kv_gauge.set(gate.kv_in_flight)
            series.outcomes[outcome].inc()
            series.duration.observe(time.perf_counter() - arrived)
            self._forget_gate_if_removed(tenant.name, gate)

    def _forget_gate_if_removed(self, name: str, gate: TenantGate) -> None:
        """Drop the gate of a tenant a reload removed once its last in-flight request has finished."""
        snapshot = self.snapshot
        removed = snapshot is not None and name not in snapshot.tenants
        if removed and gate.in_flight == 0 and gate.queued == 0 and self.gates.get(name) is gate:
            del self.gates[name]

    async def _connect(
        self,
        endpoint: Endpoint,
        tenant: TenantRuntime,
        prepared: PreparedRequest,
        headers: dict[str, str],
    ) -> tuple[aiohttp.ClientResponse, ReplicaState] | web.Response:
        """Send to the affinity replica, failing over only while nothing has been sent.

        A connection that could not be established (refused, unreachable, or not accepted within the
        connect timeout) carried no byte of the request: the replica is marked down and the next one
        tried. Any failure after that (the connection dropped or reset while the request was written or
        the answer awaited: 502; no answer within the upstream timeout: 504) may come after the engine
        read the request, so the request is not sent again (an engine must never run one request
        twice), and the replica is suspected until a health check passes (``_suspect``).
        """
        assert self.session is not None
        router = self.routers.get(tenant.pool.name)
        key = (tenant.cache_salt + "\x00" + prepared.affinity_text).encode()
        tried: set[str] = set()
        slow = 0  # of the tried, how many did not accept within the connect timeout (the rest refused)
        while True:
            replica = router.choose(key, tried, self.settings.load_factor) if router else None
            if replica is None:
                pool = tenant.pool.name
                reason = (
                    f"no healthy engine replica in pool {pool!r}"
                    if not tried
                    else f"no replica of pool {pool!r} could be connected to ({len(tried) - slow} refused or "
                    f"unreachable, {slow} did not accept within {self.settings.connect_timeout_s:g} s)"
                )
                return refusal_response(Refusal(NO_HEALTHY_REPLICA, reason))
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                resp = await self.session.post(
                    replica.url + endpoint.value, data=prepared.payload, headers=headers
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                replica.in_flight -= 1
                self.metrics.upstream_errors.labels(tenant.pool.name, "connect").inc()
                slow += isinstance(exc, aiohttp.ConnectionTimeoutError)
                if not isinstance(exc, aiohttp.ConnectionTimeoutError):
                    # Refused or unreachable: down. A connect that was slow (an accept queue full under
                    # load) proves nothing: fail over, and leave the verdict to the health checks.
                    replica.healthy = False
                    replica.last_error = f"connect failed: {type(exc).__name__}"
                    self.metrics.replica_healthy.labels(tenant.pool.name, replica.url).set(0)
                log.warning(
                    "replica %s of pool %s refused or did not accept a connection (%s); failing over",
                    replica.url,
                    tenant.pool.name,
                    type(exc).__name__,
                )
                continue
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                replica.in_flight -= 1
                timed_out = isinstance(exc, TimeoutError)
                self.metrics.upstream_errors.labels(
                    tenant.pool.name, "timeout" if timed_out else "disconnect"
                ).inc()
                self._suspect(tenant.pool.name, replica, f"failed before answering: {type(exc).__name__}")
                if timed_out:
                    return error_response(
                        504,
                        f"the engine sent no answer within {self.settings.upstream_read_timeout_s:g} s; the "
                        "request was not retried because the engine may have received it",
                        "upstream_error",
                        "upstream_timeout",
                    )
                return error_response(
                    502,
                    "the engine connection failed before it answered; the request was not retried "
                    "because the engine may have received it",
                    "upstream_error",
                    "upstream_failed",
                )
            except BaseException:
                replica.in_flight -= 1
                raise
            return resp, replica

    async def _forward(
        self,
        request: web.Request,
        *,
        endpoint: Endpoint,
        tenant: TenantRuntime,
        prepared: PreparedRequest,
        admission: GateSlot,
        series: RequestSeries,
        arrived: float,
        limit_headers: dict[str, str],
        reservation: BodyReservation,
    ) -> tuple[web.StreamResponse, str]:
        request_id = build_request_id(tenant.name)
        headers = build_upstream_headers(tenant.name, request_id, request.headers)
        connected = await self._connect(endpoint, tenant, prepared, headers)
        reservation.release()  # the body has been handed to the engine (or never will be)
        if isinstance(connected, web.Response):
            connected.headers.update(limit_headers)
            if connected.status == 503:
                admission.settle_usage(0, 0)  # sent to no engine: nothing was generated
                self.metrics.count_rejected(tenant.name, NO_HEALTHY_REPLICA.reason)
                return connected, "unavailable"
            return connected, "upstream_error"  # the engine may have run it: the estimate stays charged
        upstream, replica = connected
        usage = _UsageTracker()
        started: list[web.StreamResponse] = []
        try:
            if prepared.stream and upstream.status == 200:
                response, outcome = await self._relay_stream(
                    request,
                    upstream=upstream,
                    prepared=prepared,
                    usage=usage,
                    series=series,
                    arrived=arrived,
                    started=started,
                    limit_headers=limit_headers,
                    pool=tenant.pool.name,
                )
            else:
                response, outcome = await self._relay_buffered(
                    upstream, usage, tenant.pool.name, limit_headers
                )
        except asyncio.CancelledError:
            upstream.close()  # drop the connection so the engine aborts the request
            raise
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            TimeoutError,
        ) as exc:
            upstream.close()
            timed_out = isinstance(exc, TimeoutError)
            self.metrics.upstream_errors.labels(
                tenant.pool.name, "timeout" if timed_out else "disconnect"
            ).inc()
            self._suspect(tenant.pool.name, replica, f"failed mid-answer: {type(exc).__name__}")
            message = (
                f"the engine sent nothing for {self.settings.upstream_read_timeout_s:g} s during the answer"
                if timed_out
                else "the engine connection failed during the answer"
            )
            if started:  # headers already went out: end the stream with an error event where it broke
                code = "upstream_timeout" if timed_out else "upstream_failed"
                await _end_stream_with_error(started[0], message, code)
                return started[0], "upstream_error"
            failed = error_response(
                504 if timed_out else 502,
                message,
                "upstream_error",
                "upstream_timeout" if timed_out else "upstream_failed",
            )
            failed.headers.update(limit_headers)
            return failed, "upstream_error"
        finally:
            replica.in_flight -= 1
            upstream.release()
        if usage.seen:
            admission.settle_usage(usage.prompt, usage.completion)
            series.prompt_tokens.inc(usage.prompt)
            series.completion_tokens.inc(usage.completion)
            series.cached_prompt_tokens.inc(usage.cached)
        elif outcome == "client_error":
            admission.settle_usage(0, 0)  # the engine refused the request (a 4xx): it generated nothing
        return response, outcome

    async def _relay_buffered(
        self, upstream: aiohttp.ClientResponse, usage: _UsageTracker, pool: str, limit_headers: dict[str, str]
    ) -> tuple[web.Response, str]:
        raw = await upstream.read()
        status = upstream.status
        if status == 200:
            with contextlib.suppress(ValueError):
                usage.take(json.loads(raw))
            outcome = "ok"
        elif status >= 500:
            self.metrics.upstream_errors.labels(pool, "status_5xx").inc()
            outcome = "upstream_error"
        else:
            outcome = "client_error"
        content_type = upstream.headers.get("Content-Type", "application/json")
        return web.Response(
            status=status, body=raw, headers={"Content-Type": content_type, **limit_headers}
        ), outcome

    async def _relay_stream(
        self,
        request: web.Request,
        *,
        upstream: aiohttp.ClientResponse,
        prepared: PreparedRequest,
        usage: _UsageTracker,
        series: RequestSeries,
        arrived: float,
        started: list[web.StreamResponse],
        limit_headers: dict[str, str],
        pool: str,
    ) -> tuple[web.StreamResponse, str]:
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                **limit_headers,
            },
        )
        try:
            await out.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()  # the client left while the engine was starting its answer
            return out, "cancelled"
        started.append(out)
        forget_close = _fail_stream_when_closed(upstream)
        try:
            return await self._relay_events(out, upstream, prepared, usage, series, arrived, pool)
        finally:
            forget_close()

    async def _relay_events(
        self,
        out: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        prepared: PreparedRequest,
        usage: _UsageTracker,
        series: RequestSeries,
        arrived: float,
        pool: str,
    ) -> tuple[web.StreamResponse, str]:
        ttft = series.ttft
        itl = series.itl
        last: float | None = None
        done = False
        try:
            async for events in _sse_events(upstream.content.iter_any()):
                keep: list[bytes] = []
                for event in events:
                    if b'"prompt_tokens"' in event:
                        chunk = _event_json(event)
                        usage.take(chunk)
                        if (
                            not prepared.client_wants_usage
                            and isinstance(chunk, dict)
                            and not chunk.get("choices")
                        ):
                            continue  # the usage-only chunk the gateway asked for, not the client
                    elif event.startswith(b"data: [DONE]") or event.startswith(b"data:[DONE]"):
                        done = True
                    keep.append(event)
                if not keep:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.observe(now - arrived)
                else:
                    itl.observe(now - last)
                last = now
                await out.write(b"".join(keep))
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()
            return out, "cancelled"
        if not done:  # the engine ended the stream without its last event: say so, never end silently
            self.metrics.upstream_errors.labels(pool, "disconnect").inc()
            await _end_stream_with_error(out, "the engine ended the stream before the answer was complete")
            return out, "upstream_error"
        await out.write_eof()
        return out, "ok"


def _fail_stream_when_closed(upstream: aiohttp.ClientResponse) -> Callable[[], None]:
    """Make the answer's body fail if its connection closes before the body ended; returns what undoes
    it (call it when the stream is over: a pooled connection serves many streams).

    aiohttp leaves the body waiting forever when the engine sends bytes it cannot parse as chunked
    encoding (a chunk cut and followed by anything else): it closes the connection and sets the error on
    the connection's protocol, never on the body, and the read timeout goes with the connection. The
    client's stream then hung, holding its admission slot, with no error event."""
    connection = upstream.connection
    protocol = connection.protocol if connection is not None else None
    closed = protocol.closed if protocol is not None else None
    if closed is None:
        return _no_op
    content = upstream.content

    def on_closed(_future: asyncio.Future[None]) -> None:
        if not content.is_eof() and content.exception() is None:
            content.set_exception(aiohttp.ClientPayloadError("the engine connection closed mid-answer"))

    # Once per connection: the future aiohttp creates on asking holds how the connection closed, which
    # nobody else reads (asyncio would log it as never retrieved).
    closed.remove_done_callback(_retrieve_exception)
    closed.add_done_callback(_retrieve_exception)
    closed.add_done_callback(on_closed)

    def forget() -> None:
        closed.remove_done_callback(on_closed)

    return forget


def _retrieve_exception(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _no_op() -> None:
    return None


async def _end_stream_with_error(
    out: web.StreamResponse, message: str, code: str = "upstream_failed"
) -> None:
    """Write the error event and end the stream; a client that is already gone is fine."""
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
        await out.write(stream_error_event(message, code))
        await out.write_eof()


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Group a byte stream into complete SSE events (each ending with a blank line). An event the stream
    ends in the middle of is dropped, as the SSE standard says: forwarded, it reached the client as a
    complete event holding half a JSON object."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\n\n" not in buffer and b"\r\n\r\n" not in buffer:
            continue
        normalized = buffer.replace(b"\r\n", b"\n")
        parts = normalized.split(b"\n\n")
        buffer = parts.pop()
        yield [p + b"\n\n" for p in parts if p.strip()]


def _event_json(event: bytes) -> Any:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                try:
                    return json.loads(data)
                except ValueError:
                    return None
    return None


def _closing(response: web.Response) -> web.Response:
    """``response``, and its connection closed after it: an answer to a client that has not shown a key
    (refused, or a path that does not exist) must not leave it a connection to hold (keep-alive held one
    for ``idle_timeout_s`` after each 401, so about 70 such requests a second from one host held the
    whole connection bound and every tenant got 503)."""
    response.force_close()
    response.headers["Connection"] = "close"
    return response


_WRONG_KEY = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
#: Per way authentication fails, the refusal (``refusals``).
_AUTH_REFUSALS: dict[AuthFailure, Refusal] = {
    AuthFailure.MISSING: Refusal(UNAUTHENTICATED, _WRONG_KEY),
    AuthFailure.UNKNOWN: Refusal(UNAUTHENTICATED, _WRONG_KEY),
    AuthFailure.MALFORMED: Refusal(MALFORMED_KEY, "the Authorization header is not valid UTF-8"),
    AuthFailure.AMBIGUOUS: Refusal(
        AMBIGUOUS_KEY,
        "this API key is not assigned to exactly one tenant, so it is refused; ask your administrator "
        "for a new key",
    ),
}


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("kvfleet_gateway", Gateway)


_ROUTES: dict[str, str] = {
    Endpoint.CHAT.value: "POST",
    Endpoint.COMPLETIONS.value: "POST",
    "/v1/models": "GET",
    "/healthz": "GET",
    "/readyz": "GET",
}


async def _fallback(request: web.Request) -> web.Response:
    """404/405 as OpenAI-style JSON (a catch-all route is cheaper than a middleware on every request)."""
    allowed = _ROUTES.get(request.path)
    if allowed is not None:
        return _closing(
            error_response(
                405,
                f"{request.method} is not allowed on {request.path}; use {allowed}",
                "invalid_request_error",
                "method_not_allowed",
                headers={"Allow": allowed},
            )
        )
    return _closing(error_response(404, "no such endpoint", "invalid_request_error", "not_found"))


def build_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> web.Application:
    """The public application (no ``/metrics``: see ``build_metrics_app``); serve it on a ``GuardedSite``
    with ``web.AppRunner(app, handler_cancellation=True, keepalive_timeout=settings.idle_timeout_s)``."""
    gateway = Gateway(settings, metrics)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    app.on_response_prepare.append(gateway.on_response_prepare)
    app.router.add_post(Endpoint.CHAT.value, gateway.handle_chat, expect_handler=gateway.expect_continue)
    app.router.add_post(
        Endpoint.COMPLETIONS.value, gateway.handle_completions, expect_handler=gateway.expect_continue
    )
    app.router.add_get("/v1/models", gateway.handle_models)
    app.router.add_get("/healthz", gateway.handle_healthz)
    app.router.add_get("/readyz", gateway.handle_readyz)
    app.router.add_route("*", "/{tail:.*}", _fallback)  # last: only what nothing above matched
    return app


def build_metrics_app(gateway: Gateway) -> web.Application:
    """``/metrics`` alone, for a port of its own: the public port lists no tenant to anyone."""
    app = web.Application()
    app.router.add_get("/metrics", gateway.handle_metrics)
    return app


@contextlib.asynccontextmanager
async def running_gateway(
    settings: GatewaySettings,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics: GatewayMetrics | None = None,
    *,
    metrics_host: str | None = None,
    metrics_port: int = 0,
    shutdown_timeout_s: float | None = None,
) -> AsyncIterator[tuple[str, Gateway]]:
    """Start the gateway on ``host:port`` and its metrics on ``metrics_host:metrics_port`` (0: a free
    port; the host defaults to ``host``); yield the public base URL and the state (its ``metrics_url``
    and ``stop_listening`` set); stop both. On exit, requests still in flight get ``shutdown_timeout_s``
    (default ``drain_timeout_s``) before they are cancelled."""
    app = build_app(settings, metrics)
    gateway = app[GATEWAY_KEY]
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=settings.idle_timeout_s,
        # On exit: stop listening, close idle connections, give in-flight requests this long, cancel.
        shutdown_timeout=settings.drain_timeout_s if shutdown_timeout_s is None else shutdown_timeout_s,
    )
    metrics_runner = web.AppRunner(build_metrics_app(gateway), access_log=None)
    await runner.setup()
    try:
        await metrics_runner.setup()
        site = GuardedSite(runner, host, port, gateway.guards)
        await site.start()
        gateway.stop_listening = site.stop
        metrics_site = web.TCPSite(metrics_runner, metrics_host or host, metrics_port)
        await metrics_site.start()
        gateway.metrics_url = f"http://{metrics_host or host}:{metrics_runner.addresses[0][1]}"
        yield f"http://{host}:{runner.addresses[0][1]}", gateway
    finally:
        await runner.cleanup()  # first: /metrics stays up while in-flight requests drain
        await metrics_runner.cleanup()


def _raise_open_files_limit(wanted: int) -> None:
    """Raise the soft open-files limit toward ``wanted`` (up to the hard limit) so that the connection
    bound, not the descriptor limit, is what turns clients away."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "open-files limit %d is below what --max-connections and the upstream pool need (%d); "
            "clients may be refused by the limit before the bound",
            soft,
            wanted,
        )


async def serve(
    settings: GatewaySettings, host: str, port: int, metrics_host: str, metrics_port: int
) -> None:
    """Run the gateway until SIGTERM/SIGINT, then drain and stop.

    The drain: the listener closes (new connections go to other replicas), ``/readyz`` answers 503 and
    every answer closes its connection, so keep-alive clients are retired between requests rather than
    finding a connection closed under a request they are sending. Requests in flight (streams included)
    get up to ``drain_timeout_s``; once nothing has been in flight for a moment, the idle connections
    left are closed and the process exits; what is still running at the drain timeout is cancelled. A
    Kubernetes preStop sleep before SIGTERM lets the endpoint's removal reach every node's proxy first
    (operator/kvfleet_operator/build/gateway.py), so nothing new is sent to a draining gateway.
    """
    _raise_open_files_limit(settings.max_connections + settings.upstream_connections + 256)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with running_gateway(
        settings,
        host,
        port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        shutdown_timeout_s=_CANCEL_GRACE_S,  # the drain below is the wait; then only the cancelling
    ) as (url, gateway):
        log.info("kvfleet gateway listening on %s, metrics on %s", url, gateway.metrics_url)
        await gateway.warm_parse_workers()
        await stop.wait()
        gateway.begin_drain()
        await gateway.stop_listening()
        log.info(
            "shutting down: draining %d requests on %d connections (up to %g s)",
            gateway.requests_in_flight(),
            gateway.guards.open,
            settings.drain_timeout_s,
        )
        if not await gateway.wait_quiet(settings.drain_timeout_s):
            log.warning("drain timeout: cancelling %d requests still in flight", gateway.requests_in_flight())
