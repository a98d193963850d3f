"""Connection hygiene for the gateway's public socket: a bound on open connections, a header-read timeout.

aiohttp bounds the idle time between requests (its keep-alive timeout) and the server bounds the body
read (it reads bodies itself, after authentication), but nothing bounds the time a client takes to send
a request's *headers*: a client sending one header byte every few seconds keeps its connection, and a
file descriptor, for as long as it likes (slow-loris). ``GuardedSite`` is aiohttp's TCP site with every
connection wrapped in a ``_Guard`` protocol that:

* refuses a connection beyond ``max_connections`` with a ``503`` and closes it at once, so connections
  over the bound are never queued and the process's file descriptors stay bounded;
* refuses a connection beyond ``max_per_source`` from one source address the same way, so one host
  cannot hold the whole bound and shut every tenant out (0: no per-source bound; behind a proxy or a
  load balancer that does not keep client addresses, every client shares its address);
* gives each request ``header_timeout_s`` to deliver its headers, counted from accept for a connection's
  first request and from the request's first byte after that (Go's ``ReadHeaderTimeout``); a request
  that is late gets a ``408`` and its connection is closed;
* learns that a request's headers are complete when the blank line that ends them arrives, and that the
  connection is between requests when the app starts a response (``ConnectionGuards.response_prepared``,
  registered on the app), after which the next byte starts the next request's header clock;
* once ``closing`` is set (the gateway is draining on SIGTERM), marks every answer ``Connection: close``
  and closes its connection after it, so clients retire their keep-alive connections to this process
  between requests instead of finding them closed under a request they are sending.

The guard only looks for the end of the header block; aiohttp still parses everything, so what the
guard sees changes nothing but when a connection is closed. Deadlines are checked by one sweep of the
open connections every ``header_timeout_s / 5`` (at most a second) rather than by a timer per request:
a request pays for a clock read, and a late one is closed within that much of its deadline. A client
that keeps a connection open between requests without sending anything is closed by aiohttp's keep-alive
timeout (the server's ``idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("kvfleet.gateway")

_HEADERS, _REQUEST, _IDLE = 0, 1, 2


def _plain_response(status: str, message: str) -> bytes:
    body = (
        '{"error": {"message": "' + message + '", "type": "server_error", "param": null, "code": null}}'
    ).encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


_BUSY = _plain_response("503 Service Unavailable", "the gateway has too many open connections")
_SOURCE_BUSY = _plain_response(
    "503 Service Unavailable",
    "too many open connections from this address; close idle ones or reuse them (keep-alive)",
)
_HEADER_TIMEOUT = _plain_response("408 Request Timeout", "request headers not received in time")


class _OpenAIErrors(RequestHandler):
    """aiohttp's protocol, with the answers it writes itself in OpenAI's error shape: a request it cannot
    parse (bad request line, header, ``Content-Length`` or chunk, a header line over 8190 bytes: 400) and a
    handler that raised (500) or timed out (504); aiohttp writes those as text/plain. A malformed request
    is the client's mistake and is logged in one line at debug level (aiohttp logs each at ERROR with a
    traceback: a log amplifier for anyone who can reach the port); a handler's exception keeps its
    traceback."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: the answer has begun, the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response with the error")
        if status >= 500:
            if status == 500:
                self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text = "the gateway timed out handling the request" if status == 504 else "the gateway failed"
            err_type, code = "server_error", "internal_error"
        else:
            # aiohttp's message: a first line saying what is wrong, then the bytes with a caret under them.
            text = "malformed HTTP request: " + (message or "").strip().split("\n", 1)[0][:200]
            err_type, code = "invalid_request_error", "malformed_request"
            log.debug("malformed request from %s: %s", request.remote, text)
        body = {"error": {"message": text, "type": err_type, "param": None, "code": code}}
        response = web.Response(
            status=status, body=json.dumps(body).encode(), content_type="application/json"
        )
        response.force_close()
        return response


def _openai_errors(handler: RequestHandler) -> RequestHandler:
    """The connection's protocol as aiohttp's ``Server`` built it (its settings untouched), answering its
    own errors in OpenAI's shape. ``_OpenAIErrors`` adds no state (empty ``__slots__``), so changing the
    instance's class is all it takes and aiohttp's construction is not copied."""
    handler.__class__ = _OpenAIErrors
    return handler


