"""The shared KV tier's server on a real loopback socket: it speaks the exact RESP subset LMCache's
connector sends and expects, and the launcher waits until the tier accepts before it starts LMCache.
The store behind it: tests/unit/test_build_shared_tier.py."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.config_watch import RuntimeConfigWatcher
from kvfleet_runtime.engine.l1_governance import compute_l1_limits
from kvfleet_runtime.engine.launcher import wait_for_tcp
from kvfleet_runtime.engine.shared_tier import SharedTierStore, serve
from shared_tier_builders import (
    CAPACITY,
    KEYS,
    salt_of,
    shared_tier_table,
    shared_tier_tenant,
    store_key,
)

# --- the server ------------------------------------------------------------------------------------------


def _resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def test_the_resp_subset_lmcaches_connector_speaks_on_a_real_socket(tmp_path: Path) -> None:
    """The exact bytes LMCache's C++ Redis connector sends and expects (csrc/storage_backends/redis)."""
    table = shared_tier_table(shared_tier_tenant("a", 10_000))
    (tmp_path / "t.json").write_text(table.model_dump_json())
    (tmp_path / "k.json").write_text(KEYS.model_dump_json())
    watcher = RuntimeConfigWatcher(tmp_path / "t.json", tmp_path / "k.json")

    def limits_of(config: Any) -> Any:
        return compute_l1_limits(config.table, config.keys, "shared", CAPACITY)

    store = SharedTierStore(CAPACITY, limits_of(watcher.load()))
    key, other = store_key(salt_of("a"), 7), store_key(salt_of("a"), 8)

    async def scenario() -> list[bytes]:
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(serve(store, watcher, limits_of, "127.0.0.1", 0, 0.05, bound.set_result))
        port = await bound
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        replies = []
        for command in (
            _resp(b"SET", key, b"\x00\r\n" * 4),
            _resp(b"EXISTS", key),
            _resp(b"GET", key),
            _resp(b"GET", other),
            _resp(b"EXISTS", other),
            _resp(b"DEL", key),
            _resp(b"DEL", key),
            _resp(b"FLUSHALL"),
        ):
            writer.write(command)
            await writer.drain()
            await asyncio.sleep(0.05)
            replies.append(await reader.read(1000))
        # A key longer than the server accepts closes the connection before the key is read.
        writer.write(b"*2\r\n$3\r\nGET\r\n$999999\r\n")
        await writer.drain()
        replies.append(await reader.read(1000))
        writer.close()
        server.cancel()
        return replies

    replies = asyncio.run(scenario())
    assert replies == [
        b"+OK\r\n",
        b":1\r\n",
        b"$12\r\n\x00\r\n\x00\r\n\x00\r\n\x00\r\n\r\n",
        b"$-1\r\n",
        b":0\r\n",
        b":1\r\n",
        b":0\r\n",
        b"-ERR unsupported command\r\n",
        b"",
    ]


def test_the_launcher_waits_for_the_tier_before_it_starts_lmcache() -> None:
    """LMCache's resp connector never reconnects, so ``kvfleet engine launch`` waits for the tier."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert wait_for_tcp("127.0.0.1", port, 5.0) < 5.0
    with pytest.raises(TimeoutError, match="did not accept"):
        wait_for_tcp("127.0.0.1", port, 0.5)  # closed now: nothing listens
