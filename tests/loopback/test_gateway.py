"""The gateway end to end over HTTP, in front of OpenAI-shaped upstreams (see tests/gateway_support.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_support import (
    FRONT_DOORS,
    MODEL,
    FakeEngine,
    TenantRow,
    build_keys,
    build_table,
    fake_engines,
    free_closed_port_url,
    running_front_door,
    sum_samples,
    write_config,
)
from kvfleet_runtime.config import TIER_PRIORITY, Isolation, KeyFile, RateLimits, SlaTier, derive_cache_salt
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.pipeline import Pipeline
from kvfleet_runtime.gateway.rewrite import TENANT_XARG, parse_tenant_from_request_id
from kvfleet_runtime.gateway.server import Gateway, GatewaySettings, running_gateway


@dataclass
class Env:
    url: str
    #: The aiohttp front door (None behind Envoy).
    gateway: Gateway | None
    pipeline: Pipeline
    metrics_url: str
    engines: list[FakeEngine]
    keys: dict[str, list[str]]
    keyfile: KeyFile
    config: Path
    keys_path: Path
    http: aiohttp.ClientSession

    def auth(self, tenant: str, i: int = 0) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant][i]}"}

    async def chat(
        self, tenant: str, content: str = "hi", status: int = 200, **extra: Any
    ) -> tuple[int, dict[str, Any], Any]:
        headers = {**self.auth(tenant), **extra.pop("headers", {})}
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
        async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
            data = await r.json()
            assert r.status == status, data
            return r.status, data, r.headers

    async def metric(self, name: str, **labels: str) -> float:
        async with self.http.get(self.metrics_url + "/metrics") as r:
            return sum_samples(await r.text(), name, **labels)


@contextlib.asynccontextmanager
async def gateway_env(
    tmp_path: Path,
    tenants: list[TenantRow],
    n_engines: int = 1,
    engine_kwargs: dict[str, Any] | None = None,
    extra_endpoints: list[str] | None = None,
    front_door: str = "aiohttp",
    **settings: Any,
) -> AsyncIterator[Env]:
    async with fake_engines(n_engines, **(engine_kwargs or {})) as engines:
        urls = [e.url for e in engines] + (extra_endpoints or [])
        pools = {"shared": urls}
        for t in tenants:
            if t.pool != "shared":
                pools.setdefault(t.pool, urls[:1])
        table = build_table(tenants, pools)
        keyfile, plain = build_keys(tenants)
        config, keys_path = write_config(tmp_path, table, keyfile)
        s = GatewaySettings(config_path=config, keys_path=keys_path, **{"reload_interval_s": 0.1, **settings})
        async with running_front_door(s, front_door, tmp_path) as door, aiohttp.ClientSession() as http:
            yield Env(
                door.url,
                door.gateway,
                door.pipeline,
                door.metrics_url,
                engines,
                plain,
                keyfile,
                config,
                keys_path,
                http,
            )


ACME = TenantRow("acme", tier=SlaTier.PREMIUM, keys=2)
BETA = TenantRow("beta", tier=SlaTier.BASIC)


# -- auth -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_valid_keys_during_rotation_authenticate_and_others_get_401(
    tmp_path: Path, front_door: str
) -> None:
    async with gateway_env(tmp_path, [ACME, BETA], front_door=front_door) as env:
        for i in (0, 1):
            _, data, _ = await env.chat("acme", headers=env.auth("acme", i))
            assert data["choices"][0]["message"]["content"] == "hello from the engine"
        for headers in (
            {},
            {"Authorization": "Bearer sk-nope"},
            {"Authorization": "Basic abc"},
            {"Authorization": "Bearer " + env.keys["acme"][0] + "x"},
        ):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with env.http.post(env.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert err["code"] == "invalid_api_key" and "API key" in err["message"]
        assert len(env.engines[0].received) == 2
        assert await env.metric(m.REJECTED_TOTAL, reason="unauthenticated") == 4


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_model_not_allowed_is_403_and_models_lists_only_allowed(
    tmp_path: Path, front_door: str
) -> None:
    other = TenantRow("other", models=(MODEL, "big-model"))
    async with gateway_env(tmp_path, [ACME, other], front_door=front_door) as env:
        _, data, _ = await env.chat("acme", status=403, model="big-model")
        assert data["error"]["code"] == "model_not_allowed"
        async with env.http.get(env.url + "/v1/models", headers=env.auth("acme")) as r:
            assert [d["id"] for d in (await r.json())["data"]] == [MODEL]
        async with env.http.get(env.url + "/v1/models", headers=env.auth("other")) as r:
            assert [d["id"] for d in (await r.json())["data"]] == ["big-model", MODEL]
        async with env.http.get(env.url + "/v1/models") as r:
            assert r.status == 401
        assert env.engines[0].received == []


# -- the tenant travels with the request --------------------------------------------------------------
@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_client_salt_priority_and_routing_hints_are_replaced(tmp_path: Path, front_door: str) -> None:
    async with gateway_env(tmp_path, [ACME, BETA], front_door=front_door) as env:
        await env.chat(
            "beta",
            cache_salt="attacker-salt",
            priority=-100,
            request_id="mine",
            session_id="s",
            vllm_xargs={TENANT_XARG: "acme"},
            kv_transfer_params={"remote": "x"},
            headers={
                "X-Vllm-Priority": "-100",
                "X-Request-Id": "mine",
                "X-Session-ID": "s",
                "X-data-parallel-rank": "3",
                "Accept-Encoding": "gzip, br",
                "User-Agent": "client/1.0",
            },
        )
        got = env.engines[0].received[-1]
        assert got.body["cache_salt"] == derive_cache_salt(env.keyfile.salt_key, "tenant-beta")
        assert got.body["priority"] == TIER_PRIORITY[SlaTier.BASIC]
        assert got.body["vllm_xargs"] == {TENANT_XARG: "beta"}
        for stripped in ("request_id", "session_id", "kv_transfer_params"):
            assert stripped not in got.body
        lower = {k.lower(): v for k, v in got.headers.items()}
        assert "x-vllm-priority" not in lower and "x-session-id" not in lower
        assert "x-data-parallel-rank" not in lower and "authorization" not in lower
        assert lower["x-kvfleet-tenant"] == "beta"
        # The answer is relayed as it comes, so the engine is asked not to compress it; and the engine sees
        # the gateway's User-Agent, not the client's, and no library or Python version.
        assert lower["accept-encoding"] == "identity" and lower["user-agent"] == "kvfleet-gateway"
        assert parse_tenant_from_request_id("chatcmpl-" + lower["x-request-id"] + "-1a2b3c4d") == "beta"
        await env.chat("acme")
        assert env.engines[0].received[-1].body["priority"] == TIER_PRIORITY[SlaTier.PREMIUM]


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_shared_tenants_share_the_pool_salt_and_salted_ones_do_not(
    tmp_path: Path, front_door: str
) -> None:
    tenants = [
        TenantRow("s1", isolation=Isolation.SHARED),
        TenantRow("s2", isolation=Isolation.SHARED),
        TenantRow("a1"),
        TenantRow("a2"),
    ]
    async with gateway_env(tmp_path, tenants, front_door=front_door) as env:
        salts = {}
        for t in ("s1", "s2", "a1", "a2"):
            await env.chat(t)
            salts[t] = env.engines[0].received[-1].body["cache_salt"]
        assert salts["s1"] == salts["s2"] == derive_cache_salt(env.keyfile.salt_key, "pool-shared")
        assert len({salts["a1"], salts["a2"], salts["s1"]}) == 3


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_dedicated_tenant_goes_to_its_own_pool(tmp_path: Path, front_door: str) -> None:
    async with fake_engines(1) as dedicated:
        ded = TenantRow("bank", isolation=Isolation.DEDICATED, pool="bank-pool")
        async with gateway_env(tmp_path, [ACME, ded], front_door=front_door) as env:
            # Point the dedicated pool at its own engine through a reload.
            table = build_table(
                [ACME, ded], {"shared": [env.engines[0].url], "bank-pool": [dedicated[0].url]}
            )
            env.config.write_text(json.dumps(table.model_dump(mode="json")))
            await _until(lambda: env.pipeline.routers["bank-pool"].replicas.get(dedicated[0].url) is not None)
            await env.pipeline.check_health_once()
            await env.chat("bank")
            await env.chat("acme")
            assert len(dedicated[0].received) == 1 and len(env.engines[0].received) == 1


# -- admission ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_requests_per_minute_gives_429_with_retry_after(tmp_path: Path, front_door: str) -> None:
    t = TenantRow("rl", rate_limits=RateLimits(requests_per_minute=2))
    async with gateway_env(tmp_path, [t, BETA], front_door=front_door) as env:
        await env.chat("rl")
        await env.chat("rl")
        _, data, headers = await env.chat("rl", status=429)
        assert data["error"]["code"] == "requests_per_minute"
        assert int(headers["Retry-After"]) >= 1
        await env.chat("beta")  # another tenant is unaffected
        assert await env.metric(m.THROTTLED_TOTAL, tenant="rl", reason="requests_per_minute") == 1
        assert await env.metric(m.REQUESTS_TOTAL, tenant="rl", outcome="throttled") == 1


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_rate_limit_headers_say_what_stood_at_admission(tmp_path: Path, front_door: str) -> None:
    """The answer's ``x-ratelimit-remaining-requests`` counts the request itself, however long the engine
    took: at 600 a minute a slot comes back every 0.1 s, so headers read when a 0.5 s answer arrives would
    show the limit untouched."""
    t = TenantRow("rl", rate_limits=RateLimits(requests_per_minute=600))
    async with gateway_env(tmp_path, [t], engine_kwargs={"delay_s": 0.5}, front_door=front_door) as env:
        _, _, headers = await env.chat("rl")
        assert headers["x-ratelimit-limit-requests"] == "600"
        assert int(headers["x-ratelimit-remaining-requests"]) == 599, dict(headers)


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_tokens_per_minute_counts_the_estimate_and_reconciles_usage(
    tmp_path: Path, front_door: str
) -> None:
    t = TenantRow("tpm", rate_limits=RateLimits(tokens_per_minute=400))
    async with gateway_env(tmp_path, [t], front_door=front_door) as env:
        await env.chat("tpm", content="x" * 400, max_tokens=150)  # ~100 + 4 + 150 estimated
        gate = env.pipeline.gates["tpm"]
        assert (
            gate.tpm is not None and 400 - 130 < gate.tpm.level < 400 - 100
        )  # usage ~116, not the estimate ~254
        # ~300 + 4 + 200 tokens can never fit 400 per minute: refused outright, nothing charged.
        _, data, _ = await env.chat("tpm", content="y" * 1200, max_tokens=200, status=400)
        assert (
            data["error"]["code"] == "request_too_large" and "tokens per minute" in data["error"]["message"]
        )
        level = gate.tpm.level
        _, data, headers = await env.chat("tpm", content="y" * 400, max_tokens=200, status=429)
        assert data["error"]["code"] == "tokens_per_minute" and int(headers["Retry-After"]) >= 1
        assert gate.tpm.level == pytest.approx(level, abs=1)  # a refusal charges nothing


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_max_concurrent_queues_then_times_out_with_429(tmp_path: Path, front_door: str) -> None:
    t = TenantRow("c1", rate_limits=RateLimits(max_concurrent=1))
    async with gateway_env(
        tmp_path, [t], engine_kwargs={"delay_s": 0.3}, max_queue_wait_s=2.0, front_door=front_door
    ) as env:
        results = await asyncio.gather(env.chat("c1"), env.chat("c1"))
        assert all(r[0] == 200 for r in results)
        starts = sorted(r.at for r in env.engines[0].received)
        assert starts[1] - starts[0] >= 0.25  # the second waited for the first
        assert await env.metric(m.QUEUE_TIME_SECONDS + "_count", tenant="c1") == 2
    async with gateway_env(tmp_path, [t], engine_kwargs={"delay_s": 0.5}, max_queue_wait_s=0.1) as env:
        first = asyncio.create_task(env.chat("c1"))
        await _until(lambda: env.pipeline.gates["c1"].in_flight == 1)
        _, data, headers = await env.chat("c1", status=429)
        assert data["error"]["code"] == "concurrency" and headers["Retry-After"] == "1"
        await first


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_kv_budget_queues_requests_beyond_the_burst_limit(tmp_path: Path, front_door: str) -> None:
    # burst 10 blocks x 16 tokens = 160 tokens; each request is ~4 + 4 + 100 tokens -> one at a time.
    t = TenantRow("kv", hbm_burst_blocks=10)
    async with gateway_env(
        tmp_path, [t], engine_kwargs={"delay_s": 0.2}, max_queue_wait_s=5.0, front_door=front_door
    ) as env:
        results = await asyncio.gather(*(env.chat("kv", max_tokens=100) for _ in range(3)))
        assert [r[0] for r in results] == [200, 200, 200]
        starts = sorted(r.at for r in env.engines[0].received)
        assert starts[2] - starts[0] >= 0.35
        assert env.pipeline.gates["kv"].kv_in_flight == 0
    async with gateway_env(tmp_path, [t], engine_kwargs={"delay_s": 0.4}, max_queue_wait_s=0.1) as env:
        first = asyncio.create_task(env.chat("kv", max_tokens=100))
        await _until(lambda: env.pipeline.gates["kv"].in_flight == 1)
        _, data, _ = await env.chat("kv", max_tokens=100, status=429)
        assert data["error"]["code"] == "kv_budget" and "KV budget" in data["error"]["message"]
        await first
        await env.chat("kv", max_tokens=10)  # small enough to fit once the first is done


# -- routing --------------------------------------------------------------------------------------------
async def test_prefix_affinity_is_stable_and_spreads_prefixes(tmp_path: Path) -> None:
    async with gateway_env(tmp_path, [ACME], n_engines=3) as env:
        for _ in range(5):
            await env.chat("acme", content="the same long system prompt " * 10)
        assert sorted(len(e.received) for e in env.engines) == [0, 0, 5]
        for i in range(30):
            await env.chat("acme", content=f"prompt number {i} " * 10)
        assert all(len(e.received) > 0 for e in env.engines)


async def test_connect_error_fails_over_and_no_healthy_replica_is_503(tmp_path: Path) -> None:
    async with gateway_env(tmp_path, [ACME], n_engines=2, health_interval_s=3600) as env:
        dead = env.engines[0]
        await dead.stop()  # still marked healthy: only the connect error reveals it
        # Affinity hashes prompts over replicas on random ports: send until one has met the dead replica.
        for sent in range(1, 41):
            await env.chat("acme", content=f"p{sent}")
            if sent >= 6 and await env.metric(m.UPSTREAM_ERRORS_TOTAL, kind="connect") >= 1:
                break
        assert len(env.engines[1].received) == sent
        assert await env.metric(m.UPSTREAM_ERRORS_TOTAL, kind="connect") >= 1
        await env.engines[1].stop()
        _, data, _ = await env.chat("acme", status=503)
        assert data["error"]["code"] == "no_healthy_replica" and "pool 'shared'" in data["error"]["message"]
        async with env.http.get(env.url + "/readyz") as r:
            assert r.status == 503


@contextlib.contextmanager
def _replica_that_stops_accepting() -> Any:
    """A replica on a real listening socket (backlog 0) that answers one health check, then never
    accepts again; its accept queue is then filled, so the kernel drops further SYNs and a connect hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)

    def answer_one_health_check() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=answer_one_health_check, daemon=True)
    thread.start()
    fillers: list[socket.socket] = []
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", thread, fillers
    finally:
        for f in fillers:
            f.close()
        listener.close()


