"""The gateway's HTTP shell: aiohttp server in front, pooled aiohttp client to the engines behind.

Request path (``/v1/chat/completions``, ``/v1/completions``):
  auth (401) -> body read, bounded in size (413) and time (408) -> parse (400) -> model check (403)
  -> admission (429 + Retry-After, or a bounded wait) -> replica by prefix affinity (503 when none is
  healthy) -> rewrite (rewrite.py) -> upstream, failing over to the next replica on connect errors
  -> answer streamed or buffered back, usage reconciled and counted.

A client that disconnects cancels its handler (the runner is built with ``handler_cancellation``), which
closes the upstream connection, and vLLM aborts a request whose connection closed.

Nothing here logs a prompt, a completion, a key or a header value; errors are logged by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.admission import GateLimits, GateSlot, TenantGate, Throttled
from kvfleet_runtime.gateway.metrics import GatewayMetrics, RequestSeries
from kvfleet_runtime.gateway.rewrite import (
    BadRequest,
    Endpoint,
    ParsedRequest,
    build_request_id,
    build_upstream_body,
    build_upstream_headers,
    extract_usage,
    parse_request,
)
from kvfleet_runtime.gateway.routing import PoolRouter, ReplicaState, build_pool_router
from kvfleet_runtime.gateway.state import GatewaySnapshot, SnapshotReloader, TenantRuntime

log = logging.getLogger("kvfleet.gateway")


@dataclass(frozen=True)
class GatewaySettings:
    """Process-level knobs (the CLI flags); per-tenant limits come from the tenant table."""

    config_path: Path
    keys_path: Path
    reload_interval_s: float = 1.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 10.0
    max_queue: int = 64
    max_queue_wait_s: float = 10.0
    affinity_prefix_chars: int = 512
    load_factor: float = 1.25
    default_max_tokens: int = 256
    connect_timeout_s: float = 2.0
    upstream_read_timeout_s: float = 600.0
    upstream_connections: int = 4096


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
        self.routers: dict[str, PoolRouter] = {}
        self.session: aiohttp.ClientSession | None = None
        self.watcher = SnapshotReloader(
            settings.config_path,
            settings.keys_path,
            on_change=self.apply_snapshot,
            on_failure=lambda which: self.metrics.reload_failures.labels(which).inc(),
            interval_s=settings.reload_interval_s,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._health_wakeup = asyncio.Event()

    # -- configuration ------------------------------------------------------------------------------
    def apply_snapshot(self, snapshot: GatewaySnapshot) -> None:
        """Swap in a new configuration; in-flight requests keep the objects they already hold."""
        routers = {
            name: build_pool_router(name, pool.endpoints, self.routers.get(name))
            for name, pool in snapshot.table.pools.items()
        }
        for name, tenant in snapshot.tenants.items():
            limits = self._limits_for(tenant)
            gate = self.gates.get(name)
            if gate is None:
                self.gates[name] = TenantGate(limits)
            else:
                gate.update_limits(limits)
        self.routers = routers
        self.snapshot = snapshot
        for name in set(self.gates) - set(snapshot.tenants):
            # Its keys are already gone; a gate with requests still in flight goes when the last ends.
            self._forget_gate_if_removed(name, self.gates[name])
        self.metrics.reloads.inc()
        self._health_wakeup.set()
        log.info(
            "configuration loaded: %d tenants, %d pools", len(snapshot.tenants), len(snapshot.table.pools)
        )

    def _limits_for(self, tenant: TenantRuntime) -> GateLimits:
        rl = tenant.entry.rate_limits
        return GateLimits(
            requests_per_minute=rl.requests_per_minute,
            tokens_per_minute=rl.tokens_per_minute,
            max_concurrent=rl.max_concurrent,
            kv_budget_tokens=tenant.kv_budget_tokens,
            max_queue=self.settings.max_queue,
            max_queue_wait_s=self.settings.max_queue_wait_s,
        )

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        self.apply_snapshot(await asyncio.to_thread(self.watcher.load_initial))
        connector = aiohttp.TCPConnector(
            limit=self.settings.upstream_connections,
            limit_per_host=0,
            # Below uvicorn's (vLLM's server) 5 s keep-alive, so the gateway closes idle connections first.
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
            skip_auto_headers=("User-Agent",),
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

    # -- health -------------------------------------------------------------------------------------
    async def _probe(self, pool: str, replica: ReplicaState) -> None:
        assert self.session is not None
        try:
            async with self.session.get(
                replica.url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout_s),
            ) as resp:
                await resp.read()
                healthy = resp.status == 200
                replica.last_error = "" if healthy else f"health check answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
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

    def readiness(self) -> tuple[bool, str]:
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

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        payload = generate_latest(self.metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _authenticate(self, request: web.Request) -> TenantRuntime | web.Response:
        snapshot = self.snapshot
        tenant = snapshot.authenticate(request.headers.get("Authorization")) if snapshot else None
        if tenant is None:
            self.metrics.rejected.labels(m.UNAUTHENTICATED, "unauthenticated").inc()
            self.metrics.requests.labels(m.UNAUTHENTICATED, m.UNKNOWN_MODEL, m.NO_TIER, "client_error").inc()
            return error_response(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    async def handle_models(self, request: web.Request) -> web.Response:
        tenant = self._authenticate(request)
        if isinstance(tenant, web.Response):
            return tenant
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvfleet"}
            for model in sorted(tenant.models)
        ]
        return web.json_response({"object": "list", "data": data})

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, Endpoint.CHAT)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, Endpoint.COMPLETIONS)

    def _reject(self, tenant: TenantRuntime, model: str, reason: str, response: web.Response) -> web.Response:
        self.metrics.rejected.labels(tenant.name, reason).inc()
        outcome = "unavailable" if reason == "no_healthy_replica" else "client_error"
        self.metrics.requests.labels(tenant.name, model, tenant.tier, outcome).inc()
        return response

    async def _read_body(self, request: web.Request, tenant: TenantRuntime) -> Any:
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        async with asyncio.timeout(self.settings.body_timeout_s):
            raw = await request.read()  # bounded by the app's client_max_size
        if not raw:
            raise BadRequest("the request body is empty; send a JSON object")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise BadRequest("the request body is not valid JSON") from None

    async def _proxy(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        arrived = time.perf_counter()
        tenant = self._authenticate(request)
        if isinstance(tenant, web.Response):
            return tenant
        model_label = m.UNKNOWN_MODEL
        try:
            body = await self._read_body(request, tenant)
            parsed = parse_request(body, endpoint, self.settings.affinity_prefix_chars)
        except web.HTTPRequestEntityTooLarge:
            return self._reject(
                tenant,
                model_label,
                "body_too_large",
                error_response(
                    413,
                    f"request body larger than {self.settings.max_body_bytes} bytes",
                    "invalid_request_error",
                    "body_too_large",
                ),
            )
        except TimeoutError:
            return self._reject(
                tenant,
                model_label,
                "body_timeout",
                error_response(
                    408,
                    f"request body not received within {self.settings.body_timeout_s:g} s",
                    "invalid_request_error",
                    "body_timeout",
                ),
            )
        except BadRequest as exc:
            return self._reject(
                tenant,
                model_label,
                "bad_request",
                error_response(400, exc.message, "invalid_request_error", "invalid_request", param=exc.param),
            )
        if parsed.model not in tenant.models:
            return self._reject(
                tenant,
                model_label,
                "model_not_allowed",
                error_response(
                    403,
                    f"this API key may not use model {parsed.model[:100]!r}; "
                    "GET /v1/models lists the allowed ones",
                    "permission_error",
                    "model_not_allowed",
                    param="model",
                ),
            )
        model_label = parsed.model
        gate = self.gates.get(tenant.name)
        if gate is None:  # removed by a reload between auth and here
            return self._reject(
                tenant,
                model_label,
                "unauthenticated",
                error_response(
                    401, "this API key is no longer valid", "invalid_request_error", "invalid_api_key"
                ),
            )
        max_tokens = parsed.max_tokens or self.settings.default_max_tokens
        kv_tokens = parsed.prompt_tokens_estimate + max_tokens
        series = self.metrics.series(tenant.name, model_label, tenant.tier)
        try:
            admission = await gate.acquire(kv_tokens, kv_tokens)
        except Throttled as exc:
            self.metrics.throttled.labels(tenant.name, tenant.tier, exc.reason).inc()
            series.outcomes["throttled"].inc()
            self._forget_gate_if_removed(tenant.name, gate)
            return error_response(
                429,
                exc.message,
                "rate_limit_error",
                exc.reason,
                headers={"Retry-After": exc.retry_after_header},
            )
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
                parsed=parsed,
                admission=admission,
                series=series,
                arrived=arrived,
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
        parsed: ParsedRequest,
        payload: bytes,
        headers: dict[str, str],
    ) -> tuple[aiohttp.ClientResponse, ReplicaState] | web.Response:
        """Send to the affinity replica; on a connect error mark it unhealthy and try the next one."""
        assert self.session is not None
        router = self.routers.get(tenant.pool.name)
        key = (tenant.cache_salt + "\x00" + parsed.affinity_text).encode()
        tried: set[str] = set()
        while True:
            replica = router.choose(key, tried, self.settings.load_factor) if router else None
            if replica is None:
                reason = (
                    f"no healthy engine replica in pool {tenant.pool.name!r}"
                    if not tried
                    else f"all {len(tried)} replicas of pool {tenant.pool.name!r} refused the connection"
                )
                return error_response(503, reason, "service_unavailable", "no_healthy_replica")
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                try:
                    resp = await self.session.post(
                        replica.url + endpoint.value, data=payload, headers=headers
                    )
                except aiohttp.ServerDisconnectedError:
                    # Most often a pooled keep-alive connection the engine had just closed (the request was
                    # never read): resend once on a fresh connection before calling the replica down.
                    self.metrics.upstream_errors.labels(tenant.pool.name, "disconnect").inc()
                    resp = await self.session.post(
                        replica.url + endpoint.value, data=payload, headers=headers
                    )
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                replica.in_flight -= 1
                replica.healthy = False
                replica.last_error = f"connect failed: {type(exc).__name__}"
                self.metrics.upstream_errors.labels(tenant.pool.name, "connect").inc()
                self.metrics.replica_healthy.labels(tenant.pool.name, replica.url).set(0)
                log.warning(
                    "replica %s of pool %s refused a connection (%s); failing over",
                    replica.url,
                    tenant.pool.name,
                    type(exc).__name__,
                )
                continue
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
        parsed: ParsedRequest,
        admission: GateSlot,
        series: RequestSeries,
        arrived: float,
    ) -> tuple[web.StreamResponse, str]:
        request_id = build_request_id(tenant.name)
        body = build_upstream_body(
            parsed, tenant=tenant.name, cache_salt=tenant.cache_salt, priority=tenant.entry.priority
        )
        payload = json.dumps(body, separators=(",", ":")).encode()
        headers = build_upstream_headers(tenant.name, request_id, request.headers)
        connected = await self._connect(endpoint, tenant, parsed, payload, headers)
        if isinstance(connected, web.Response):
            self.metrics.rejected.labels(tenant.name, "no_healthy_replica").inc()
            return connected, "unavailable"
        upstream, replica = connected
        usage = _UsageTracker()
        started: list[web.StreamResponse] = []
        try:
            if parsed.stream and upstream.status == 200:
                response, outcome = await self._relay_stream(
                    request,
                    upstream=upstream,
                    parsed=parsed,
                    usage=usage,
                    series=series,
                    arrived=arrived,
                    started=started,
                )
            else:
                response, outcome = await self._relay_buffered(upstream, usage, tenant.pool.name)
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
            kind = "timeout" if isinstance(exc, TimeoutError) else "disconnect"
            self.metrics.upstream_errors.labels(tenant.pool.name, kind).inc()
            log.warning(
                "replica %s of pool %s failed mid-answer (%s)",
                replica.url,
                tenant.pool.name,
                type(exc).__name__,
            )
            if started:  # headers already went out: end the stream where it broke
                return started[0], "upstream_error"
            return error_response(
                502, "the engine connection failed during the answer", "upstream_error", "upstream_failed"
            ), "upstream_error"
        finally:
            replica.in_flight -= 1
            upstream.release()
        if usage.seen:
            admission.reconcile_tokens(usage.prompt + usage.completion)
            series.prompt_tokens.inc(usage.prompt)
            series.completion_tokens.inc(usage.completion)
            series.cached_prompt_tokens.inc(usage.cached)
        return response, outcome

    async def _relay_buffered(
        self, upstream: aiohttp.ClientResponse, usage: _UsageTracker, pool: str
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
        return web.Response(status=status, body=raw, headers={"Content-Type": content_type}), outcome

    async def _relay_stream(
        self,
        request: web.Request,
        *,
        upstream: aiohttp.ClientResponse,
        parsed: ParsedRequest,
        usage: _UsageTracker,
        series: RequestSeries,
        arrived: float,
        started: list[web.StreamResponse],
    ) -> tuple[web.StreamResponse, str]:
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
            },
        )
        await out.prepare(request)
        started.append(out)
        ttft = series.ttft
        itl = series.itl
        last: float | None = None
        try:
            async for events in _sse_events(upstream.content.iter_any()):
                keep: list[bytes] = []
                for event in events:
                    if b'"prompt_tokens"' in event:
                        chunk = _event_json(event)
                        usage.take(chunk)
                        if (
                            not parsed.client_wants_usage
                            and isinstance(chunk, dict)
                            and not chunk.get("choices")
                        ):
                            continue  # the usage-only chunk the gateway asked for, not the client
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
        await out.write_eof()
        return out, "ok"


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Group a byte stream into complete SSE events (each ending with a blank line)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\n\n" not in buffer and b"\r\n\r\n" not in buffer:
            continue
        normalized = buffer.replace(b"\r\n", b"\n")
        parts = normalized.split(b"\n\n")
        buffer = parts.pop()
        yield [p + b"\n\n" for p in parts if p.strip()]
    if buffer.strip():
        yield [buffer if buffer.endswith(b"\n\n") else buffer + b"\n\n"]


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


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("kvfleet_gateway", Gateway)


_ROUTES: dict[str, str] = {
    Endpoint.CHAT.value: "POST",
    Endpoint.COMPLETIONS.value: "POST",
    "/v1/models": "GET",
    "/healthz": "GET",
    "/readyz": "GET",
    "/metrics": "GET",
}


async def _fallback(request: web.Request) -> web.Response:
    """404/405 as OpenAI-style JSON (a catch-all route is cheaper than a middleware on every request)."""
    allowed = _ROUTES.get(request.path)
    if allowed is not None:
        return error_response(
            405,
            f"{request.method} is not allowed on {request.path}; use {allowed}",
            "invalid_request_error",
            "method_not_allowed",
            headers={"Allow": allowed},
        )
    return error_response(404, "no such endpoint", "invalid_request_error", "not_found")


def build_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> web.Application:
    """The gateway application; start it with ``web.AppRunner(app, handler_cancellation=True)``."""
    gateway = Gateway(settings, metrics)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    app.router.add_post(Endpoint.CHAT.value, gateway.handle_chat)
    app.router.add_post(Endpoint.COMPLETIONS.value, gateway.handle_completions)
    app.router.add_get("/v1/models", gateway.handle_models)
    app.router.add_get("/healthz", gateway.handle_healthz)
    app.router.add_get("/readyz", gateway.handle_readyz)
    app.router.add_get("/metrics", gateway.handle_metrics)
    app.router.add_route("*", "/{tail:.*}", _fallback)  # last: only what nothing above matched
    return app


@contextlib.asynccontextmanager
async def running_gateway(
    settings: GatewaySettings,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics: GatewayMetrics | None = None,
) -> AsyncIterator[tuple[str, Gateway]]:
    """Start the gateway on ``host:port`` (0: a free port); yield its base URL and state; stop it."""
    app = build_app(settings, metrics)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=2048)
        await site.start()
        bound = runner.addresses[0]
        yield f"http://{host}:{bound[1]}", app[GATEWAY_KEY]
    finally:
        await runner.cleanup()


async def serve(settings: GatewaySettings, host: str, port: int) -> None:
    """Run the gateway until SIGTERM/SIGINT, then drain in-flight requests and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with running_gateway(settings, host, port) as (url, _gateway):
        log.info("kvfleet gateway listening on %s", url)
        await stop.wait()
        log.info("shutting down: draining in-flight requests")