class ConnectionGuards:
    """The guards of one listening socket: their settings, the open connections and what was closed.

    ``on_refused``, ``on_source_refused`` and ``on_header_timeout`` are called once per connection closed
    for that reason (the gateway counts them in its metrics). ``start`` and ``stop`` run the deadline
    sweep. ``max_per_source`` bounds the connections open from one source address (0: unbounded).
    """

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        on_refused: Callable[[], None] = lambda: None,
        on_header_timeout: Callable[[], None] = lambda: None,
        *,
        max_per_source: int = 0,
        on_source_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self.header_timeout_s = header_timeout_s
        self.on_refused = on_refused
        self.on_source_refused = on_source_refused
        self.on_header_timeout = on_header_timeout
        #: Open connections by source address (only while ``max_per_source`` is set).
        self.by_source: dict[str, int] = {}
        #: Open connections, by the aiohttp protocol each one wraps (how a request finds its guard).
        self.by_protocol: dict[object, _Guard] = {}
        self.sweep_interval_s = min(1.0, max(0.02, header_timeout_s / 5))
        self._sweeper: asyncio.TimerHandle | None = None
        self.time: Callable[[], float] = lambda: 0.0
        #: Draining: every answer closes its connection (see the module docstring).
        self.closing = False

    @property
    def open(self) -> int:
        return len(self.by_protocol)

    def reading(self) -> int:
        """Connections whose request has arrived (headers at least) and has no answer started yet."""
        return sum(1 for g in self.by_protocol.values() if g.state == _REQUEST)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.time = loop.time
        self._sweeper = loop.call_later(self.sweep_interval_s, self._sweep)

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep(self) -> None:
        now = self.time()
        for guard in [g for g in self.by_protocol.values() if g.deadline <= now]:
            guard.header_timeout()
        self._sweeper = asyncio.get_running_loop().call_later(self.sweep_interval_s, self._sweep)

    def response_prepared(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """For the app's ``on_response_prepare`` receiver to call (the gateway has one receiver for all it
        does there): the request's connection is between requests now (and, while draining, is closed
        after this answer)."""
        guard = self.by_protocol.get(request.protocol)
        if guard is not None and guard._state == _REQUEST:  # its next byte starts the next request
            guard._state = _IDLE
        if self.closing:
            # The headers are written after this hook, so the client is told; force_close makes
            # aiohttp close the connection when the answer ends.
            response.force_close()
            response.headers["Connection"] = "close"


class _Guard(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, the bound and the header clock around it."""

    __slots__ = (
        "_guards",
        "_inner",
        "_refused",
        "_source",
        "_started",
        "_state",
        "_tail",
        "_transport",
        "deadline",
    )

    def __init__(self, inner: Any, guards: ConnectionGuards) -> None:
        self._inner = inner
        self._guards = guards
        self._transport: asyncio.Transport | None = None
        self._state = _HEADERS
        #: When the headers being received are late (``inf`` while none are awaited).
        self.deadline = math.inf
        self._tail = b""
        self._started = False
        self._refused = False
        #: The source address counted in ``by_source`` (``None``: not counted).
        self._source: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass of it
        guards = self._guards
        if guards.open >= guards.max_connections:
            self._refuse(transport, _BUSY, guards.on_refused)
            return
        if guards.max_per_source:
            peer = transport.get_extra_info("peername")
            source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            count = guards.by_source.get(source, 0)
            if count >= guards.max_per_source:
                self._refuse(transport, _SOURCE_BUSY, guards.on_source_refused)
                return
            guards.by_source[source] = count + 1
            self._source = source
        guards.by_protocol[self._inner] = self
        self._begin_headers()
        self._inner.connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport, answer: bytes, count: Callable[[], None]) -> None:
        self._refused = True
        count()
        transport.write(answer)  # type: ignore[attr-defined]
        transport.close()

    def _begin_headers(self) -> None:
        self._state = _HEADERS
        self._tail = b""
        self._started = False
        self.deadline = self._guards.time() + self._guards.header_timeout_s

    def _end_headers(self) -> None:
        self._state = _REQUEST
        self._tail = b""
        self.deadline = math.inf

    @property
    def state(self) -> int:
        return self._state

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state != _REQUEST:
            if self._refused:
                return
            if state == _IDLE:
                if data[:1] not in b"\r\n" and (b"\r\n\r\n" in data or b"\n\n" in data):
                    # The usual next request on a keep-alive connection: its whole header block in one
                    # read. ``_begin_headers`` then ``_scan`` would end where this does (the header
                    # clock, the tail and the deadline are as ``_end_headers`` left them).
                    self._state = _REQUEST
                else:
                    self._begin_headers()
                    self._scan(data)
            else:
                self._scan(data)
        self._inner.data_received(data)

    def _scan(self, data: bytes) -> None:
        """Look for the blank line that ends the header block (CRLF, or bare LF, which aiohttp allows)."""
        if not self._started:
            data = data.lstrip(b"\r\n")  # empty lines before a request line are not a request yet
            if not data:
                return
            self._started = True
        if b"\r\n\r\n" in data or b"\n\n" in data:  # the usual case: a whole header block in one read
            self._end_headers()
            return
        seam = self._tail + data[:3]
        if b"\r\n\r\n" in seam or b"\n\n" in seam:
            self._end_headers()
        else:
            self._tail = (self._tail + data)[-3:]

    def header_timeout(self) -> None:
        """The sweep found this connection's headers late: answer 408 and close it."""
        self.deadline = math.inf
        transport = self._transport
        if self._state != _HEADERS or transport is None or transport.is_closing():
            return
        self._guards.on_header_timeout()
        transport.write(_HEADER_TIMEOUT)
        transport.close()

    def eof_received(self) -> bool | None:
        return None if self._refused else self._inner.eof_received()

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline = math.inf
        if self._refused:
            return
        guards = self._guards
        guards.by_protocol.pop(self._inner, None)
        source = self._source
        if source is not None:
            self._source = None
            left = guards.by_source[source] - 1
            if left:
                guards.by_source[source] = left
            else:
                del guards.by_source[source]
        self._inner.connection_lost(exc)


class GuardedSite(web.BaseSite):
    """aiohttp's ``TCPSite`` with every connection behind a ``_Guard`` (see the module docstring)."""

    __slots__ = ("_bound_port", "_guards", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, guards: ConnectionGuards, *, backlog: int = 2048
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guards = guards
        self._bound_port: int | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        guards = self._guards

        def wrapped() -> asyncio.Protocol:
            return _Guard(_openai_errors(server()), guards)

        self._server = await asyncio.get_running_loop().create_server(
            wrapped, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
        guards.start()

    async def stop(self) -> None:
        self._guards.stop()
        await super().stop()
