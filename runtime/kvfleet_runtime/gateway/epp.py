"""The Endpoint Picker: kvfleet's tenancy behind a platform's own gateway (Gateway API Inference Extension).

A GIE gateway (Envoy, Istio, kgateway, ...) opens one Envoy ``ext_proc`` stream per request to the EPP
named by an ``InferencePool`` and routes the request to the ``ip:port`` the EPP answers in the
``x-gateway-destination-endpoint`` header (and in the dynamic metadata ``envoy.lb``). This EPP runs the
same request pipeline as kvfleet's own gateway (``pipeline.py``), in the same order, so the same tenancy
holds behind either front door:

* request headers: stage 1, ``authenticate``, then ``open`` (the request rate); a refusal is an
  ``ImmediateResponse`` with the same status, OpenAI error body and headers as the aiohttp gateway's;
* request body (``FULL_DUPLEX_STREAMED``: chunks as they come; ``BUFFERED``: the whole body at once):
  held in the body budget, bounded in size and time; at its end ``parse`` (salt, priority, stripping),
  ``admit`` (the tenant's budget, the pool's fair queue: the stream waits there) and ``pick`` (affinity
  within the load bound, scoped by the salt, within the gateway's subset hint when it sends one);
* the answer: the request headers' response sets the destination, the tenant and request-id tags, and
  removes every client header the engine must not see (``Authorization`` first); the body's response is
  the rewritten body;
* response headers and body: the ``x-ratelimit-*`` headers are added; the body is relayed chunk by chunk
  (``FULL_DUPLEX_STREAMED``) with its ``usage`` read on the way (the usage-only SSE chunk the pipeline
  asked for is removed unless the client asked for it), which settles the request (``account``);
* the stream's end: ``finish`` (the slot released, outcome and duration counted), whenever it ends.

There is no path that skips tenancy: a request the EPP has not answered is never routed (the gateway is
configured FailClose: ``failure_mode_allow: false``), and a destination a client names itself is removed
by the gateway before the EPP is asked (``envoy.py``).

Counting usage needs the response body: every chunk of every answer crosses the gRPC stream twice (to the
EPP and back). What that costs is measured in docs/benchmarks.md (the Envoy front door).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.metrics import GatewayMetrics
from kvfleet_runtime.gateway.pipeline import (
    AdmittedRequest,
    OpenRequest,
    Pipeline,
    SseSplitter,
    UsageTracker,
    event_json,
    is_done_event,
)
from kvfleet_runtime.gateway.refusals import (
    BAD_REQUEST,
    BODY_TIMEOUT,
    MISCONFIGURED,
    NO_HEALTHY_REPLICA,
    UPSTREAM_FAILED,
    UPSTREAM_TIMEOUT,
    Refusal,
    path_refusal,
)
from kvfleet_runtime.gateway.rewrite import (
    FORWARDED_HEADERS,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    UPSTREAM_SESSION_HEADERS,
    Endpoint,
    build_request_id,
)
from kvfleet_runtime.gateway.routing import ReplicaState
from kvfleet_runtime.gateway.settings import GatewaySettings

log = logging.getLogger("kvfleet.gateway.epp")

#: Where the EPP tells the gateway which endpoint serves the request (GIE's protocol).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: The dynamic metadata namespace the destination is also written under.
DESTINATION_NAMESPACE = "envoy.lb"
#: Where a gateway sends the subset of endpoints the EPP must pick from.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: The gRPC service name the EPP's health reports under (and "" for the whole server).
SERVICE_NAME = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
#: Headers the gateway itself owns or cannot have removed: never in the removal list.
_KEPT = frozenset(
    {"host", "content-length", "transfer-encoding", "te"} | {h.lower() for h in FORWARDED_HEADERS}
)
_ENDPOINTS = {e.value: e for e in Endpoint}
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_MODES = processing_mode_pb2.ProcessingMode
#: The request body modes the EPP speaks: the whole body is needed before anything is decided.
FULL_DUPLEX = _MODES.FULL_DUPLEX_STREAMED
BUFFERED = _MODES.BUFFERED
#: Envoy's ``response.code_details`` of answers that did not fail on the engine: the engine's own
#: (``via_upstream``), and the gateway's replies for a request its routes do not send to the engines (a
#: platform gateway routes other hosts and paths; the ext_proc filter may still have seen the request).
_NOT_THE_ENGINE = frozenset({"via_upstream", "route_not_found", "direct_response"})


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _headers_of(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """The headers Envoy sent, lower-cased names (it sends values as ``raw_value`` bytes, or ``value``)."""
    found: dict[str, str] = {}
    for h in message.headers.headers:
        found[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return found


def immediate(refusal: Refusal, extra: dict[str, str] | None = None) -> ext_proc.ProcessingResponse:
    """The refusal as the gateway's answer to the client: the same status, OpenAI error body and headers
    as the aiohttp front door's (``server.refusal_response``)."""
    kind = refusal.kind
    body = {
        "error": {
            "message": refusal.message,
            "type": kind.err_type,
            "param": refusal.param,
            "code": refusal.code,
        }
    }
    headers = {**(extra or {}), **refusal.headers, "content-type": "application/json"}
    headers.pop("Connection", None)  # a connection-level header: the gateway decides about its connections
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=kind.status),
            headers=ext_proc.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
            body=json.dumps(body).encode(),
            details=f"kvfleet_{refusal.code}",
        )
    )


