"""The shell of precise routing: one ZMQ subscription per engine replica feeding the pool's
``PrefixIndex`` (``kv_index.py``), and the tokenization that turns a request into the index's keys.

Each engine publishes its KV events on ``--kv-events-port`` (vLLM's ``ZmqEventPublisher``: multipart
``[topic, 8-byte big-endian sequence, msgpack KVEventBatch]``; the operator renders the engine's
``--kv-events-config`` and a NetworkPolicy that admits only this ModelDeployment's gateway and Endpoint
Picker pods there: events carry token ids). ZMQ reconnects by itself when an engine restarts; the index
sees the sequence start again and forgets the replica's old entries.

A request is tokenized by the engine itself (``POST /tokenize``, with the chat template for chat
requests), so its keys are exactly the engine's: the gateway ships no tokenizer and cannot disagree with
the engine's template. That is one extra local round trip, paid only by requests of a tenant the index
holds blocks for, in a pool of two replicas or more (``Pipeline.plan_route``); a failed or slow answer
only means the request is routed by affinity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from kvfleet_runtime.gateway.kv_index import Cleared, PrefixIndex, Removed, Stored, parse_events
from kvfleet_runtime.gateway.metrics import GatewayMetrics

log = logging.getLogger("kvfleet.gateway.kv_events")

#: The ``kind`` label of ``kvfleet_gateway_kv_events_total`` for each event.
EVENT_KINDS: dict[type, str] = {Stored: "stored", Removed: "removed", Cleared: "cleared"}

#: The request fields vLLM's ``/tokenize`` takes for a chat request besides the messages.
CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def events_address(replica_url: str, port: int) -> str:
    """The ZMQ address of ``replica_url``'s KV events on ``port`` of its host."""
    host = urlsplit(replica_url).hostname or ""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def pool_event_addresses(endpoints: list[str], listed: list[str], port: int | None) -> dict[str, str]:
    """Replica URL -> where to follow its KV events: the table's ``kv_events_endpoints`` (same order as
    ``endpoints``) where it lists them, else ``port`` on the replica's host; a replica with neither is
    not followed (routed by affinity)."""
    out: dict[str, str] = {}
    for i, url in enumerate(e.rstrip("/") for e in endpoints):
        if i < len(listed) and listed[i]:
            out[url] = listed[i]
        elif port is not None:
            out[url] = events_address(url, port)
    return out


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """What to ask ``/tokenize`` for the request ``body`` (the bytes sent upstream), its token ids when it
    already is some, or ``None`` when it cannot be keyed (a batch of prompts, media content)."""
    messages = body.get("messages")
    if messages is not None:
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                not isinstance(p, dict) or p.get("type") != "text" for p in content
            ):
                return None
        ask: dict[str, Any] = {"model": body.get("model"), "messages": messages}
        ask.update({k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body})
        return ask
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        ask = {"model": body.get("model"), "prompt": prompt}
        if "add_special_tokens" in body:
            ask["add_special_tokens"] = body["add_special_tokens"]
        return ask
    return None


async def tokenize(
    session: aiohttp.ClientSession, replica_url: str, payload: bytes, timeout_s: float
) -> list[int] | None:
    """The token ids the engine at ``replica_url`` runs for the request ``payload``; ``None`` when it
    cannot say within ``timeout_s`` (the request is then routed by affinity)."""
    try:
        body = json.loads(payload)
    except ValueError:
        return None
    ask = tokenize_request(body) if isinstance(body, dict) else None
    if ask is None or isinstance(ask, list):
        return ask
    try:
        async with session.post(
            replica_url + "/tokenize", json=ask, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            answer = await resp.json()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return tokens if isinstance(tokens, list) else None


class KvEventFeeds:
    """One index per pool, fed by one subscription per replica; ``sync`` follows the pools' replicas."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.clock = clock
        self.indexes: dict[str, PrefixIndex] = {}
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        self._decoder = msgspec.msgpack.Decoder()

    def index(self, pool: str) -> PrefixIndex:
        index = self.indexes.get(pool)
        if index is None:
            index = self.indexes[pool] = PrefixIndex(self.ttl_s)
            self.metrics.kv_index_blocks.labels(pool).set_function(lambda: float(index.size))
        return index

    def sync(self, pools: Mapping[str, Mapping[str, str]]) -> None:
        """Follow every replica of ``pools`` (pool -> replica URL -> its events' address), stop following
        the others and forget what their engines held."""
        wanted = {(pool, url, at) for pool, replicas in pools.items() for url, at in replicas.items()}
        for key in [k for k in self._tasks if k not in wanted]:
            self._tasks.pop(key).cancel()
            pool, url, _ = key
            if pool in self.indexes and url in pools.get(pool, {}):
                self.indexes[pool].forget(url)  # followed elsewhere now: what it said no longer holds
        for pool in pools:
            for gone in self.index(pool).retain(url for p, url, _ in wanted if p == pool):
                log.info("replica %s left pool %s: its KV blocks are forgotten", gone, pool)
                self.metrics.kv_index_resets.labels(pool, "left").inc()
        for pool in [p for p in self.indexes if p not in pools]:
            del self.indexes[pool]
        for pool, url, address in wanted - set(self._tasks):
            self._tasks[(pool, url, address)] = asyncio.create_task(
                self._follow(pool, url, address), name=f"kvfleet-kv-events-{pool}"
            )

    async def _follow(self, pool: str, url: str, address: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        try:
            while True:
                frames = await sock.recv_multipart()
                self._take(pool, url, frames)
        finally:
            sock.close(linger=0)

    def _take(self, pool: str, url: str, frames: list[bytes]) -> None:
        index = self.indexes.get(pool)
        if index is None:
            return
        try:
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            events = parse_events(self._decoder.decode(payload))
        except (ValueError, KeyError, TypeError, msgspec.DecodeError):
            # Something else on the port, or a format this gateway does not know: its entries would be
            # a guess from here on.
            self.metrics.kv_events.labels(pool, "undecodable").inc()
            index.forget(url)
            return
        if seq < 0:  # the publisher's end-of-stream marker
            return
        reset = index.observe(url, seq, events, self.clock())
        if reset is not None:
            log.info("KV events of replica %s (pool %s): %s; its entries are forgotten", url, pool, reset)
            self.metrics.kv_index_resets.labels(pool, reset).inc()
        for kind, n in Counter(EVENT_KINDS[type(event)] for event in events).items():
            self.metrics.kv_events.labels(pool, kind).inc(n)
            if kind == "cleared":
                self.metrics.kv_index_resets.labels(pool, "cleared").inc(n)

    async def expire_loop(self, every_s: float = 60.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            now = self.clock()
            for pool, index in self.indexes.items():
                if dropped := index.expire(now):
                    self.metrics.kv_index_resets.labels(pool, "expired").inc(dropped)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)
