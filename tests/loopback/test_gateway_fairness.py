"""The gateway's engine queue over real HTTP: with the engines saturated (an upstream slow on purpose and a
small in-flight limit), held requests are released in VTC order within a tier, by strict priority between
tiers, or first come first served with fair queuing off; held requests time out with a 429 and
``Retry-After``, a client that goes away while held leaves no slot behind, and the queue is visible in
the metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway_support import MODEL, FakeEngine, TenantRow, build_keys, build_table, fake_engines, write_config
from kvfleet_runtime.config import SlaTier
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.admission import EngineQueue
from kvfleet_runtime.gateway.rewrite import TENANT_XARG
from kvfleet_runtime.gateway.server import Gateway, GatewaySettings, running_gateway

#: How long the upstream takes per request: long enough that requests pile up behind the limit.
SLOW_S = 0.15


@dataclass
class Env:
    url: str
    gateway: Gateway
    engine: FakeEngine
    keys: dict[str, list[str]]
    http: aiohttp.ClientSession

    @property
    def queue(self) -> EngineQueue:
        return self.gateway.pipeline.engine_queues["shared"]

    async def chat(self, tenant: str, content: str = "hi") -> aiohttp.ClientResponse:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        headers = {"Authorization": f"Bearer {self.keys[tenant][0]}"}
        async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r

    def send(self, tenant: str, n: int) -> list[asyncio.Task[aiohttp.ClientResponse]]:
        return [asyncio.create_task(self.chat(tenant)) for _ in range(n)]

    async def held(self, count: int) -> None:
        """Wait until ``count`` requests are held at the gateway (so arrival order is deterministic)."""
        async with asyncio.timeout(5):
            while self.queue.held() != count:  # noqa: ASYNC110
                await asyncio.sleep(0.005)

    def served_order(self) -> list[str]:
        return [r.body["vllm_xargs"][TENANT_XARG] for r in self.engine.received]

    async def metric(self, name: str, **labels: str) -> float:
        async with self.http.get(self.gateway.metrics_url + "/metrics") as r:
            text = await r.text()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


@contextlib.asynccontextmanager
async def env_for(tmp_path: Path, tenants: list[TenantRow], **settings: Any) -> AsyncIterator[Env]:
    async with fake_engines(1, delay_s=SLOW_S) as engines:
        table = build_table(tenants, {"shared": [engines[0].url]})
        keyfile, plain = build_keys(tenants)
        config, keys_path = write_config(tmp_path, table, keyfile)
        s = GatewaySettings(
            config_path=config,
            keys_path=keys_path,
            **{"reload_interval_s": 0.1, "engine_in_flight_per_replica": 1, "parse_workers": 0, **settings},
        )
        async with running_gateway(s) as (url, gateway), aiohttp.ClientSession() as http:
            yield Env(url, gateway, engines[0], plain, http)


HEAVY = TenantRow("heavy")
LIGHT = TenantRow("light")


async def _heavy_then_light(env: Env) -> list[str]:
    heavy = env.send("heavy", 6)
    await env.held(5)  # one on the engine, five held
    light = env.send("light", 2)
    await env.held(7)
    answers = await asyncio.gather(*heavy, *light)
    assert [a.status for a in answers] == [200] * 8
    return env.served_order()


async def test_vtc_serves_a_light_tenant_between_a_heavy_tenants_requests(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY, LIGHT]) as env:
        order = await _heavy_then_light(env)
        # The light tenant is lifted to the heavy one's counter (no credit, no penalty); the heavy one's
        # first answer charged its output, so they take turns from the next dispatch on.
        assert order[:4] == ["heavy", "light", "heavy", "light"], order
        assert env.queue.in_flight == 0 and env.queue.held() == 0
        assert env.queue.fair.counter("heavy") > env.queue.fair.counter("light") > 0
        assert await env.metric(m.FAIR_VIRTUAL_TOKENS, tenant="heavy") == env.queue.fair.counter("heavy")


async def test_fifo_when_fair_queuing_is_off(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY, LIGHT], fair_queuing=False) as env:
        order = await _heavy_then_light(env)
        assert order == ["heavy"] * 6 + ["light"] * 2, order


async def test_tiers_are_strict_and_weights_set_the_shares(tmp_path: Path) -> None:
    gold = TenantRow("gold", fair_share_weight=3.0)
    iron = TenantRow("iron")
    basic = TenantRow("basic", tier=SlaTier.BASIC)
    async with env_for(tmp_path, [gold, iron, basic]) as env:
        first = env.send("basic", 1)  # takes the engine
        await env.held(0)
        early_basic = env.send("basic", 2)  # held before any standard request arrives
        await env.held(2)
        standard = env.send("gold", 8) + env.send("iron", 8)
        await env.held(18)
        assert await env.metric(m.ENGINE_QUEUE_DEPTH, pool="shared", sla_tier="standard") == 16
        assert await env.metric(m.ENGINE_QUEUE_DEPTH, pool="shared", sla_tier="basic") == 2
        await asyncio.gather(*first, *early_basic, *standard)
        order = env.served_order()
        # Every standard request before the basic ones that were waiting longer.
        assert order[0] == "basic" and order[-2:] == ["basic", "basic"], order
        # Weight 3 against 1 while both were backlogged: of the first 8 standard dispatches, gold has 6.
        standard_order = [t for t in order if t != "basic"]
        assert standard_order[:8].count("gold") == 6, standard_order


async def test_a_held_request_that_waits_too_long_gets_429_with_retry_after(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY, LIGHT], max_queue_wait_s=0.05) as env:
        first = env.send("heavy", 1)
        await asyncio.sleep(0.02)
        late = await env.chat("light")
        assert late.status == 429
        assert late.headers["Retry-After"] == "1"
        await asyncio.gather(*first)
        assert await env.metric(m.THROTTLED_TOTAL, tenant="light", reason="engine_queue") == 1
        assert env.queue.in_flight == 0 and env.queue.held() == 0
        assert env.gateway.pipeline.gates["light"].in_flight == 0
        assert (await env.chat("light")).status == 200  # no slot was leaked
        assert len(env.engine.received) == 2


async def test_too_many_held_requests_of_one_tenant_get_429(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY], max_queue=2) as env:
        tasks = env.send("heavy", 3)
        await env.held(2)
        refused = await env.chat("heavy")
        assert refused.status == 429 and "Retry-After" in refused.headers
        assert [t.status for t in await asyncio.gather(*tasks)] == [200] * 3


async def test_a_client_gone_while_held_leaves_no_slot_and_never_reaches_the_engine(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY, LIGHT]) as env:
        first = env.send("heavy", 1)
        await env.held(0)
        gone = env.send("light", 1)
        await env.held(1)
        gone[0].cancel()  # the client closes its connection; the gateway cancels the handler
        with contextlib.suppress(asyncio.CancelledError):
            await gone[0]
        async with asyncio.timeout(5):
            while env.queue.held():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        await asyncio.gather(*first)
        assert env.queue.in_flight == 0 and env.gateway.pipeline.gates["light"].in_flight == 0
        assert env.served_order() == ["heavy"]
        assert (await env.chat("light")).status == 200


async def test_no_limit_holds_nothing(tmp_path: Path) -> None:
    async with env_for(tmp_path, [HEAVY], engine_in_flight_per_replica=0) as env:
        tasks = env.send("heavy", 5)
        async with asyncio.timeout(5):
            while len(env.engine.received) < 5:  # noqa: ASYNC110 - all on the engine at once
                await asyncio.sleep(0.005)
        assert env.queue.held() == 0 and env.queue.limit is None
        assert [t.status for t in await asyncio.gather(*tasks)] == [200] * 5
