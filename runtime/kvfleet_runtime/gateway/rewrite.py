"""Pure request handling: decoding, validation, the token estimate, and the rewrite that carries the tenant.

``prepare_request`` is the whole of it, from the raw body to the bytes sent upstream; it is pure and
picklable, so the server runs it inline for small bodies and in a worker process for large ones (a large
body's parse then never holds the event loop that serves every other tenant).

What the gateway accepts: a JSON object, valid UTF-8 (no lone surrogates, escaped or not), nested at most
``MAX_JSON_DEPTH`` levels, at most ``MAX_SEQUENCES`` sequences (``n``, ``best_of``), media parts whose URL
is ``data:`` or an http(s) URL on a host the platform allows (``check_media_urls``); anything else is a
400 with a message saying what is wrong.

What the gateway changes in a client's request before it reaches vLLM (vLLM 0.32 OpenAI server):

Body fields removed (client values could break isolation, jump the queue, or pick a replica/KV source):
  ``cache_salt``, ``priority``, ``request_id``, ``session_id``, ``vllm_xargs``, ``kv_transfer_params``,
  ``ec_transfer_params``, ``data_parallel_rank``.
Headers: only ``Content-Type`` and ``Accept`` are forwarded, so client ``X-Vllm-Priority`` (overrides the
  body priority in vLLM), ``X-Request-Id``, ``X-Session-ID``, ``X-data-parallel-rank`` and
  ``Authorization`` never reach the engine.
Body fields set:
  ``cache_salt``  HMAC-SHA256(salt key, tenant.salt_id)[:32] (shared tenants: the pool salt id);
  ``priority``    the tenant's ``priority`` from the table (vLLM serves lower values first);
  ``vllm_xargs``  ``{"kvfleet_tenant": <tenant>}``: vLLM copies it into ``SamplingParams.extra_args``,
                  which the engine core's ``Request`` carries, so a plugin can read the tenant directly;
  ``stream_options.include_usage`` true on streams, so usage can be reconciled (the usage-only chunk is
                  removed again when the client did not ask for it);
  ``max_tokens``  only when the client sent neither ``max_tokens`` nor ``max_completion_tokens``: the
                  most each sequence may generate within the tenant's limits
                  (``admission.plan_request_budget``).
Headers set:
  ``X-Request-Id: kvf_<tenant>_<32 hex>``: vLLM uses it as the request id base, so the engine request id
                  is ``chatcmpl-kvf_<tenant>_<hex>-<8 random>`` (``cmpl-`` for completions, and
                  ``_<i>`` before the random part for each of ``n > 1`` choices);
                  ``parse_tenant_from_request_id`` recovers the tenant (``_`` never occurs in a
                  Kubernetes name, so the separators are unambiguous);
  ``X-Kvfleet-Tenant: <tenant>``: for proxies and logs in between (vLLM ignores it).
The salt -> tenant map (``config.salt_to_tenants``) stays the primary attribution; the tags above let a
plugin tell apart ``shared`` tenants, which share one salt.

Token estimate (before the engine answers): over every string in ``messages`` (chat) or ``prompt``
(completions), ceil(ASCII characters / 4) plus one token per other character (scripts such as CJK take
about a token per character; counting them at a quarter would let a prompt hold four times the KV its
budget says), one token per element of a token-id prompt, plus a small per-message overhead for the chat
template. It is reconciled with ``usage`` afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

from kvfleet_runtime.gateway.admission import BudgetLimits, RequestBudget, plan_request_budget

STRIPPED_BODY_FIELDS: Final = (
    "cache_salt",
    "priority",
    "request_id",
    "session_id",
    "vllm_xargs",
    "kv_transfer_params",
    "ec_transfer_params",
    "data_parallel_rank",
)
FORWARDED_HEADERS: Final = ("Content-Type", "Accept")
TENANT_HEADER: Final = "X-Kvfleet-Tenant"
REQUEST_ID_HEADER: Final = "X-Request-Id"
#: Headers on every request the gateway sends an engine (its client session's defaults): its own
#: ``User-Agent`` (no library or Python version), and ``Accept-Encoding: identity``, since answers are
#: relayed as they come, without their ``Content-Encoding``, so an engine must not compress them. With
#: both set, aiohttp adds neither default itself, which is the cheap way through its request path.
UPSTREAM_SESSION_HEADERS: Final = {"User-Agent": "kvfleet-gateway", "Accept-Encoding": "identity"}
TENANT_XARG: Final = "kvfleet_tenant"
REQUEST_ID_PREFIX: Final = "kvf_"
#: Chat templates add a few tokens per message (role markers); counted so the estimate is not low.
CHAT_MESSAGE_OVERHEAD_TOKENS: Final = 4
CHARS_PER_TOKEN: Final = 4
#: Keys of a chat content part whose URL vLLM fetches (vLLM 0.32 ``renderers/chat_utils.py``
#: ``MM_PARSER_MAP`` and its untyped-part fallbacks; ``input_image`` carries its URL in ``image_url``).
MEDIA_URL_KEYS: Final = ("image_url", "audio_url", "video_url")
#: Deepest JSON nesting accepted (a chat request with content parts nests about five levels).
MAX_JSON_DEPTH: Final = 64
#: Most sequences one request may ask for (``n``, ``best_of``).
MAX_SEQUENCES: Final = 128

_REQUEST_ID_RE = re.compile(r"(?:^|-)kvf_([a-z0-9][a-z0-9.-]*)_[0-9a-f]{32}(?:[-_]|$)")
#: ``build_request_id``'s random per-process half, and its counter.
_REQUEST_ID_PROCESS: Final = os.urandom(8).hex()
_request_count = itertools.count()
#: The upstream body's serialiser, built once (``json.dumps`` with these options builds one per call).
_UPSTREAM_JSON: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


class BadRequest(ValueError):
    """The body is not a request the gateway can forward; the message is safe to show the client."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses the parse workers' process boundary
        return (type(self), (self.message, self.param))


