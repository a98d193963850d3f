"""The pool's shared KV tier: one server every engine replica of the pool stores chunks to and reads from.

``kvfleet engine shared-tier --config ... --keys ... --pool shared --size-bytes N`` runs it (the operator
renders one per ModelDeployment with ``spec.kvCache.shared``). Each replica's LMCache server reaches it
through LMCache 0.5.6's ``resp`` L2 adapter (its C++ Redis connector, ``engine.launcher.build_lmcache_args``),
so a chunk one replica computed is a hit on every other replica. The connector speaks a fixed subset of
RESP: ``SET``/``GET``/``EXISTS``/``DEL`` (and ``AUTH`` when given a password, which kvfleet does not);
nothing else is served.

Per-salt governance is the same as in every replica's L1 (``l1_governance``): an :class:`L1Governor` on
the tier's size, limits from :func:`compute_l1_limits` (a salt's quota and TTL are its tenants' CPU-tier
quota and TTL, the burst cap the pool's ``burst_cap`` of the shared size). Differences, and why:

* Allowlist: a chunk whose salt is not one of the pool's salts in the tenant table (an unsalted chunk, a
  removed tenant, another pool's tenant) is acknowledged and not stored, so nothing can fill the tier
  under a salt no quota governs. ``GET``/``EXISTS`` of it miss.
* Quotas are enforced on every ``SET`` (not once a second): a salt over its burst cap loses its own least
  recently used chunks at once, and a full tier is brought back under ``1 - EVICTION_RATIO`` of its size by
  the policy order (expired, most over quota, global LRU).
* TTL expiry and the deletion of removed tenants' chunks run once a second with the tenant-table reload.

Isolation: LMCache puts the ``cache_salt`` in every key (``<model>@<rank>@<group>@<hash>@<salt>``), so one
salt can never read another's chunk; the tier's port is reachable only from the pool's engine pods
(``NetworkPolicy``, ``kvfleet_operator.build.network``).

Metrics (``--metrics-port``, Prometheus; no KV on that port): ``kvfleet_shared_tier_bytes{salt_hash}``,
``kvfleet_shared_tier_quota_bytes{salt_hash}``, ``kvfleet_shared_tier_burst_bytes{salt_hash}``,
``kvfleet_shared_tier_evictions_total{salt_hash,reason}``, ``kvfleet_shared_tier_requests_total
{salt_hash,op,result}`` (``op`` get/exists/set; ``result`` hit/miss/stored/refused). A salt is never a label
value, only its ``salt_labels.salt_hash``: the salt is what confines a request to its tenant's KV.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, start_http_server

from kvfleet_runtime.config import SHARED_TIER_METRICS_PORT, SHARED_TIER_PORT
from kvfleet_runtime.config_watch import RuntimeConfig, RuntimeConfigWatcher
from kvfleet_runtime.engine.governor_metrics import GovernorMetrics
from kvfleet_runtime.engine.l1_governance import L1Governor, L1Limits, compute_l1_limits
from kvfleet_runtime.engine.salt_labels import SALT_LABEL, salt_hash

__all__ = ["MAX_KEY_BYTES", "MAX_VALUE_BYTES", "SharedTierStore", "salt_of_key", "serve"]

log = logging.getLogger("kvfleet.shared_tier")

#: Freed on a full tier: down to ``1 - EVICTION_RATIO`` of the size (as LMCache's own L2 eviction).
EVICTION_RATIO = 0.05
#: Largest key and value a client may send; a bigger one closes the connection before it is read. A
#: chunk is ``chunk_size x KV bytes per token`` (256 tokens of a 70B FP8 model: ~40 MiB).
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 30
#: LMCache's key separator (``@`` is refused inside a model name or salt, so the split is unambiguous).
_KEY_SEP = b"@"
_SALTED_KEY_FIELDS = 5


def salt_of_key(key: bytes) -> str:
    """The ``cache_salt`` in an LMCache native-connector key; ``""`` for an unsalted key."""
    fields = key.split(_KEY_SEP)
    return fields[-1].decode("utf-8", "replace") if len(fields) == _SALTED_KEY_FIELDS else ""


class SharedTierMetrics(GovernorMetrics):
    """The tier's series (default registry, served on ``--metrics-port``): the governor's per-salt ones and
    requests by salt, operation and result."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__("kvfleet_shared_tier", "the shared tier", "Chunks", hashed=True, registry=registry)
        self.requests = Counter(
            "kvfleet_shared_tier_requests",
            "Requests by salt (its salt_hash), operation and result.",
            [SALT_LABEL, "op", "result"],
            registry=registry,
        )


