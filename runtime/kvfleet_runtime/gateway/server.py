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
import json
import logging
import resource
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.admission import BodyReservation
from kvfleet_runtime.gateway.connections import ConnectionGuards, GuardedSite
from kvfleet_runtime.gateway.metrics import GatewayMetrics
from kvfleet_runtime.gateway.pipeline import (
    AdmittedRequest,
    OpenRequest,
    Pipeline,
    UsageTracker,
    event_json,
    is_done_event,
    sse_events,
)
from kvfleet_runtime.gateway.refusals import (
    BODY_TIMEOUT,
    NO_HEALTHY_REPLICA,
    UPSTREAM_FAILED,
    UPSTREAM_TIMEOUT,
    Refusal,
    path_refusal,
)
from kvfleet_runtime.gateway.rewrite import (
    Endpoint,
    build_request_id,
    build_upstream_headers,
)
from kvfleet_runtime.gateway.routing import ReplicaState
from kvfleet_runtime.gateway.settings import GatewaySettings, per_source_connections
from kvfleet_runtime.gateway.state import TenantRuntime

log = logging.getLogger("kvfleet.gateway")
#: Where ``_authenticate`` leaves the tenant's name on the request (read by ``on_response_prepare``).
_TENANT_KEY: web.RequestKey[str] = web.RequestKey("kvfleet_tenant", str)

