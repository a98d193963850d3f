"""How the gateway refuses a request, or fails one it forwarded: one table from each kind to its HTTP
status, its OpenAI error (``type``, ``code``), the reason it is counted under and the headers it carries.

A stage of the request pipeline (``pipeline.py``) that refuses raises ``Refusal(KIND, message)``; every
front door answers every refusal the same way (the error body, the tenant's ``x-ratelimit-*`` headers) and
the pipeline counts it (``Pipeline.refused``: ``rejected_total`` and ``requests_total``, or, for a limit
the tenant went over, ``throttled_total``). A limit's 429 carries its own code (the limit's name) and
``Retry-After`` (``refusal_of_throttle``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_runtime.gateway.admission import RequestTooLarge, Throttled
from kvfleet_runtime.gateway.rewrite import BadRequest, ModelNotAllowed


@dataclass(frozen=True)
class RefusalKind:
    """One kind of refusal: what the client gets and how it is counted."""

    status: int
    #: OpenAI's error ``type`` and ``code`` (``{"error": {"message", "type", "param", "code"}}``).
    err_type: str
    code: str
    #: ``kvfleet_gateway_rejected_total``'s ``reason`` (dashboards and alerts read these values).
    reason: str
    #: ``kvfleet_gateway_requests_total``'s ``outcome``: the client's fault, or the gateway's state.
    outcome: str = "client_error"
    headers: tuple[tuple[str, str], ...] = ()
    #: A limit the tenant went over: counted in ``throttled_total`` under the refusal's own code.
    throttle: bool = False


#: No key, a key no tenant holds, or a key whose tenant left the table while its request was read.
UNAUTHENTICATED = RefusalKind(
    401,
    "invalid_request_error",
    "invalid_api_key",
    "unauthenticated",
    headers=(("WWW-Authenticate", "Bearer"),),
)
#: An ``Authorization`` header that is not text.
MALFORMED_KEY = RefusalKind(400, "invalid_request_error", "invalid_api_key", "bad_request")
#: A key listed by two tenants: refused for both, never routed.
AMBIGUOUS_KEY = RefusalKind(403, "permission_error", "ambiguous_api_key", "ambiguous_api_key")
#: No room for the body in the process's budget, or no body-parsing worker: retry shortly.
GATEWAY_BUSY = RefusalKind(
    503, "service_unavailable", "gateway_busy", "gateway_busy", "unavailable", (("Retry-After", "1"),)
)
#: The connection closes after these: the rest of the body is not read.
BODY_TOO_LARGE = RefusalKind(
    413, "invalid_request_error", "body_too_large", "body_too_large", headers=(("Connection", "close"),)
)
BODY_TIMEOUT = RefusalKind(
    408, "invalid_request_error", "body_timeout", "body_timeout", headers=(("Connection", "close"),)
)
MODEL_NOT_ALLOWED = RefusalKind(403, "permission_error", "model_not_allowed", "model_not_allowed")
BAD_REQUEST = RefusalKind(400, "invalid_request_error", "invalid_request", "bad_request")
#: A request that can never run within the tenant's limits (its context, its KV burst cap).
REQUEST_TOO_LARGE = RefusalKind(400, "invalid_request_error", "request_too_large", "request_too_large")
#: No replica of the tenant's pool is healthy, or none accepted a connection: nothing was sent.
NO_HEALTHY_REPLICA = RefusalKind(
    503, "service_unavailable", "no_healthy_replica", "no_healthy_replica", "unavailable"
)

#: A tenant's limit (requests or tokens per minute, concurrency, queue, body bytes): the code names it.
RATE_LIMITED = RefusalKind(429, "rate_limit_error", "rate_limited", "rate_limited", throttle=True)
#: The engine connection failed after the request may have reached it: not retried (never run twice).
UPSTREAM_FAILED = RefusalKind(502, "upstream_error", "upstream_failed", "upstream_failed", "upstream_error")
#: The engine sent nothing within the upstream timeout: not retried either.
UPSTREAM_TIMEOUT = RefusalKind(
    504, "upstream_error", "upstream_timeout", "upstream_timeout", "upstream_error"
)

#: A path that is not an endpoint of the model deployment, or a method its endpoint does not take.
NOT_FOUND = RefusalKind(
    404, "invalid_request_error", "not_found", "not_found", headers=(("Connection", "close"),)
)
METHOD_NOT_ALLOWED = RefusalKind(
    405,
    "invalid_request_error",
    "method_not_allowed",
    "method_not_allowed",
    headers=(("Connection", "close"),),
)
#: The platform's gateway calls the Endpoint Picker in a way it cannot serve (a body mode it does not speak).
MISCONFIGURED = RefusalKind(
    500, "server_error", "gateway_misconfigured", "gateway_misconfigured", "unavailable"
)

#: Every kind, for the tests and the docs.
KINDS = (
    UNAUTHENTICATED,
    MALFORMED_KEY,
    AMBIGUOUS_KEY,
    GATEWAY_BUSY,
    BODY_TOO_LARGE,
    BODY_TIMEOUT,
    MODEL_NOT_ALLOWED,
    BAD_REQUEST,
    REQUEST_TOO_LARGE,
    NO_HEALTHY_REPLICA,
    RATE_LIMITED,
    UPSTREAM_FAILED,
    UPSTREAM_TIMEOUT,
    MISCONFIGURED,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
)


class Refusal(Exception):
    """A request refused as ``kind``; ``message`` (and ``param``) are safe to show the client. ``code``
    replaces the kind's (a limit's 429 names the limit); ``headers`` are added to the kind's."""

    def __init__(
        self,
        kind: RefusalKind,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code or kind.code
        self.headers = {**dict(kind.headers), **(headers or {})}
        #: Set once the pipeline has counted it (``Pipeline.refused``), so no front door counts it twice.
        self.counted = False


def refusal_of_throttle(exc: Throttled) -> Refusal:
    """The 429 for a limit the tenant went over: its reason as the code, and when to retry."""
    return Refusal(
        RATE_LIMITED, exc.message, code=exc.reason, headers={"Retry-After": exc.retry_after_header}
    )


def refusal_of(exc: BadRequest | RequestTooLarge) -> Refusal:
    """The refusal for what parsing and budgeting a body raised (they run in worker processes too, so
    they raise their own picklable errors)."""
    if isinstance(exc, ModelNotAllowed):
        kind = MODEL_NOT_ALLOWED
    elif isinstance(exc, RequestTooLarge):
        kind = REQUEST_TOO_LARGE
    else:
        kind = BAD_REQUEST
    return Refusal(kind, exc.message, exc.param)


#: The routes of the public API and their one method (the aiohttp door also serves its probes there).
ROUTES: dict[str, str] = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/healthz": "GET",
    "/readyz": "GET",
}


def path_refusal(method: str, path: str) -> Refusal:
    """404 for a path that is no route, 405 (with ``Allow``) for a route asked with another method."""
    allowed = ROUTES.get(path)
    if allowed is None:
        return Refusal(NOT_FOUND, "no such endpoint")
    return Refusal(
        METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}; use {allowed}", headers={"Allow": allowed}
    )
