"""Requests aiohttp cannot parse get OpenAI's error shape from the gateway's public socket, not text/plain.

Raw bytes over a real socket to a real gateway (``running_gateway``: the ``GuardedSite`` the CLI serves);
the engine is never reached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from gateway_support import TenantRow, build_keys, build_table, free_closed_port_url, write_config
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway

MALFORMED = {
    "request-line": b"GARBAGE\r\n\r\n",
    "header-token": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    "content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "chunk-size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "header-line-too-long": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n",
}


async def _raw(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)  # the gateway closes the connection after it
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def test_malformed_requests_get_openai_errors_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [TenantRow("acme")]
    keys, _ = build_keys(rows)
    config, keyfile = write_config(tmp_path, build_table(rows, {"shared": [free_closed_port_url()]}), keys)
    caplog.set_level(logging.DEBUG)
    async with running_gateway(GatewaySettings(config_path=config, keys_path=keyfile)) as (url, _):
        for name, data in MALFORMED.items():
            status, headers, body = await _raw(url, data)
            assert status == 400, name
            assert headers["content-type"].startswith("application/json"), (name, headers)
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error", name
            assert error["code"] == "malformed_request", name
            assert error["message"].startswith("malformed HTTP request: "), name
            assert "\n" not in error["message"], name
            assert set(error) == {"message", "type", "param", "code"}
    # A client's malformed bytes are logged in one line, not as an ERROR with aiohttp's traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text