#: After a drain: how long requests still in flight at the drain timeout get to finish being cancelled.
_CANCEL_GRACE_S = 1.0


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
    """The answer to ``refusal``: its kind's status and error body, its headers, plus ``headers``."""
    kind = refusal.kind
    merged = {**(headers or {}), **refusal.headers}
    return error_response(
        kind.status, refusal.message, kind.err_type, refusal.code, param=refusal.param, headers=merged
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


class Gateway:
    """The aiohttp front door: reads requests, runs them through the ``Pipeline``, forwards them with
    its own client and relays the answers; one per process (one per app in tests)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> None:
        self.pipeline = Pipeline(settings, metrics)
        self.settings = settings
        self.metrics = self.pipeline.metrics
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
        #: Set on SIGTERM (``begin_drain``): not ready, and every answer closes its connection.
        self.draining = False
        #: Completions being handled, from arrival to the last byte of a stream (what a drain waits for).
        self.proxying = 0
        #: Closes the public listener (set by ``running_gateway``).
        self.stop_listening: Callable[[], Awaitable[None]] = _nothing

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        await self.pipeline.start()

    async def stop(self, _app: web.Application) -> None:
        await self.pipeline.stop()

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
        return self.pipeline.readiness()

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

    def _authenticate(self, request: web.Request) -> TenantRuntime:
        """Stage 1; a refusal closes the connection (a client that has shown no key holds none)."""
        try:
            tenant = self.pipeline.authenticate(request.headers.get("Authorization"))
        except Refusal as refusal:
            raise _Answered(_closing(refusal_response(refusal))) from None
        request[_TENANT_KEY] = tenant.name  # for the responses-by-status count (``on_response_prepare``)
        return tenant

    async def expect_continue(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: authenticate before telling the client to send its body."""
        try:
            self._authenticate(request)
        except _Answered as answered:
            return answered.response
        if request.headers.get("Expect", "").lower() != "100-continue" or request.version < (1, 1):
            return error_response(
                417, "only 'Expect: 100-continue' is supported", "invalid_request_error", "expectation_failed"
            )
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None

    async def handle_models(self, request: web.Request) -> web.Response:
        try:
            tenant = self._authenticate(request)
        except _Answered as answered:
            return answered.response
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvfleet"}
            for model in sorted(tenant.models)
        ]
        return web.json_response(
            {"object": "list", "data": data}, headers=self.pipeline.limit_headers(tenant)
        )

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

    async def _read_body(self, request: web.Request, opened: OpenRequest) -> bytes | bytearray:
        """The whole body, reserved in the body budget before (or, without a length, as) it arrives."""
        pipeline = self.pipeline
        limit = self.settings.max_body_bytes
        length = request.content_length
        if length is not None:
            if length > limit:
                raise pipeline.body_too_large()
            pipeline.hold_body(opened, length)
            content = request.content
            if content.is_eof():
                # All of it has already arrived (a small body comes with its headers): nothing can be
                # waited for, so no timer is armed, and a body in one chunk is used as it is, not copied.
                whole = content.read_nowait()
                pipeline.check_body_complete(len(whole), length)
                return whole
        # One buffer of the announced size, filled as chunks arrive: a body is held once, not twice.
        body = bytearray(length or 0)
        size = 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                while chunk := await request.content.readany():
                    end = size + len(chunk)
                    if end > limit:
                        raise pipeline.body_too_large()
                    if length is None:
                        pipeline.hold_body(opened, len(chunk))
                        body += chunk
                    else:
                        body[size:end] = chunk  # aiohttp never delivers more than Content-Length
                    size = end
        except TimeoutError:
            message = f"request body not received within {self.settings.body_timeout_s:g} s"
            raise Refusal(BODY_TIMEOUT, message) from None
        pipeline.check_body_complete(size, length)
        return body

    async def _proxy(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        pipeline = self.pipeline
        arrived = time.perf_counter()
        try:
            tenant = self._authenticate(request)
        except _Answered as answered:
            return answered.response
        try:
            opened = pipeline.open(tenant, arrived)  # counts its own refusals
        except Refusal as refusal:
            return refusal_response(refusal, pipeline.limit_headers(tenant))
        try:
            try:
                raw = await self._read_body(request, opened)
                prepared = await pipeline.parse(opened, raw, endpoint)
            except Refusal as refusal:
                pipeline.refused(refusal, tenant, m.UNKNOWN_MODEL)
                return refusal_response(refusal, opened.gate.rate_limit_headers())
            del raw
            try:
                admitted = await pipeline.admit(opened, prepared)  # counts its own refusals
            except Refusal as refusal:
                return refusal_response(refusal, opened.gate.rate_limit_headers())
            outcome = "cancelled"
            try:
                await pipeline.plan_route(admitted)
                response, outcome = await self._forward(request, endpoint, admitted, opened.reservation)
                return response
            finally:
                pipeline.finish(admitted, outcome)
        finally:
            opened.reservation.release()

    async def _connect(
        self, endpoint: Endpoint, admitted: AdmittedRequest, headers: dict[str, str]
    ) -> tuple[aiohttp.ClientResponse, ReplicaState]:
        """Send to the affinity replica, failing over only while nothing has been sent.

        A connection that could not be established (refused, unreachable, or not accepted within the
        connect timeout) carried no byte of the request: the replica is marked down and the next one
        tried. Any failure after that (the connection dropped or reset while the request was written or
        the answer awaited: 502; no answer within the upstream timeout: 504) may come after the engine
        read the request, so the request is not sent again (an engine must never run one request
        twice), and the replica is suspected until a health check passes (``Pipeline.suspect``).
        Raises ``Refusal`` (503, 502, 504).
        """
        pipeline = self.pipeline
        session = pipeline.session
        assert session is not None
        pool = admitted.tenant.pool.name
        tried: set[str] = set()
        slow = 0  # of the tried, how many did not accept within the connect timeout (the rest refused)
        while True:
            replica = pipeline.pick(admitted, tried, slow)
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                resp = await session.post(
                    replica.url + endpoint.value, data=admitted.prepared.payload, headers=headers
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                replica.in_flight -= 1
                self.metrics.upstream_errors.labels(pool, "connect").inc()
                slow += isinstance(exc, aiohttp.ConnectionTimeoutError)
                if not isinstance(exc, aiohttp.ConnectionTimeoutError):
                    # Refused or unreachable: down. A connect that was slow (an accept queue full under
                    # load) proves nothing: fail over, and leave the verdict to the health checks.
                    pipeline.mark_down(pool, replica, f"connect failed: {type(exc).__name__}")
                log.warning(
                    "replica %s of pool %s refused or did not accept a connection (%s); failing over",
                    replica.url,
                    pool,
                    type(exc).__name__,
                )
                continue
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                replica.in_flight -= 1
                timed_out = isinstance(exc, TimeoutError)
                self.metrics.upstream_errors.labels(pool, "timeout" if timed_out else "disconnect").inc()
                pipeline.suspect(pool, replica, f"failed before answering: {type(exc).__name__}")
                if timed_out:
                    raise Refusal(
                        UPSTREAM_TIMEOUT,
                        f"the engine sent no answer within {self.settings.upstream_read_timeout_s:g} s; the "
                        "request was not retried because the engine may have received it",
                    ) from None
                raise Refusal(
                    UPSTREAM_FAILED,
                    "the engine connection failed before it answered; the request was not retried "
                    "because the engine may have received it",
                ) from None
            except BaseException:
                replica.in_flight -= 1
                raise
            return resp, replica

    async def _forward(
        self,
        request: web.Request,
        endpoint: Endpoint,
        admitted: AdmittedRequest,
        reservation: BodyReservation,
    ) -> tuple[web.StreamResponse, str]:
        tenant = admitted.tenant
        pool = tenant.pool.name
        limit_headers = admitted.gate.rate_limit_headers()
        request_id = build_request_id(tenant.name)
        headers = build_upstream_headers(tenant.name, request_id, request.headers)
        try:
            upstream, replica = await self._connect(endpoint, admitted, headers)
        except Refusal as refusal:
            if refusal.kind is NO_HEALTHY_REPLICA:  # sent to no engine: nothing was generated
                self.pipeline.unavailable(admitted, refusal)
                outcome = "unavailable"
            else:  # the engine may have run it: the estimate stays charged
                outcome = "upstream_error"
            self.pipeline.account(admitted, UsageTracker(), outcome)
            return refusal_response(refusal, limit_headers), outcome
        finally:
            reservation.release()  # the body has been handed to the engine (or never will be)
        usage = UsageTracker()
        started: list[web.StreamResponse] = []
        try:
            if admitted.prepared.stream and upstream.status == 200:
                response, outcome = await self._relay_stream(
                    request, upstream, admitted, usage, started, limit_headers
                )
            else:
                response, outcome = await self._relay_buffered(upstream, usage, pool, limit_headers)
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
            self.metrics.upstream_errors.labels(pool, "timeout" if timed_out else "disconnect").inc()
            self.pipeline.suspect(pool, replica, f"failed mid-answer: {type(exc).__name__}")
            kind = UPSTREAM_TIMEOUT if timed_out else UPSTREAM_FAILED
            message = (
                f"the engine sent nothing for {self.settings.upstream_read_timeout_s:g} s during the answer"
                if timed_out
                else "the engine connection failed during the answer"
            )
            if started:  # headers already went out: end the stream with an error event where it broke
                await _end_stream_with_error(started[0], message, kind.code)
                return started[0], "upstream_error"
            return refusal_response(Refusal(kind, message), limit_headers), "upstream_error"
        finally:
            replica.in_flight -= 1
            upstream.release()
        self.pipeline.account(admitted, usage, outcome)
        return response, outcome

    async def _relay_buffered(
        self, upstream: aiohttp.ClientResponse, usage: UsageTracker, pool: str, limit_headers: dict[str, str]
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
        upstream: aiohttp.ClientResponse,
        admitted: AdmittedRequest,
        usage: UsageTracker,
        started: list[web.StreamResponse],
        limit_headers: dict[str, str],
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
            return await self._relay_events(out, upstream, admitted, usage)
        finally:
            forget_close()

    async def _relay_events(
        self,
        out: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        admitted: AdmittedRequest,
        usage: UsageTracker,
    ) -> tuple[web.StreamResponse, str]:
        series = admitted.series
        ttft = series.ttft
        itl = series.itl
        client_wants_usage = admitted.prepared.client_wants_usage
        last: float | None = None
        done = False
        try:
            async for events in sse_events(upstream.content.iter_any()):
                keep: list[bytes] = []
                for event in events:
                    if b'"prompt_tokens"' in event:
                        chunk = event_json(event)
                        usage.take(chunk)
                        if not client_wants_usage and isinstance(chunk, dict) and not chunk.get("choices"):
                            continue  # the usage-only chunk the gateway asked for, not the client
                    elif is_done_event(event):
                        done = True
                    keep.append(event)
                if not keep:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.observe(now - admitted.arrived)
                else:
                    itl.observe(now - last)
                last = now
                await out.write(b"".join(keep))
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()
            return out, "cancelled"
        if not done:  # the engine ended the stream without its last event: say so, never end silently
            self.metrics.upstream_errors.labels(admitted.tenant.pool.name, "disconnect").inc()
            await _end_stream_with_error(out, "the engine ended the stream before the answer was complete")
            return out, "upstream_error"
        await out.write_eof()
        return out, "ok"


class _Answered(Exception):
    """A request answered before it reached the pipeline's later stages (its ``response``)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


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


def _closing(response: web.Response) -> web.Response:
    """``response``, and its connection closed after it: an answer to a client that has not shown a key
    (refused, or a path that does not exist) must not leave it a connection to hold (keep-alive held one
    for ``idle_timeout_s`` after each 401, so about 70 such requests a second from one host held the
    whole connection bound and every tenant got 503)."""
    response.force_close()
    response.headers["Connection"] = "close"
    return response


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("kvfleet_gateway", Gateway)


async def _fallback(request: web.Request) -> web.Response:
    """404/405 as OpenAI-style JSON (a catch-all route is cheaper than a middleware on every request)."""
    return _closing(refusal_response(path_refusal(request.method, request.path)))


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
        await gateway.pipeline.warm_parse_workers()
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