def _attribute(request: ext_proc.ProcessingRequest, name: str) -> str:
    """One of the attributes the gateway sends with a message (``response_attributes``), as text."""
    attributes = request.attributes.get("envoy.filters.http.ext_proc")
    if attributes is None or name not in attributes.fields:
        return ""
    value = attributes.fields[name]
    return value.string_value if value.HasField("string_value") else ""


def _subset_hint(metadata: base_pb2.Metadata) -> set[str] | None:
    """The ``ip:port`` endpoints the gateway allows, when it says (GIE's subset hint)."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    return {item.string_value for item in value.list_value.values}


class Destinations:
    """Replica URL -> ``ip:port`` (what Envoy's original-destination cluster takes); host names are
    resolved and kept for ``ttl_s``."""

    def __init__(self, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self._known: dict[str, tuple[str, float]] = {}

    async def of(self, url: str) -> str:
        cached = self._known.get(url)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            address = ipaddress.ip_address(infos[0][4][0])
        found = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
        self._known[url] = (found, now + self.ttl_s)
        return found


@dataclass(slots=True)
class _Exchange:
    """One request's stream: what the pipeline has decided so far."""

    arrived: float
    #: How the gateway sends bodies (``protocol_config`` on the first message; GIE's default without it).
    request_mode: int = FULL_DUPLEX
    response_mode: int = FULL_DUPLEX
    endpoint: Endpoint | None = None
    headers: dict[str, str] | None = None
    opened: OpenRequest | None = None
    body: bytearray | None = None
    subset: set[str] | None = None
    admitted: AdmittedRequest | None = None
    #: The tenant's rate-limit headers as they stood when the request was admitted (what the aiohttp door
    #: sends too): read at the answer, a limit's window would have refilled while the engine worked.
    limit_headers: dict[str, str] | None = None
    replica: ReplicaState | None = None
    #: What the request is counted as if its stream ends now (set once its answer is complete).
    outcome: str = "cancelled"
    #: What the answer's status says the outcome will be once its body is complete.
    answer_outcome: str = "ok"
    status: int = 0
    usage: UsageTracker | None = None
    sse: SseSplitter | None = None
    buffered: bytearray | None = None
    done_event: bool = False
    last_chunk_at: float | None = None
    finished: bool = False
    #: Who the answer is counted for (``responses_total``), once the key is known; and whether the path is
    #: the API's (``/v1/``), the only answers the aiohttp door counts there too.
    tenant: str = m.UNAUTHENTICATED
    api: bool = False


class EndpointPicker:
    """The ``ExternalProcessor`` service: one ``Process`` stream per request."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.settings = pipeline.settings
        self.destinations = Destinations()
        #: Requests between their first message and their stream's end.
        self.in_flight = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange(time.perf_counter())
        messages: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()
        pump = asyncio.create_task(_pump(request_iterator, messages))
        self.in_flight += 1
        try:
            deadline: float | None = None
            while True:
                if exchange.opened is not None and exchange.admitted is None:
                    deadline = deadline or asyncio.get_running_loop().time() + self.settings.body_timeout_s
                    try:
                        async with asyncio.timeout_at(deadline):
                            message = await messages.get()
                    except TimeoutError:
                        message = None
                        seconds = self.settings.body_timeout_s
                        refusal = Refusal(BODY_TIMEOUT, f"request body not received within {seconds:g} s")
                        yield self._refuse(exchange, refusal)
                        return
                else:
                    message = await messages.get()
                if message is None:
                    return
                answers, finished = await self._step(exchange, message)
                for answer in answers:
                    yield answer
                if finished:
                    return
        finally:
            pump.cancel()
            self.in_flight -= 1
            self._end(exchange)

    async def _step(
        self, exchange: _Exchange, message: ext_proc.ProcessingRequest
    ) -> tuple[list[ext_proc.ProcessingResponse], bool]:
        """The answers to one message from the gateway, and whether the exchange is over."""
        which = message.WhichOneof("request")
        try:
            if which == "request_headers":
                return self._on_request_headers(exchange, message), False
            if which == "request_body":
                return await self._on_request_body(exchange, message.request_body), False
            if which == "request_trailers":
                return [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())], False
            if which == "response_headers":
                return self._on_response_headers(exchange, message), False
            if which == "response_body":
                return self._on_response_body(exchange, message.response_body), False
            if which == "response_trailers":
                return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())], False
        except Refusal as refusal:
            return [self._refuse(exchange, refusal)], True
        return [], False

    # -- the request ---------------------------------------------------------------------------------
    def _on_request_headers(
        self, exchange: _Exchange, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        pipeline = self.pipeline
        if message.HasField("protocol_config"):
            exchange.request_mode = message.protocol_config.request_body_mode
            exchange.response_mode = message.protocol_config.response_body_mode
        headers = _headers_of(message.request_headers)
        exchange.headers = headers
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        exchange.api = path.startswith("/v1/")
        tenant = pipeline.authenticate(headers.get("authorization"))  # stage 1 (refusals counted)
        exchange.tenant = tenant.name
        if path == "/v1/models" and method == "GET":
            self._answered(exchange, 200)
            return [self._models(tenant)]
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None or method != "POST":
            raise path_refusal(method, path)
        if exchange.request_mode not in (FULL_DUPLEX, BUFFERED):
            mode = _MODES.BodySendMode.Name(exchange.request_mode)
            raise Refusal(
                MISCONFIGURED,
                f"the gateway sends request bodies to the endpoint picker as {mode}; configure its ext_proc "
                "processing mode with request body FULL_DUPLEX_STREAMED (GIE's default) or BUFFERED",
            )
        exchange.endpoint = endpoint
        exchange.subset = _subset_hint(message.metadata_context)
        exchange.opened = pipeline.open(tenant, exchange.arrived)  # stage 2 (refusals counted)
        if message.request_headers.end_of_stream:
            raise Refusal(BAD_REQUEST, "the request body is empty; send a JSON object")
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.settings.max_body_bytes:
                raise pipeline.body_too_large()
            pipeline.hold_body(exchange.opened, int(length))
        exchange.body = bytearray()
        if exchange.request_mode == FULL_DUPLEX:
            return []  # the headers are answered with the destination once the body is complete
        # Buffered: the gateway waits for this answer before it sends the body; the destination and
        # the other header changes go with the body's answer.
        return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]

    async def _on_request_body(
        self, exchange: _Exchange, body: ext_proc.HttpBody
    ) -> list[ext_proc.ProcessingResponse]:
        pipeline = self.pipeline
        opened, buffer = exchange.opened, exchange.body
        if opened is None or buffer is None or exchange.admitted is not None:
            raise Refusal(BAD_REQUEST, "a request body arrived outside a request")
        chunk = body.body
        if len(buffer) + len(chunk) > self.settings.max_body_bytes:
            raise pipeline.body_too_large()
        announced = exchange.headers is not None and "content-length" in exchange.headers
        if not announced:
            pipeline.hold_body(opened, len(chunk))
        buffer += chunk
        if not body.end_of_stream:
            return []
        pipeline.check_body_complete(len(buffer), None)
        assert exchange.endpoint is not None
        try:
            prepared = await pipeline.parse(opened, buffer, exchange.endpoint)  # stage 3
        except Refusal as refusal:
            pipeline.refused(refusal, opened.tenant, m.UNKNOWN_MODEL)
            raise
        exchange.body = None
        admitted = await pipeline.admit(opened, prepared)  # stage 4 (refusals counted)
        exchange.admitted = admitted
        exchange.limit_headers = admitted.gate.rate_limit_headers()
        exchange.usage = UsageTracker()
        await pipeline.plan_route(admitted)
        replica = await self._pick(exchange, admitted)  # stage 5
        exchange.replica = replica
        replica.in_flight += 1
        opened.reservation.release()  # handed to the gateway
        destination = await self.destinations.of(replica.url)
        tenant = admitted.tenant
        set_headers = [
            _header(DESTINATION_HEADER, destination),
            _header(TENANT_HEADER, tenant.name),
            _header(REQUEST_ID_HEADER, build_request_id(tenant.name)),
            _header("content-length", str(len(prepared.payload))),
            _header("content-type", "application/json"),
            *(_header(k, v) for k, v in UPSTREAM_SESSION_HEADERS.items()),
        ]
        incoming = exchange.headers or {}
        remove = [k for k in incoming if not k.startswith(":") and k not in _KEPT and k != DESTINATION_HEADER]
        metadata = struct_pb2.Struct()
        metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: destination}})
        mutation = ext_proc.HeaderMutation(set_headers=set_headers, remove_headers=remove)
        if exchange.request_mode == BUFFERED:
            return [
                ext_proc.ProcessingResponse(
                    request_body=ext_proc.BodyResponse(
                        response=ext_proc.CommonResponse(
                            header_mutation=mutation,
                            body_mutation=ext_proc.BodyMutation(body=prepared.payload),
                        )
                    ),
                    dynamic_metadata=metadata,
                )
            ]
        return [
            ext_proc.ProcessingResponse(
                request_headers=ext_proc.HeadersResponse(
                    response=ext_proc.CommonResponse(header_mutation=mutation)
                ),
                dynamic_metadata=metadata,
            ),
            ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(
                    response=ext_proc.CommonResponse(
                        body_mutation=ext_proc.BodyMutation(
                            streamed_response=ext_proc.StreamedBodyResponse(
                                body=prepared.payload, end_of_stream=True
                            )
                        )
                    )
                )
            ),
        ]

    async def _pick(self, exchange: _Exchange, admitted: AdmittedRequest) -> ReplicaState:
        """Stage 5 within the gateway's subset hint (a replica outside it is skipped); a request no
        replica can take is settled at nothing and refused (503)."""
        tried: set[str] = set()
        try:
            while True:
                replica = self.pipeline.pick(admitted, tried)
                if exchange.subset is None or await self.destinations.of(replica.url) in exchange.subset:
                    return replica
                tried.add(replica.url)
        except Refusal as failed:
            refusal = failed
            if exchange.subset is not None and tried:
                refusal = Refusal(NO_HEALTHY_REPLICA, "no healthy engine replica among the gateway's subset")
            self.pipeline.unavailable(admitted, refusal)
            exchange.outcome = "unavailable"
            self.pipeline.account(admitted, UsageTracker(), "unavailable")
            refusal.counted = True
            raise refusal from None

    # -- the answer ----------------------------------------------------------------------------------
    def _on_response_headers(
        self, exchange: _Exchange, request: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        message = request.response_headers
        details = _attribute(request, "response.code_details")
        if details and details not in _NOT_THE_ENGINE and exchange.admitted is not None:
            raise self._gateway_failed(exchange, details)
        headers = _headers_of(message)
        status = int(headers.get(":status", "0") or 0)
        exchange.status = status
        self._answered(exchange, status)
        admitted = exchange.admitted
        set_headers: list[base_pb2.HeaderValueOption] = []
        if admitted is not None:
            set_headers = [_header(k, v) for k, v in (exchange.limit_headers or {}).items()]

            exchange.answer_outcome = (
                "ok" if status == 200 else "upstream_error" if status >= 500 else "client_error"
            )
            if status >= 500:
                self.pipeline.metrics.upstream_errors.labels(admitted.tenant.pool.name, "status_5xx").inc()
            if admitted.prepared.stream and status == 200:
                exchange.sse = SseSplitter()
            else:
                exchange.buffered = bytearray()
            if message.end_of_stream:
                exchange.outcome = exchange.answer_outcome
                self._finish(exchange)
        return [
            ext_proc.ProcessingResponse(
                response_headers=ext_proc.HeadersResponse(
                    response=ext_proc.CommonResponse(
                        header_mutation=ext_proc.HeaderMutation(set_headers=set_headers)
                    )
                )
            )
        ]

    def _gateway_failed(self, exchange: _Exchange, details: str) -> Refusal:
        """The gateway answered instead of the engine (Envoy's ``response.code_details`` other than
        ``via_upstream``): the replica is marked down (the connection was refused: nothing was sent) or
        suspected (a reset or timeout after the request may have reached it), and the client gets the
        same error as from the aiohttp door. No fail-over within the request: the gateway's cluster has the
        one destination the EPP named; the next request is picked among the replicas still healthy."""
        admitted, replica = exchange.admitted, exchange.replica
        assert admitted is not None
        pool = admitted.tenant.pool.name
        refused = "connection_failure" in details or ("connect" in details and "reset" not in details)
        timed_out = "timeout" in details
        metrics = self.pipeline.metrics
        if refused:
            metrics.upstream_errors.labels(pool, "connect").inc()
            exchange.outcome = "unavailable"
            refusal = Refusal(
                NO_HEALTHY_REPLICA,
                "the engine replica did not accept the connection; nothing was sent, retry",
                headers={"Retry-After": "1"},
            )
            self.pipeline.unavailable(admitted, refusal)
            if replica is not None:
                log.warning(
                    "replica %s of pool %s refused or did not accept a connection (%s); marked down",
                    replica.url,
                    pool,
                    details[:80],
                )
                self.pipeline.mark_down(pool, replica, "connect failed behind the gateway")
        else:
            metrics.upstream_errors.labels(pool, "timeout" if timed_out else "disconnect").inc()
            exchange.outcome = "upstream_error"
            kind = UPSTREAM_TIMEOUT if timed_out else UPSTREAM_FAILED
            refusal = Refusal(
                kind,
                "the engine did not answer in time; the request was not retried because the engine may have "
                "received it"
                if timed_out
                else "the engine connection failed before it answered; the request was not retried because "
                "the engine may have received it",
            )
            if replica is not None:
                self.pipeline.suspect(pool, replica, f"failed behind the gateway: {details[:80]}")
        refusal.counted = True
        self._settle(exchange)
        self._finish(exchange)
        return refusal

    def _on_response_body(
        self, exchange: _Exchange, body: ext_proc.HttpBody
    ) -> list[ext_proc.ProcessingResponse]:
        chunk = body.body
        out = chunk
        admitted, usage = exchange.admitted, exchange.usage
        if admitted is not None and usage is not None:
            if exchange.sse is not None:
                out = self._relay_events(exchange, admitted, usage, exchange.sse.feed(chunk) or [])
            elif exchange.buffered is not None and exchange.status == 200:
                exchange.buffered += chunk
            if body.end_of_stream:
                if exchange.buffered is not None and exchange.status == 200:
                    with contextlib.suppress(ValueError):
                        usage.take(json.loads(exchange.buffered))
                exchange.outcome = exchange.answer_outcome
                if exchange.sse is not None and not exchange.done_event:
                    exchange.outcome = "upstream_error"  # the stream ended without its last event
                self._finish(exchange)  # before the last chunk reaches the client, as the aiohttp door
        if exchange.response_mode == FULL_DUPLEX:  # every chunk goes back, changed or not
            streamed = ext_proc.StreamedBodyResponse(body=out, end_of_stream=body.end_of_stream)
            mutation = ext_proc.BodyMutation(streamed_response=streamed)
        elif out is not chunk:  # streamed or buffered: only a chunk that changed is replaced
            mutation = ext_proc.BodyMutation(body=out)
        else:
            mutation = None
        return [
            ext_proc.ProcessingResponse(
                response_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
            )
        ]

    def _relay_events(
        self, exchange: _Exchange, admitted: AdmittedRequest, usage: UsageTracker, events: Iterable[bytes]
    ) -> bytes:
        """The complete events of a chunk, as the aiohttp front door relays them (``server._relay_events``):
        usage read, the pipeline's usage-only chunk removed unless the client asked for usage."""
        keep: list[bytes] = []
        for event in events:
            if b'"prompt_tokens"' in event:
                payload = event_json(event)
                usage.take(payload)
                if (
                    not admitted.prepared.client_wants_usage
                    and isinstance(payload, dict)
                    and not payload.get("choices")
                ):
                    continue
            elif is_done_event(event):
                exchange.done_event = True
            keep.append(event)
        if keep:
            now = time.perf_counter()
            if exchange.last_chunk_at is None:
                admitted.series.ttft.observe(now - admitted.arrived)
            else:
                admitted.series.itl.observe(now - exchange.last_chunk_at)
            exchange.last_chunk_at = now
        return b"".join(keep)

    def _settle(self, exchange: _Exchange) -> None:
        admitted, usage = exchange.admitted, exchange.usage
        if admitted is not None and usage is not None:
            self.pipeline.account(admitted, usage, exchange.outcome)
            exchange.usage = None

    # -- refusals and the end ------------------------------------------------------------------------
    def _refuse(self, exchange: _Exchange, refusal: Refusal) -> ext_proc.ProcessingResponse:
        """The refusal's answer; what the request holds is given back before the client can see it."""
        opened = exchange.opened
        if opened is not None:
            opened.reservation.release()
        if opened is not None and not refusal.counted:
            # Refusals of the stages that do not count their own (body bounds, the request's shape).
            self.pipeline.refused(refusal, opened.tenant, m.UNKNOWN_MODEL)
        extra = opened.gate.rate_limit_headers() if opened is not None else None
        self._answered(exchange, refusal.kind.status)
        return immediate(refusal, extra)

    def _answered(self, exchange: _Exchange, status: int) -> None:
        """Count one answer by tenant and status (metering), as the aiohttp door does for ``/v1/``."""
        if exchange.api:
            self.pipeline.metrics.count_response(exchange.tenant, status)

    def _models(self, tenant: Any) -> ext_proc.ProcessingResponse:
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvfleet"}
            for model in sorted(tenant.models)
        ]
        headers = {**self.pipeline.limit_headers(tenant), "content-type": "application/json"}
        return ext_proc.ProcessingResponse(
            immediate_response=ext_proc.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=200),
                headers=ext_proc.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
                body=json.dumps({"object": "list", "data": data}).encode(),
            )
        )

    def _finish(self, exchange: _Exchange) -> None:
        """The answer is complete (or the stream ended): settled, the slot released, counted; once."""
        if exchange.finished:
            return
        exchange.finished = True
        if exchange.replica is not None:
            exchange.replica.in_flight -= 1
        admitted = exchange.admitted
        if admitted is None:
            return
        if exchange.outcome != "cancelled":
            self._settle(exchange)
        self.pipeline.finish(admitted, exchange.outcome)

    def _end(self, exchange: _Exchange) -> None:
        """The stream is over, however it ended: what it still holds is given back, and it is counted."""
        if exchange.opened is not None:
            exchange.opened.reservation.release()
        self._finish(exchange)