class ModelNotAllowed(BadRequest):
    """The tenant may not use the requested model (a 403)."""


class ParsedRequest(NamedTuple):
    """What the gateway needs to know about a validated request (a named tuple: immutable, and cheap to
    build on every request)."""

    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    prompt_tokens_estimate: int
    max_tokens: int | None
    affinity_text: str
    #: Sequences the engine runs for it: ``max(n, best_of)``, times the prompts of a completions batch.
    sequences: int = 1
    #: The field ``max_tokens`` was read from (``max_completion_tokens`` on chat when it was sent).
    max_tokens_param: str = "max_tokens"


def decode_json(raw: bytes | bytearray) -> Any:
    """Parse a request body; ``BadRequest`` for anything that is not valid, bounded JSON in UTF-8.

    The body is decoded as strict UTF-8 first (invalid bytes and encoded surrogates are refused there);
    the tree walk of ``check_json_tree`` runs only when the body could hold what it looks for: more
    opening brackets than the depth bound, or a ``\\u`` escape (the only way left to write a lone
    surrogate). An ordinary request skips it.
    """
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    try:
        value = json.loads(text.removeprefix("\ufeff"))
    except RecursionError:
        raise BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # JSONDecodeError, and integers longer than Python's digit limit
        raise BadRequest("the request body is not valid JSON") from None
    if b"\\u" in raw or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        check_json_tree(value)
    return value


def check_json_tree(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse nesting deeper than ``max_depth`` and strings that are not valid Unicode (lone surrogates).

    Iterative, so no input can exhaust the stack; everything after this (the estimate, the rewrite,
    serialisation) may recurse safely.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
        elif isinstance(node, dict | list):
            if depth > max_depth:
                raise BadRequest(f"the request body nests JSON deeper than {max_depth} levels")
            if isinstance(node, dict):
                for key, child in node.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in node)


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise BadRequest("the request body contains a string that is not valid UTF-8") from None


