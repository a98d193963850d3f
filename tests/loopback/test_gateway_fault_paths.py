"""The gateway's fault paths that need an engine to misbehave on cue: an engine that never answers (504
within the upstream timeout, sent once) and the drain on SIGTERM (streams in flight finish, answers close
their connections, the listener closes, the process exits on its own).

The gateway is the real process; the engine is ``FakeEngine`` (tests/gateway_support.py), an
OpenAI-shaped upstream that can be told to stall: a real vLLM cannot be made to stall one request on
cue. The same faults on real vLLM (SIGSTOP, kill -9) are in tests/engine/test_gateway_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

import aiohttp

from gateway_support import (
    MODEL,
    TenantRow,
    build_keys,
    build_table,
    fake_engines,
    gateway_process,
    write_config,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_an_engine_that_never_answers_is_a_504_within_the_timeout(tmp_path: Path) -> None:
    async with fake_engines(1, delay_s=60) as engines, aiohttp.ClientSession() as http:
        tenants = [TenantRow("acme")]
        keys, plain = build_keys(tenants)
        config, keys_path = write_config(tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys)
        flags = ("--parse-workers", "0", "--upstream-timeout", "1.5")
        async with gateway_process(tmp_path, config, keys_path, *flags) as gw:
            t0 = time.monotonic()
            async with http.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {plain['acme'][0]}"},
            ) as r:
                took = time.monotonic() - t0
                body = await r.json()
            assert r.status == 504 and 1.4 <= took < 5, (r.status, took)
            assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == "upstream_timeout"
            assert "1.5 s" in body["error"]["message"]
            await asyncio.sleep(0.5)
            assert len(engines[0].received) == 1  # never re-sent: the engine may be working on it


async def test_sigterm_drains_streams_in_flight_and_closes_connections(tmp_path: Path) -> None:
    engine_kwargs = {
        "reply": " ".join(f"w{i}" for i in range(10)),
        "stream_chunks": 10,
        "chunk_interval_s": 0.3,
    }
    async with fake_engines(1, **engine_kwargs) as engines, aiohttp.ClientSession() as http:
        tenants = [TenantRow("acme")]
        keys, plain = build_keys(tenants)
        config, keys_path = write_config(tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys)
        headers = {"Authorization": f"Bearer {plain['acme'][0]}"}
        async with gateway_process(tmp_path, config, keys_path, "--parse-workers", "0") as gw:

            async def one_stream() -> str:
                async with http.post(
                    gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
                ) as r:
                    assert r.status == 200
                    return (await r.read()).decode()

            async with aiohttp.ClientSession() as keep_alive:
                async with keep_alive.get(gw.url + "/healthz") as r:  # a keep-alive connection, now idle
                    assert r.status == 200
                streaming = asyncio.create_task(one_stream())
                await asyncio.sleep(0.8)  # the stream is under way (3 s in all)
                gw.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                # No new connection is accepted ...
                async with aiohttp.ClientSession() as fresh:
                    with contextlib.suppress(aiohttp.ClientConnectorError):
                        async with fresh.get(gw.url + "/healthz") as r:
                            raise AssertionError(f"a draining gateway accepted a connection ({r.status})")
                # ... an open one is answered, not ready, and told to close.
                async with keep_alive.get(gw.url + "/readyz") as r:
                    assert r.status == 503 and "draining" in (await r.json())["reason"]
                    assert r.headers.get("Connection", "").lower() == "close"
            text = await streaming
            events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
            assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == engine_kwargs[
                "reply"
            ].split()
            assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
            with contextlib.suppress(aiohttp.ClientConnectorError):
                async with http.get(gw.url + "/healthz") as r:
                    raise AssertionError(f"a stopped gateway answered {r.status}")