async def test_a_replica_that_does_not_accept_is_503_saying_so_not_refused(tmp_path: Path) -> None:
    """A connect that times out is reported as such (it was reported as refused)."""
    with _replica_that_stops_accepting() as (url, health_answered, fillers):
        async with gateway_env(
            tmp_path,
            [ACME],
            n_engines=0,
            extra_endpoints=[url],
            health_interval_s=3600,
            connect_timeout_s=0.3,
        ) as env:
            await asyncio.to_thread(health_answered.join, 5)
            assert not health_answered.is_alive()  # healthy, and nothing accepts any more
            port = int(url.rsplit(":", 1)[1])
            for _ in range(4):  # fill the accept queue: later SYNs are dropped
                f = socket.socket()
                f.setblocking(False)
                f.connect_ex(("127.0.0.1", port))
                fillers.append(f)
            await asyncio.sleep(0.1)
            started = asyncio.get_running_loop().time()
            _, data, _ = await env.chat("acme", status=503)
            took = asyncio.get_running_loop().time() - started
            message = data["error"]["message"]
            assert data["error"]["code"] == "no_healthy_replica", data
            assert "0 refused or unreachable, 1 did not accept within 0.3 s" in message, message
            assert 0.25 <= took < 3, took
            assert await env.metric(m.UPSTREAM_ERRORS_TOTAL, kind="connect") == 1


