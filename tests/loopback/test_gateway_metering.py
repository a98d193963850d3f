"""The gateway's metering series (what ``kvfleet usage`` bills from) over HTTP, in front of OpenAI-shaped
upstreams (tests/gateway_support.py): tokens, requests by status and throttles per ModelDeployment and
tenant, and the rate-limit headers (none for a limit a tenant does not have)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from factories import metric_samples
from gateway_support import MODEL, TenantRow, build_keys, build_table, fake_engines, write_config
from kvfleet_runtime.config import RateLimits
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway


@contextlib.asynccontextmanager
async def env(tmp_path: Path, tenants: list[TenantRow]) -> AsyncIterator[tuple[str, str, dict[str, Any]]]:
    async with fake_engines(1) as engines:
        table = build_table(tenants, {"shared": [engines[0].url]})
        keyfile, plain = build_keys(tenants)
        config, keys_path = write_config(tmp_path, table, keyfile)
        settings = GatewaySettings(config_path=config, keys_path=keys_path)
        async with running_gateway(settings) as (url, gateway):
            yield url, gateway.metrics_url, plain


async def test_tokens_requests_by_status_and_throttles_are_counted_per_model_deployment_and_tenant(
    tmp_path: Path,
) -> None:
    tenants = [TenantRow("acme"), TenantRow("slow", rate_limits=RateLimits(requests_per_minute=1))]
    async with env(tmp_path, tenants) as (url, metrics_url, keys), aiohttp.ClientSession() as http:
        usages = []
        for tenant, stream in (("acme", False), ("acme", True), ("acme", False), ("slow", False)):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "same prompt"}],
                "stream": stream,
            }
            headers = {"Authorization": f"Bearer {keys[tenant][0]}"}
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                if not stream:
                    usages.append((tenant, (await r.json())["usage"]))
                else:
                    # The gateway asked the engine for usage; the client did not, so it sees none.
                    assert b'"usage"' not in await r.read()
        headers = {"Authorization": f"Bearer {keys['slow'][0]}"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 429
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 401
        async with http.get(metrics_url + "/metrics") as r:
            text = await r.text()

    def total(name: str, **labels: str) -> float:
        return sum(
            v for ls, v in metric_samples(text, name) if all(ls.get(k) == x for k, x in labels.items())
        )

    acme = [u for t, u in usages if t == "acme"]
    # The stream's usage (from the chunk the gateway asked for) is the same as the first non-stream one.
    prompt = 2 * acme[0]["prompt_tokens"] + acme[1]["prompt_tokens"]
    assert total(m.PROMPT_TOKENS_TOTAL, tenant="acme", model_deployment="md") == prompt
    assert (
        total(m.CACHED_PROMPT_TOKENS_TOTAL, tenant="acme")
        == sum(u["prompt_tokens_details"]["cached_tokens"] for u in acme) + acme[0]["prompt_tokens"]
    )  # the stream repeated the prompt: all of it cached
    assert total(m.COMPLETION_TOKENS_TOTAL, tenant="acme") == 3 * acme[0]["completion_tokens"]
    assert total(m.RESPONSES_TOTAL, tenant="acme", code="200", model_deployment="md") == 3
    assert total(m.RESPONSES_TOTAL, tenant="slow", code="200") == 1
    assert total(m.RESPONSES_TOTAL, tenant="slow", code="429") == 1
    assert total(m.RESPONSES_TOTAL, tenant=m.UNAUTHENTICATED, code="401") == 1
    assert total(m.THROTTLED_TOTAL, tenant="slow", model_deployment="md", reason="requests_per_minute") == 1
    assert total(m.REQUESTS_TOTAL, tenant="slow", model_deployment="md", outcome="throttled") == 1


async def test_a_limit_the_tenant_does_not_have_has_no_header(tmp_path: Path) -> None:
    """No limit is written as no header (docs/operations.md, "OpenAI conventions at the gateway"): any
    number would be a limit clients act on, and a word breaks clients that parse the headers as numbers.
    A tenant with one limit gets that limit's trio only."""
    tenants = [
        TenantRow("free"),
        TenantRow("rpm-only", rate_limits=RateLimits(requests_per_minute=60)),
    ]
    async with env(tmp_path, tenants) as (url, _metrics_url, keys), aiohttp.ClientSession() as http:
        seen = {}
        for tenant in ("free", "rpm-only"):
            auth = {"Authorization": f"Bearer {keys[tenant][0]}"}
            async with http.get(url + "/v1/models", headers=auth) as r:
                assert r.status == 200
                seen[tenant] = {k.lower() for k in r.headers if k.lower().startswith("x-ratelimit-")}
    assert seen["free"] == set()
    assert seen["rpm-only"] == {f"x-ratelimit-{w}-requests" for w in ("limit", "remaining", "reset")}


async def test_models_carries_the_rate_limit_headers_and_every_refusal_is_openai_shaped(
    tmp_path: Path,
) -> None:
    tenants = [TenantRow("acme", rate_limits=RateLimits(requests_per_minute=60, tokens_per_minute=6000))]
    async with env(tmp_path, tenants) as (url, _metrics_url, keys), aiohttp.ClientSession() as http:
        auth = {"Authorization": f"Bearer {keys['acme'][0]}"}
        async with http.get(url + "/v1/models", headers=auth) as r:
            assert r.status == 200
            for kind, limit in (("requests", "60"), ("tokens", "6000")):
                assert r.headers[f"x-ratelimit-limit-{kind}"] == limit
                assert f"x-ratelimit-remaining-{kind}" in r.headers
                assert f"x-ratelimit-reset-{kind}" in r.headers
        refusals = [
            ("GET", "/v1/models", {}, 401),
            ("GET", "/v1/nothing-here", auth, 404),
            ("GET", "/v1/chat/completions", auth, 405),
            ("POST", "/v1/chat/completions", auth, 400),
        ]
        for method, path, headers, status in refusals:
            async with http.request(method, url + path, headers=headers, data=b"{}") as r:
                assert r.status == status
                body = await r.json()
                assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
