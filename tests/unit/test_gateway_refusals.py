"""One table of the gateway's refusals (gateway/refusals.py): each kind's status, OpenAI error and the
reason it is counted under, and the refusal each parsing error becomes."""

from __future__ import annotations

import pickle

import pytest

from kvfleet_runtime.gateway import refusals as r
from kvfleet_runtime.gateway.admission import RequestTooLarge, Throttled
from kvfleet_runtime.gateway.rewrite import BadRequest, ModelNotAllowed


def test_each_kind_is_answered_and_counted_as_the_dashboards_expect() -> None:
    table = {(k.status, k.code): (k.err_type, k.reason, k.outcome) for k in r.KINDS}
    assert table == {
        (401, "invalid_api_key"): ("invalid_request_error", "unauthenticated", "client_error"),
        (400, "invalid_api_key"): ("invalid_request_error", "bad_request", "client_error"),
        (403, "ambiguous_api_key"): ("permission_error", "ambiguous_api_key", "client_error"),
        (503, "gateway_busy"): ("service_unavailable", "gateway_busy", "unavailable"),
        (413, "body_too_large"): ("invalid_request_error", "body_too_large", "client_error"),
        (408, "body_timeout"): ("invalid_request_error", "body_timeout", "client_error"),
        (403, "model_not_allowed"): ("permission_error", "model_not_allowed", "client_error"),
        (400, "invalid_request"): ("invalid_request_error", "bad_request", "client_error"),
        (400, "request_too_large"): ("invalid_request_error", "request_too_large", "client_error"),
        (503, "no_healthy_replica"): ("service_unavailable", "no_healthy_replica", "unavailable"),
        (429, "rate_limited"): ("rate_limit_error", "rate_limited", "client_error"),
        (502, "upstream_failed"): ("upstream_error", "upstream_failed", "upstream_error"),
        (504, "upstream_timeout"): ("upstream_error", "upstream_timeout", "upstream_error"),
        (500, "gateway_misconfigured"): ("server_error", "gateway_misconfigured", "unavailable"),
        (404, "not_found"): ("invalid_request_error", "not_found", "client_error"),
        (405, "method_not_allowed"): ("invalid_request_error", "method_not_allowed", "client_error"),
    }
    # Only a limit the tenant went over is counted as a throttle (throttled_total, its own code).
    assert [k for k in r.KINDS if k.throttle] == [r.RATE_LIMITED]
    # A refusal that did not read the whole body closes the connection; a busy gateway says when to retry;
    # a 401 names the scheme (RFC 9110).
    assert dict(r.BODY_TOO_LARGE.headers) == dict(r.BODY_TIMEOUT.headers) == {"Connection": "close"}
    assert dict(r.GATEWAY_BUSY.headers) == {"Retry-After": "1"}
    assert dict(r.UNAUTHENTICATED.headers) == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ModelNotAllowed("model 'x' is not served to this key", "model"), r.MODEL_NOT_ALLOWED),
        (BadRequest("'messages' must be a list", "messages"), r.BAD_REQUEST),
        (RequestTooLarge("max_tokens exceeds the context", "max_tokens"), r.REQUEST_TOO_LARGE),
    ],
)
def test_a_parsing_error_becomes_its_refusal_with_its_message_and_param(
    error: BadRequest | RequestTooLarge, kind: r.RefusalKind
) -> None:
    # Raised in a parse worker, the error crosses a process boundary first.
    refusal = r.refusal_of(pickle.loads(pickle.dumps(error)))
    assert (refusal.kind, refusal.message, refusal.param) == (kind, error.message, error.param)


def test_a_limit_the_tenant_went_over_is_a_429_named_after_the_limit_with_when_to_retry() -> None:
    throttled = Throttled("tokens_per_minute", 2.2, "over the tenant's tokens per minute")
    refusal = r.refusal_of_throttle(throttled)
    assert (refusal.kind, refusal.code, refusal.message) == (
        r.RATE_LIMITED,
        "tokens_per_minute",
        "over the tenant's tokens per minute",
    )
    assert refusal.headers == {"Retry-After": "3"}  # whole seconds, rounded up


def test_a_refusal_carries_its_kinds_headers_and_its_own() -> None:
    refusal = r.Refusal(r.GATEWAY_BUSY, "busy", headers={"X-Extra": "1"})
    assert (refusal.code, refusal.headers) == ("gateway_busy", {"Retry-After": "1", "X-Extra": "1"})


def test_a_path_that_is_no_route_is_404_and_a_route_asked_with_another_method_is_405_naming_it() -> None:
    missing = r.path_refusal("GET", "/v1/embeddings")
    assert (missing.kind, missing.message) == (r.NOT_FOUND, "no such endpoint")
    wrong = r.path_refusal("GET", "/v1/chat/completions")
    assert wrong.kind is r.METHOD_NOT_ALLOWED and wrong.headers["Allow"] == "POST"
    assert "use POST" in wrong.message