async def test_unreachable_pool_is_503_and_not_ready(tmp_path: Path) -> None:
    t = TenantRow("lonely", pool="empty")
    async with gateway_env(tmp_path, [t], n_engines=1) as env:
        table = build_table([t], {"shared": [env.engines[0].url], "empty": [free_closed_port_url()]})
        env.config.write_text(json.dumps(table.model_dump(mode="json")))
        await _until(
            lambda: (
                "empty" in env.pipeline.routers
                and not env.pipeline.routers["empty"].healthy
                and all(r.checked for r in env.pipeline.routers["empty"].replicas.values())
            )
        )
        _, data, _ = await env.chat("lonely", status=503)
        assert "no healthy engine replica in pool 'empty'" in data["error"]["message"]
        async with env.http.get(env.url + "/readyz") as r:
            assert r.status == 200  # the shared pool is still healthy


async def test_readyz_and_healthz(tmp_path: Path) -> None:
    async with gateway_env(tmp_path, [ACME], engine_kwargs={"healthy": False}) as env:
        async with env.http.get(env.url + "/healthz") as r:
            assert r.status == 200
        async with env.http.get(env.url + "/readyz") as r:
            assert r.status == 503 and "no healthy" in (await r.json())["reason"]
        env.engines[0].healthy = True
        await env.pipeline.check_health_once()
        async with env.http.get(env.url + "/readyz") as r:
            assert r.status == 200


