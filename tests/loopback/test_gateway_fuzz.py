"""Fuzzed bad input: every malformed request gets a 4xx with a clear JSON message; the gateway stays up.

The gateway runs on its own event loop in a thread (module scope), so hypothesis drives it with plain
blocking HTTP from the test thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_support import MODEL, FakeEngine, TenantRow, build_keys, build_table, write_config
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway

MAX_BODY = 64 * 1024


@dataclass
class Live:
    host: str
    port: int
    key: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    started = threading.Event()
    stop: dict[str, Any] = {}
    info: dict[str, Any] = {}

    async def main() -> None:
        engine = FakeEngine()
        await engine.start()
        tenants = [TenantRow("fuzz")]
        keyfile, plain = build_keys(tenants)
        config, keys_path = write_config(tmp, build_table(tenants, {"shared": [engine.url]}), keyfile)
        s = GatewaySettings(
            config_path=config, keys_path=keys_path, max_body_bytes=MAX_BODY, body_timeout_s=0.5
        )
        async with running_gateway(s) as (url, _gw):
            info["url"], info["key"] = url, plain["fuzz"][0]
            event = asyncio.Event()
            stop["event"], stop["loop"] = event, asyncio.get_running_loop()
            started.set()
            await event.wait()
        await engine.stop()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(10)
    host, port = info["url"].removeprefix("http://").split(":")
    yield Live(host, int(port), info["key"])
    stop["loop"].call_soon_threadsafe(stop["event"].set)
    thread.join(10)


def _post(live: Live, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(live.host, live.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else None
    finally:
        conn.close()


def _assert_clear_4xx(status: int, data: Any) -> None:
    assert 400 <= status < 500, (status, data)
    assert isinstance(data, dict) and isinstance(data["error"]["message"], str) and data["error"]["message"]


def _alive(live: Live) -> None:
    status, data = _post(
        live,
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        {"Authorization": f"Bearer {live.key}"},
    )
    assert status == 200, data


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
bad_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": json_values,
        "prompt": json_values,
        "stream": json_values,
        "max_tokens": json_values,
        "n": json_values,
        "stream_options": json_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_garbage_bodies_get_a_clear_4xx(live: Live, body: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        status, data = _post(live, path, body, {"Authorization": f"Bearer {live.key}"})
        _assert_clear_4xx(status, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=bad_fields)
def test_wrong_types_and_missing_fields_get_a_clear_4xx_or_pass(live: Live, fields: dict[str, Any]) -> None:
    status, data = _post(
        live, "/v1/chat/completions", json.dumps(fields).encode(), {"Authorization": f"Bearer {live.key}"}
    )
    if status == 200:  # a well-formed request slipped through: the upstream answered it
        assert fields.get("model") == MODEL
    else:
        _assert_clear_4xx(status, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    auth=st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=80)
    | st.binary(max_size=60).map(lambda b: "Bearer " + b.hex())
)
def test_bad_keys_get_401(live: Live, auth: str) -> None:
    headers = {"Authorization": auth} if auth.isprintable() and auth.strip() == auth else {}
    status, data = _post(live, "/v1/chat/completions", b'{"model": "x"}', headers)
    assert status == 401
    _assert_clear_4xx(status, data)


def test_huge_bodies_get_413_with_or_without_content_length(live: Live) -> None:
    auth = {"Authorization": f"Bearer {live.key}"}
    status, data = _post(live, "/v1/chat/completions", b"x" * (MAX_BODY + 1), auth)
    assert status == 413
    _assert_clear_4xx(status, data)
    conn = http.client.HTTPConnection(live.host, live.port, timeout=10)
    chunks = (b"y" * 8192 for _ in range(MAX_BODY // 8192 + 2))
    conn.request(
        "POST",
        "/v1/completions",
        body=chunks,
        headers={**auth, "Transfer-Encoding": "chunked"},
        encode_chunked=True,
    )
    resp = conn.getresponse()
    assert resp.status == 413
    _assert_clear_4xx(resp.status, json.loads(resp.read()))
    conn.close()
    _alive(live)


def test_slow_clients_get_408_and_do_not_block_others(live: Live) -> None:
    sock = socket.create_connection((live.host, live.port), timeout=10)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {live.key}\r\nContent-Length: 100\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"model": ')
    _alive(live)  # served while the slow client dawdles
    time.sleep(0.8)
    reply = sock.recv(65536).decode()
    sock.close()
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert "not received within" in reply
    _alive(live)


def test_unknown_routes_and_methods_get_json_errors(live: Live) -> None:
    conn = http.client.HTTPConnection(live.host, live.port, timeout=10)
    for method, path, want in (("GET", "/v1/chat/completions", 405), ("POST", "/v2/nothing", 404)):
        conn.request(method, path)
        resp = conn.getresponse()
        assert resp.status == want
        _assert_clear_4xx(resp.status, json.loads(resp.read()))
    conn.close()
    _alive(live)