def _text_tokens(value: Any) -> int:
    """Estimated tokens of every string in ``value`` (see the module docstring). Iterative: one call per
    request, not one per node."""
    total = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if node.isascii():
                total += -(-len(node) // CHARS_PER_TOKEN)
            else:
                other = len(node) - len(node.encode("ascii", "ignore"))
                total += -(-(len(node) - other) // CHARS_PER_TOKEN) + other
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return total


#: The fields of an object whose text makes the affinity prefix, in order.
_PREFIX_FIELDS: Final = ("role", "content", "text", "type")
_PREFIX_FIELDS_REVERSED: Final = tuple(reversed(_PREFIX_FIELDS))


def _text_prefix(value: Any, limit: int, out: list[str]) -> int:
    """Append strings from ``value`` in order until ``limit`` characters are collected (integers count as
    one character each); returns what is left of ``limit``. Iterative, in document order."""
    stack = [value]
    while stack and limit > 0:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node[:limit])
            limit -= len(node) if len(node) < limit else limit
        elif isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            for key in _PREFIX_FIELDS_REVERSED:
                if key in node:
                    stack.append(node[key])
        elif isinstance(node, int):
            out.append(f"{node},")
            limit -= 1
    return limit if limit > 0 else 0


def compute_affinity_text(body: dict[str, Any], endpoint: Endpoint, limit: int) -> str:
    out: list[str] = []
    _text_prefix(body.get("messages") if endpoint is Endpoint.CHAT else body.get("prompt"), limit, out)
    return "".join(out)[:limit]


def compute_prompt_estimate(body: dict[str, Any], endpoint: Endpoint) -> int:
    """Estimated prompt tokens (see the module docstring)."""
    if endpoint is Endpoint.CHAT:
        messages = body["messages"]
        return _text_tokens(messages) + CHAT_MESSAGE_OVERHEAD_TOKENS * len(messages)
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    return _text_tokens(prompt)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_count(prompt: Any) -> int:
    """Prompts in a validated ``prompt``: a string or one token-id list is one, a list of them is many."""
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        return len(prompt)
    return 1


def parse_request(body: Any, endpoint: Endpoint, affinity_chars: int) -> ParsedRequest:
    """Validate the fields the gateway relies on; raise ``BadRequest`` with a client-safe message.

    Only the shape the gateway itself needs is checked here; everything else is vLLM's to validate
    (and it answers 400 for what it rejects).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each entry of 'messages' must be an object", "messages")
    else:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and bool(prompt)
            and (
                all(isinstance(p, str) for p in prompt)
                or all(_is_int(p) for p in prompt)
                or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
            )
        )
        if not ok:
            raise BadRequest(
                "'prompt' must be a string, an array of strings, or an array of token ids", "prompt"
            )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    max_tokens: int | None = None
    max_tokens_param = "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer", name)
        # What vLLM obeys: on chat, max_completion_tokens over max_tokens (the smaller of the two made a
        # request of max_tokens 1 and max_completion_tokens 30000 cost 1 token and generate 30000);
        # completions have no max_completion_tokens (vLLM ignores it there).
        if name == "max_tokens" or endpoint is Endpoint.CHAT:
            max_tokens, max_tokens_param = value, name
    sequences = 1
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or not 1 <= value <= MAX_SEQUENCES:
            raise BadRequest(f"'{name}' must be an integer between 1 and {MAX_SEQUENCES}", name)
        sequences = max(sequences, value)
    if endpoint is Endpoint.COMPLETIONS:
        # A list of prompts is a batch: vLLM runs n sequences for each prompt.
        sequences *= _prompt_count(body["prompt"])
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    wants_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    return ParsedRequest(
        body=body,
        model=model,
        stream=stream,
        client_wants_usage=wants_usage,
        prompt_tokens_estimate=compute_prompt_estimate(body, endpoint),
        max_tokens=max_tokens,
        affinity_text=compute_affinity_text(body, endpoint, affinity_chars),
        sequences=sequences,
        max_tokens_param=max_tokens_param,
    )


def check_media_urls(messages: list[Any], allowed_hosts: frozenset[str]) -> None:
    """``BadRequest`` naming the field for a media URL the engine would fetch from anywhere but an allowed
    host: vLLM fetches every http(s) URL in ``image_url``, ``audio_url`` and ``video_url`` parts (and
    ``input_image``'s ``image_url``, and those keys in a part without ``type``), following redirects, from
    inside the engine pod: cloud metadata, in-cluster services, the pod's own loopback. ``data:`` URLs
    are fetched from nothing. Only content lists are looked at, not their text: an ordinary request
    costs one type check per message."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            for key in MEDIA_URL_KEYS:
                value = part.get(key)
                if value is None:
                    continue
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str) and _media_url_allowed(url, allowed_hosts):
                    continue
                where = f"messages[{i}].content[{j}].{key}"
                raise BadRequest(
                    f"'{where}' is not a data: URL"
                    + (
                        f" or an http(s) URL on an allowed host ({', '.join(sorted(allowed_hosts))})"
                        if allowed_hosts
                        else ""
                    )
                    + "; the engine does not fetch media from other places. Send the media inline as "
                    "a data: URL (data:<type>;base64,<data>)"
                    + ("" if allowed_hosts else ", or ask the platform to allow the host"),
                    where,
                )


def _media_url_allowed(url: str, allowed_hosts: frozenset[str]) -> bool:
    if url[:5].lower() == "data:":  # as vLLM tells a data URL from one it fetches
        return True
    if not allowed_hosts or not url.isascii() or not url.isprintable() or "\\" in url or " " in url:
        return False  # nothing else allowed; or a URL two parsers might read as two different hosts
    try:
        split = urlsplit(url)
        host = split.hostname
    except ValueError:
        return False
    return (
        split.scheme in ("http", "https")
        and "@" not in split.netloc
        and host is not None
        and host in allowed_hosts
    )


def build_request_id(tenant: str) -> str:
    """The ``X-Request-Id`` that tags a request with its tenant (see the module docstring). Its 32 hex
    digits are this process's random 64-bit prefix and a 64-bit count: unique among the process's
    requests by construction and across gateway replicas with the odds of the prefixes colliding, with
    no system call per request."""
    return f"{REQUEST_ID_PREFIX}{tenant}_{_REQUEST_ID_PROCESS}{next(_request_count):016x}"


def parse_tenant_from_request_id(request_id: str) -> str | None:
    """The tenant in an engine request id built from ``build_request_id`` (``None`` if untagged)."""
    match = _REQUEST_ID_RE.search(request_id)
    return match.group(1) if match else None


def build_upstream_body(
    parsed: ParsedRequest,
    *,
    tenant: str,
    cache_salt: str,
    priority: int,
    inject_max_tokens: int | None = None,
) -> dict[str, Any]:
    """The body sent to vLLM: client fields minus ``STRIPPED_BODY_FIELDS``, plus the tenant's own."""
    body = {k: v for k, v in parsed.body.items() if k not in STRIPPED_BODY_FIELDS}
    body["cache_salt"] = cache_salt
    body["priority"] = priority
    body["vllm_xargs"] = {TENANT_XARG: tenant}
    if inject_max_tokens is not None:
        body["max_tokens"] = inject_max_tokens
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def build_upstream_headers(tenant: str, request_id: str, incoming: Any) -> dict[str, str]:
    """Headers for the engine: the allowlisted client headers plus the tenant tags (the client session
    adds ``UPSTREAM_SESSION_HEADERS``)."""
    headers = {h: incoming[h] for h in FORWARDED_HEADERS if h in incoming}
    headers.setdefault("Content-Type", "application/json")
    headers[REQUEST_ID_HEADER] = request_id
    headers[TENANT_HEADER] = tenant
    return headers


def extract_usage(payload: Any) -> tuple[int, int, int] | None:
    """(prompt, completion, cached prompt) tokens from a response or chunk's ``usage``, if present; a
    count that is not a non-negative integer reads as 0 (``type(x) is int``: JSON gives no int subclass
    but ``bool``, which is not a count)."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if type(prompt) is int and prompt >= 0 else 0,
        completion if type(completion) is int and completion >= 0 else 0,
        cached if type(cached) is int and cached >= 0 else 0,
    )


@dataclass(frozen=True)
class RequestPolicy:
    """What preparing a request needs to know about its tenant (picklable: it travels to parse workers)."""

    tenant: str
    cache_salt: str
    priority: int
    models: frozenset[str]
    affinity_chars: int
    budget: BudgetLimits
    #: Hosts whose http(s) media URLs may reach the engine (exact names); empty: ``data:`` URLs only.
    media_domains: frozenset[str] = frozenset()


class PreparedRequest(NamedTuple):
    """A validated request, its budget and the exact bytes to send upstream (a named tuple, as
    ``ParsedRequest``)."""

    model: str
    stream: bool
    client_wants_usage: bool
    affinity_text: str
    budget: RequestBudget
    payload: bytes


def prepare_request(raw: bytes | bytearray, endpoint: Endpoint, policy: RequestPolicy) -> PreparedRequest:
    """From the raw body to the upstream payload: decode, validate, check the model, budget, rewrite.

    Raises ``BadRequest`` (400), ``ModelNotAllowed`` (403) or ``admission.RequestTooLarge`` (400).
    """
    parsed = parse_request(decode_json(raw), endpoint, policy.affinity_chars)
    if endpoint is Endpoint.CHAT:
        check_media_urls(parsed.body["messages"], policy.media_domains)
    if parsed.model not in policy.models:
        raise ModelNotAllowed(
            f"this API key may not use model {parsed.model[:100]!r}; GET /v1/models lists the allowed ones",
            "model",
        )
    budget = plan_request_budget(
        parsed.prompt_tokens_estimate,
        parsed.max_tokens,
        parsed.sequences,
        policy.budget,
        parsed.max_tokens_param,
    )
    body = build_upstream_body(
        parsed,
        tenant=policy.tenant,
        cache_salt=policy.cache_salt,
        priority=policy.priority,
        inject_max_tokens=budget.max_tokens if budget.injected else None,
    )
    return PreparedRequest(
        model=parsed.model,
        stream=parsed.stream,
        client_wants_usage=parsed.client_wants_usage,
        affinity_text=parsed.affinity_text,
        budget=budget,
        payload=_UPSTREAM_JSON.encode(body).encode(),
    )
