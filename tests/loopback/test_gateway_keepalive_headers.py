"""The header clock on a keep-alive connection: each request after the first gets its own header timeout,
whether its header block arrives in one read (the usual case, which the connection guard takes without
rescanning) or a byte at a time (a slow-loris on a connection that was let in with a good request).

Raw bytes over a real socket to a real gateway (``running_gateway``); ``GET /v1/models`` needs no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from gateway_support import TenantRow, build_keys, build_table, free_closed_port_url, write_config
from kvfleet_runtime.gateway.server import GatewaySettings, running_gateway

HEADER_TIMEOUT_S = 1.0


async def _answer(reader: asyncio.StreamReader) -> int:
    """The status of the next answer on the connection (its body read by ``Content-Length``)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    fields = dict(h.partition(": ")[::2] for h in lines[1:])
    length = int(next(v for k, v in fields.items() if k.lower() == "content-length"))
    await asyncio.wait_for(reader.readexactly(length), 10)
    return int(lines[0].split()[1])


async def test_every_request_on_a_kept_alive_connection_gets_its_own_header_clock(tmp_path: Path) -> None:
    rows = [TenantRow("acme")]
    keys, plain = build_keys(rows)
    config, keyfile = write_config(tmp_path, build_table(rows, {"shared": [free_closed_port_url()]}), keys)
    settings = GatewaySettings(config_path=config, keys_path=keyfile, header_timeout_s=HEADER_TIMEOUT_S)
    key = plain["acme"][0]
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    async with running_gateway(settings) as (url, gateway):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            # Requests whose header block comes in one read, with and without blank lines before them,
            # each kept waiting past the header timeout in between: the clock runs per request, not
            # per connection, and not between requests.
            for data in (request, request, b"\r\n" + request):
                writer.write(data)
                assert await _answer(reader) == 200
                await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)
            # A request in two reads, the split inside the blank line that ends its headers.
            cut = request.index(b"\r\n\r\n") + 2
            writer.write(request[:cut])
            await asyncio.sleep(0.2)
            writer.write(request[cut:])
            assert await _answer(reader) == 200
            # Then headers a byte at a time: 408 and the connection closed, within the timeout and a sweep.
            start = time.monotonic()

            async def drip() -> None:
                with contextlib.suppress(ConnectionError):
                    for byte in request:
                        writer.write(bytes([byte]))
                        await asyncio.sleep(0.1)

            dripping = asyncio.create_task(drip())
            got = b""
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(reader.read(4096), 10):
                    got += chunk
            closed_after = time.monotonic() - start
            dripping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dripping
            assert got.startswith(b"HTTP/1.1 408"), got[:40]
            assert closed_after < HEADER_TIMEOUT_S + 2
            assert gateway.guards.open == 0
        finally:
            writer.close()