# -- streaming and cancellation -------------------------------------------------------------------------
async def _sse(env: Env, tenant: str, **extra: Any) -> list[Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    events = []
    async with env.http.post(env.url + "/v1/chat/completions", json=body, headers=env.auth(tenant)) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_streaming_relays_chunks_and_hides_the_usage_chunk_unless_asked(
    tmp_path: Path, front_door: str
) -> None:
    async with gateway_env(
        tmp_path,
        [ACME],
        engine_kwargs={"reply": "a b c d e f", "stream_chunks": 3, "chunk_interval_s": 0.02},
        front_door=front_door,
    ) as env:
        events = await _sse(env, "acme")
        assert events[-1] == "[DONE]"
        assert " ".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == "a b c d e f"
        assert all(e["choices"] for e in events[:-1])
        assert env.engines[0].received[-1].body["stream_options"] == {"include_usage": True}
        events = await _sse(env, "acme", stream_options={"include_usage": True})
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
        assert await env.metric(m.COMPLETION_TOKENS_TOTAL, tenant="acme") == 12
        assert await env.metric(m.TTFT_SECONDS + "_count", tenant="acme") == 2
        assert await env.metric(m.INTER_TOKEN_LATENCY_SECONDS + "_count", tenant="acme") >= 4


async def test_client_disconnect_cancels_the_upstream_request(tmp_path: Path) -> None:
    kwargs = {"reply": " ".join(["w"] * 50), "stream_chunks": 50, "chunk_interval_s": 0.05}
    async with gateway_env(tmp_path, [ACME], engine_kwargs=kwargs) as env:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession() as own:
            resp = await own.post(env.url + "/v1/chat/completions", json=body, headers=env.auth("acme"))
            await resp.content.readline()
            resp.close()
        await _until(lambda: env.engines[0].cancelled == 1)
        assert env.engines[0].finished == 0
        await _until(lambda: env.pipeline.gates["acme"].in_flight == 0)
        env.engines[0].delay_s = 5.0  # non-streaming: the client gives up while the engine works
        with pytest.raises(TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as own:
                await own.post(
                    env.url + "/v1/chat/completions", json={**body, "stream": False}, headers=env.auth("acme")
                )
        await _until(lambda: env.engines[0].cancelled == 2)
        await _until(lambda: env.pipeline.gates["acme"].in_flight == 0)
        assert await env.metric(m.REQUESTS_TOTAL, tenant="acme", outcome="cancelled") == 2


# -- hot reload -----------------------------------------------------------------------------------------
async def _until(cond: Any, limit_s: float = 5.0) -> None:
    """Poll a condition on state another task changes (there is no event to wait on)."""
    async with asyncio.timeout(limit_s):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_hot_reload_adds_tenants_keeps_in_flight_and_survives_a_bad_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with gateway_env(tmp_path, [ACME], engine_kwargs={"delay_s": 0.5}) as env:
        in_flight = asyncio.create_task(env.chat("acme"))
        await _until(lambda: env.pipeline.gates["acme"].in_flight == 1)
        newcomer = TenantRow("newcomer")
        table = build_table([ACME, newcomer], {"shared": [env.engines[0].url]})
        keyfile, plain = build_keys([newcomer], env.keyfile.salt_key_hex)
        keyfile = KeyFile(
            salt_key_hex=keyfile.salt_key_hex, key_hashes={**env.keyfile.key_hashes, **keyfile.key_hashes}
        )
        env.keys.update(plain)
        env.keys_path.write_text(json.dumps(keyfile.model_dump(mode="json")))
        env.config.write_text(json.dumps(table.model_dump(mode="json")))
        await _until(lambda: "newcomer" in (env.pipeline.snapshot.tenants if env.pipeline.snapshot else {}))
        assert (await in_flight)[0] == 200
        env.engines[0].delay_s = 0
        await env.chat("newcomer")
        # A malformed table: logged without content, counted, and the last good one stays.
        caplog.set_level(logging.INFO, logger="kvfleet.gateway")
        env.config.write_text('{"schema_version": 1, "tenants": "SECRET-MARKER-not-a-table"')
        await _until(lambda: caplog.text.count("rejected") >= 1)
        assert "SECRET-MARKER" not in caplog.text
        assert await env.metric(m.CONFIG_RELOAD_FAILURES_TOTAL, file="tenant_table") == 1
        await env.chat("newcomer")
        env.keys_path.write_text('{"salt_key_hex": "SECRET-MARKER", "key_hashes": {}}')
        await _until(lambda: caplog.text.count("rejected") >= 2)
        assert "SECRET-MARKER" not in caplog.text
        await env.chat("acme")


async def test_a_removed_tenant_finishes_its_request_and_then_leaves_no_gate_behind(tmp_path: Path) -> None:
    async with gateway_env(tmp_path, [ACME, TenantRow("other")], engine_kwargs={"delay_s": 0.5}) as env:
        in_flight = asyncio.create_task(env.chat("acme"))
        await _until(lambda: env.pipeline.gates["acme"].in_flight == 1)
        table = build_table([TenantRow("other")], {"shared": [env.engines[0].url]})
        env.config.write_text(json.dumps(table.model_dump(mode="json")))
        await _until(lambda: "acme" not in (env.pipeline.snapshot.tenants if env.pipeline.snapshot else {}))
        assert "acme" in env.pipeline.gates  # still in flight: its gate stays until the answer is back
        assert (await in_flight)[0] == 200
        assert "acme" not in env.pipeline.gates
        await env.chat("acme", status=401)  # and its key no longer works
        assert set(env.pipeline.gates) == {"other"}


async def test_reload_follows_a_configmap_style_symlink_swap(tmp_path: Path) -> None:
    """Kubernetes updates a mounted ConfigMap by re-pointing ``..data`` at a new timestamped folder."""
    mount = tmp_path / "mount"
    async with fake_engines(1) as engines:
        tenants = [ACME]
        table = build_table(tenants, {"shared": [engines[0].url]})
        keyfile, _ = build_keys(tenants)
        v1 = tmp_path / "mount" / "..2026_v1"
        v1.mkdir(parents=True)
        write_config(v1, table, keyfile)
        (mount / "..data").symlink_to("..2026_v1")
        for name in ("tenants.json", "keys.json"):
            (mount / name).symlink_to(f"..data/{name}")
        s = GatewaySettings(
            config_path=mount / "tenants.json", keys_path=mount / "keys.json", reload_interval_s=0.05
        )
        async with running_gateway(s) as (url, gateway), aiohttp.ClientSession() as http:
            beta = TenantRow("beta")
            table2 = build_table([ACME, beta], {"shared": [engines[0].url]})
            kf2, plain2 = build_keys([beta], keyfile.salt_key_hex)
            kf2 = KeyFile(
                salt_key_hex=keyfile.salt_key_hex, key_hashes={**keyfile.key_hashes, **kf2.key_hashes}
            )
            v2 = mount / "..2026_v2"
            v2.mkdir()
            write_config(v2, table2, kf2)
            stat_before = [os.stat(mount / n).st_mtime_ns for n in ("tenants.json", "keys.json")]
            for n in ("tenants.json", "keys.json"):  # same mtimes: only the inode tells the swap
                os.utime(v2 / n, ns=(stat_before[0], stat_before[0]))
            (mount / "..data_tmp").symlink_to("..2026_v2")
            os.replace(mount / "..data_tmp", mount / "..data")
            await _until(
                lambda: gateway.pipeline.snapshot is not None and "beta" in gateway.pipeline.snapshot.tenants
            )
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {plain2['beta'][0]}"},
            ) as r:
                assert r.status == 200


# -- metrics and secrecy --------------------------------------------------------------------------------
@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_metrics_count_tokens_and_cached_tokens_per_tenant(tmp_path: Path, front_door: str) -> None:
    async with gateway_env(tmp_path, [ACME, BETA], front_door=front_door) as env:
        await env.chat("acme", content="a shared question")
        await env.chat("acme", content="a shared question")
        await env.chat("beta", content="a shared question")
        prompt = await env.metric(m.PROMPT_TOKENS_TOTAL, tenant="acme", model=MODEL, sla_tier="premium")
        cached = await env.metric(m.CACHED_PROMPT_TOKENS_TOTAL, tenant="acme")
        assert prompt > 0 and cached == prompt / 2
        assert await env.metric(m.CACHED_PROMPT_TOKENS_TOTAL, tenant="beta") == 0
        assert await env.metric(m.REQUESTS_TOTAL, tenant="acme", outcome="ok") == 2
        assert await env.metric(m.IN_FLIGHT_REQUESTS, tenant="acme") == 0
        async with env.http.get(env.metrics_url + "/metrics") as r:
            names = {f.name for f in text_string_to_metric_families(await r.text())}
        for name in (
            m.REQUESTS_TOTAL,
            m.PROMPT_TOKENS_TOTAL,
            m.TTFT_SECONDS,
            m.QUEUE_TIME_SECONDS,
            m.IN_FLIGHT_REQUESTS,
            m.REPLICA_HEALTHY,
            m.CONFIG_RELOADS_TOTAL,
        ):
            assert name.removesuffix("_total") in names


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_no_prompt_completion_or_key_reaches_logs_or_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, front_door: str
) -> None:
    marker = "ZEBRA-7f3a-MARKER"
    caplog.set_level(logging.DEBUG)
    engine_kwargs = {"reply": f"the answer is {marker}"}
    async with gateway_env(
        tmp_path,
        [ACME],
        n_engines=2,
        engine_kwargs=engine_kwargs,
        health_interval_s=3600,
        front_door=front_door,
    ) as env:
        await env.engines[0].stop()  # force fail-over warnings into the log too
        # Affinity hashes the (salted) prompt over replicas on random ports, so which prompt lands on the
        # stopped engine varies run to run: send distinct secret prompts until one has failed over.
        # The aiohttp door fails over within the request; behind Envoy the request is a 503 (nothing was
        # sent) and the replica marked down.
        for attempt in range(40):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"my secret prompt {attempt} {marker}"}],
            }
            async with env.http.post(
                env.url + "/v1/chat/completions", json=body, headers=env.auth("acme")
            ) as r:
                assert r.status in (200, 503), await r.text()
            if "refused or did not accept a connection" in caplog.text:
                break
        await _sse(env, "acme", messages=[{"role": "user", "content": marker}])
        bad_key = {"Authorization": f"Bearer sk-{marker}"}
        await env.chat("acme", status=401, headers=bad_key)
        await env.chat("acme", status=403, model=marker)
        async with env.http.post(
            env.url + "/v1/chat/completions", data=f"{{{marker}", headers=env.auth("acme")
        ) as r:
            assert r.status == 400
        async with env.http.get(env.metrics_url + "/metrics") as r:
            metrics_text = await r.text()
        logged = caplog.text + "".join(str(rec.args) for rec in caplog.records)
        assert "refused or did not accept a connection" in logged  # the log did capture the warning
        for secret in (marker, env.keys["acme"][0]):
            assert secret not in logged
            assert secret not in metrics_text