class SharedTierStore:
    """The chunks and their governance; no I/O. Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        capacity_bytes: int,
        limits: L1Limits,
        metrics: SharedTierMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity_bytes
        self.governor = L1Governor(capacity_bytes, limits, clock)
        self.metrics = metrics
        self._data: dict[bytes, bytes] = {}

    def _count(self, salt: str, op: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(salt_hash(salt), op, result).inc()

    def _allowed(self, salt: str) -> bool:
        return salt in self.governor.limits.per_salt

    def set(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key`` if its salt is governed here, then enforce the quotas; ``True`` when
        stored (it may be the first victim of a full tier, like any chunk)."""
        salt = salt_of_key(key)
        if not self._allowed(salt):
            self._count(salt, "set", "refused")
            return False
        self._data[key] = value
        self.governor.on_stored([(key, salt, len(value))])
        self._drop(self.governor.select(self.governor.tracked_bytes, self.capacity, 1.0, EVICTION_RATIO))
        self._count(salt, "set", "stored")
        return True

    def get(self, key: bytes) -> bytes | None:
        value = self._data.get(key)
        salt = salt_of_key(key)
        self._count(salt, "get", "miss" if value is None else "hit")
        if value is not None:
            self.governor.on_used([key])
        return value

    def exists(self, key: bytes) -> bool:
        found = key in self._data
        self._count(salt_of_key(key), "exists", "hit" if found else "miss")
        return found

    def delete(self, key: bytes) -> bool:
        if self._data.pop(key, None) is None:
            return False
        self.governor.on_removed([key])
        return True

    def set_limits(self, limits: L1Limits) -> None:
        self.governor.set_limits(limits)

    def cycle(self) -> None:
        """Once a second: TTL expiry, burst caps, chunks of salts that left the table."""
        for key, _, _ in self.governor.take_removed():
            self._data.pop(key, None)  # type: ignore[call-overload]
        self._drop(self.governor.select(self.governor.tracked_bytes, self.capacity, 1.0, EVICTION_RATIO))
        if self.metrics is not None:
            self.metrics.publish(self.governor)

    def _drop(self, victims: Sequence[object]) -> None:
        for victim in victims:
            self._data.pop(victim.key, None)  # type: ignore[attr-defined]

    @property
    def stored_bytes(self) -> int:
        return sum(len(v) for v in self._data.values())


# --- RESP, the subset LMCache's connector sends ------------------------------------------------------


class ProtocolError(Exception):
    """The client sent something this server does not speak; the connection is closed."""


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readuntil(b"\r\n")
    return line[:-2]


async def read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """One RESP array of bulk strings; ``None`` at a clean end of stream. Raises :class:`ProtocolError`
    for anything else, or a key/value above ``MAX_KEY_BYTES``/``MAX_VALUE_BYTES``."""
    try:
        header = await _read_line(reader)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ProtocolError("truncated command") from exc
        return None
    if not header.startswith(b"*") or not header[1:].isdigit() or not 1 <= int(header[1:]) <= 3:
        raise ProtocolError("expected an array of 1-3 bulk strings")
    parts: list[bytes] = []
    for i in range(int(header[1:])):
        size_line = await _read_line(reader)
        if not size_line.startswith(b"$") or not size_line[1:].isdigit():
            raise ProtocolError("expected a bulk string")
        size = int(size_line[1:])
        if size > (MAX_VALUE_BYTES if i == 2 else MAX_KEY_BYTES):
            raise ProtocolError("bulk string too large")
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise ProtocolError("bulk string without CRLF")
        parts.append(data[:-2])
    return parts


