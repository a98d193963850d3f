"""How the gateway refuses a request it will not forward: one table from each kind of refusal to its HTTP
status, its OpenAI error (``type``, ``code``), the reason it is counted under and the headers it carries.

A stage that refuses raises ``Refusal(KIND, message)``; the request handler answers every refusal the same
way (``Gateway._refuse``: the error body, the tenant's ``x-ratelimit-*`` headers, ``rejected_total`` and
``requests_total`` counted). Limits a tenant went over are not refusals but 429s with their own headers
(``admission.Throttled``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_runtime.gateway.admission import RequestTooLarge
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
)


class Refusal(Exception):
    """A request refused as ``kind``; ``message`` (and ``param``) are safe to show the client."""

    def __init__(self, kind: RefusalKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param


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