# -- the official client --------------------------------------------------------------------------------
@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_openai_client_works_unchanged_streaming_included(tmp_path: Path, front_door: str) -> None:
    async with gateway_env(
        tmp_path, [ACME], engine_kwargs={"reply": "one two three"}, front_door=front_door
    ) as env:
        client = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=env.keys["acme"][0], max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "one two three"
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "onetwothree"  # the double sends the words as pieces without spaces
        comp = await client.completions.create(model=MODEL, prompt="say", max_tokens=5)
        assert comp.choices[0].text == "one two three"
        models = await client.models.list()
        assert [x.id for x in models.data] == [MODEL]
        bad = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        await client.close()
        await bad.close()


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_a_path_that_is_no_endpoint_is_404_and_a_wrong_method_405(
    tmp_path: Path, front_door: str
) -> None:
    async with gateway_env(tmp_path, [ACME], front_door=front_door) as env:
        for method, path, want in (("GET", "/v1/chat/completions", 405), ("POST", "/v2/nothing", 404)):
            async with env.http.request(method, env.url + path, headers=env.auth("acme"), json={}) as r:
                assert r.status == want
                assert (await r.json())["error"]["code"] == (
                    "not_found" if want == 404 else "method_not_allowed"
                )
                if want == 405:
                    assert r.headers["Allow"] == "POST"
        assert env.engines[0].received == []