def answer(store: SharedTierStore, command: list[bytes]) -> list[bytes]:
    """The reply to one command (buffers to write, in order)."""
    name, args = command[0].upper(), command[1:]
    if name == b"GET" and len(args) == 1:
        value = store.get(args[0])
        if value is None:
            return [b"$-1\r\n"]
        return [b"$%d\r\n" % len(value), value, b"\r\n"]
    if name == b"SET" and len(args) == 2:
        store.set(args[0], args[1])
        return [b"+OK\r\n"]  # also when refused: the connector expects exactly +OK (a miss follows)
    if name == b"EXISTS" and len(args) == 1:
        return [b":1\r\n" if store.exists(args[0]) else b":0\r\n"]
    if name == b"DEL" and len(args) == 1:
        return [b":1\r\n" if store.delete(args[0]) else b":0\r\n"]
    if name == b"PING" and not args:
        return [b"+PONG\r\n"]
    return [b"-ERR unsupported command\r\n"]


async def handle_connection(
    store: SharedTierStore, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while (command := await read_command(reader)) is not None:
            writer.writelines(answer(store, command))
            await writer.drain()
    except (ProtocolError, asyncio.LimitOverrunError, ConnectionError) as exc:
        log.warning("closing a connection: %s", exc)
    except asyncio.IncompleteReadError:
        log.warning("closing a connection: truncated command")
    finally:
        writer.close()


async def serve(
    store: SharedTierStore,
    watcher: RuntimeConfigWatcher,
    limits_of: Callable[[RuntimeConfig], L1Limits],
    host: str,
    port: int,
    interval_s: float = 1.0,
    started: Callable[[int], None] | None = None,
) -> None:
    """Serve until cancelled; reload the tenant table and run :meth:`SharedTierStore.cycle` each
    ``interval_s``. ``started`` gets the bound port."""
    server = await asyncio.start_server(
        lambda r, w: handle_connection(store, r, w), host, port, limit=MAX_KEY_BYTES + 64
    )
    if started is not None:
        started(int(server.sockets[0].getsockname()[1]))
    async with server:
        while True:
            failures = watcher.failures
            config = await watcher.poll_async()
            if config is not None:
                try:
                    store.set_limits(limits_of(config))
                    _reload(store, "ok")
                except ValueError as exc:  # e.g. this pool left the table: keep the previous limits
                    _reload(store, "error")
                    log.warning("tenant table reload failed, keeping the previous limits: %s", exc)
            elif watcher.failures > failures:
                _reload(store, "error")
            store.cycle()
            await asyncio.sleep(interval_s)


def _reload(store: SharedTierStore, result: str) -> None:
    if store.metrics is not None:
        store.metrics.reloads.labels(result).inc()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="The tenant table (tenants.json).")
    parser.add_argument("--keys", type=Path, required=True, help="The key file (keys.json).")
    parser.add_argument("--pool", default="shared", help="The pool whose salts the tier serves.")
    parser.add_argument("--size-bytes", type=int, required=True, help="The tier's size in bytes.")
    # The pod's address: the engine pods dial it; NetworkPolicy admits only them.
    parser.add_argument("--host", default="0.0.0.0", help="Bind address.")  # noqa: S104
    parser.add_argument("--port", type=int, default=SHARED_TIER_PORT)
    parser.add_argument("--metrics-port", type=int, default=SHARED_TIER_METRICS_PORT)


def run(args: argparse.Namespace) -> int:
    """``kvfleet engine shared-tier``: serve until killed. A bad table at start fails at once."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watcher = RuntimeConfigWatcher(args.config, args.keys, logger=log)

    def limits_of(config: RuntimeConfig) -> L1Limits:
        return compute_l1_limits(config.table, config.keys, args.pool, args.size_bytes)

    metrics = SharedTierMetrics()
    store = SharedTierStore(args.size_bytes, limits_of(watcher.load()), metrics)
    start_http_server(args.metrics_port, addr=args.host)
    log.info(
        "kvfleet shared KV tier: %d bytes for pool %r on %s:%d",
        args.size_bytes,
        args.pool,
        args.host,
        args.port,
    )
    asyncio.run(serve(store, watcher, limits_of, args.host, args.port))
    return 0