async def _pump(
    requests: AsyncIterator[ext_proc.ProcessingRequest],
    into: asyncio.Queue[ext_proc.ProcessingRequest | None],
) -> None:
    """The gateway's messages into a queue (so a body that stops coming can time out), then None."""
    try:
        async for message in requests:
            into.put_nowait(message)
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        pass
    finally:
        into.put_nowait(None)


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """TLS for the EPP's port from a certificate and key (PEM), as the gateway's ext_proc client expects."""
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])


@contextlib.asynccontextmanager
async def running_epp(
    settings: GatewaySettings,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics: GatewayMetrics | None = None,
    *,
    metrics_port: int = 0,
    tls: tuple[Path, Path] | None = None,
) -> AsyncIterator[tuple[str, EndpointPicker, str]]:
    """Start the pipeline and the EPP on ``host:port`` (0: a free port; with ``tls`` (cert, key): TLS),
    gRPC health serving, and ``/metrics`` on ``metrics_port``; yield the gRPC address, the picker and the
    metrics URL; stop them."""
    pipeline = Pipeline(settings, metrics)
    await pipeline.start()
    picker = EndpointPicker(pipeline)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", settings.max_body_bytes + 65536)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, server_credentials(*tls))
        if tls
        else server.add_insecure_port(address)
    )
    metrics_runner = web.AppRunner(_metrics_app(pipeline), access_log=None)
    try:
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        await metrics_runner.setup()
        site = web.TCPSite(metrics_runner, host, metrics_port)
        await site.start()
        metrics_url = f"http://{host}:{metrics_runner.addresses[0][1]}"
        yield f"{host}:{bound}", picker, metrics_url
    finally:
        await server.stop(grace=1.0)
        await metrics_runner.cleanup()
        await pipeline.stop()


def _metrics_app(pipeline: Pipeline) -> web.Application:
    async def handle(_request: web.Request) -> web.Response:
        payload = generate_latest(pipeline.metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    return app
