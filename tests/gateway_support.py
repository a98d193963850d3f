"""Support for the gateway tests: an OpenAI-shaped upstream, tenant-table builders and the gateway as a
process (no tests here).

``FakeEngine`` is a test double for the *HTTP shape* of vLLM's OpenAI server only (routes, JSON and SSE
framing, ``usage``, ``/health``); the gateway's behaviour against the real vLLM is tested in
tests/engine/test_gateway_vllm.py. It records what reached it, so tests can check what the gateway
rewrote and how many times a request reached an engine, counts handlers cancelled by a client
disconnect, and can fail the way a crashing engine does (drop the connection after reading a request,
or in the middle of a stream).

``gateway_process`` runs the real gateway (``python -m kvfleet_runtime gateway``) as its own process on
real sockets, for the attack tests in tests/security.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from factories import free_port
from kvfleet_runtime.config import (
    TIER_PRIORITY,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    RateLimits,
    SlaTier,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.gateway.envoy import running_envoy_gateway
from kvfleet_runtime.gateway.metrics import GatewayMetrics
from kvfleet_runtime.gateway.pipeline import Pipeline
from kvfleet_runtime.gateway.server import Gateway, running_gateway
from kvfleet_runtime.gateway.settings import GatewaySettings

MODEL = "tiny-llama"


def sum_samples(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` in a ``/metrics`` page whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float


@dataclass
class FakeEngine:
    """An OpenAI-compatible upstream answering a canned completion."""

    reply: str = "hello from the engine"
    delay_s: float = 0.0
    stream_chunks: int = 3
    chunk_interval_s: float = 0.0
    healthy: bool = True
    status: int = 200
    #: Drop the connection after reading a request, without answering (an engine that crashed on it).
    drop_after_request: bool = False
    #: Drop the connection after this many streamed chunks (an engine that died mid-answer).
    break_stream_after: int | None = None
    #: End a stream without its ``data: [DONE]`` event.
    omit_done: bool = False
    received: list[Received] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    _seen_prefixes: set[tuple[str, str]] = field(default_factory=set)
    url: str = ""
    _runner: web.AppRunner | None = None

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = json.dumps(body.get("messages") or body.get("prompt"))
        prompt_tokens = max(1, len(prompt) // 4)
        key = (str(body.get("cache_salt")), prompt)
        cached = prompt_tokens if key in self._seen_prefixes else 0
        self._seen_prefixes.add(key)
        completion_tokens = len(self.reply.split())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, dict(request.headers), body, time.monotonic()))
        chat = request.path.endswith("/chat/completions")
        try:
            if self.drop_after_request:
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(3600)  # cancelled by the lost connection
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.json_response(
                    {"error": {"message": "engine failure", "type": "server_error", "code": self.status}},
                    status=self.status,
                )
            usage = self._usage(body)
            rid = request.headers.get("X-Request-Id", "x")
            if body.get("stream"):
                return await self._stream(request, body, usage, rid, chat)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            if chat:
                choice["message"] = {"role": "assistant", "content": self.reply}
            else:
                choice["text"] = self.reply
            answer = {
                "id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
            }
            self.finished += 1
            return web.json_response(answer)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _stream(
        self, request: web.Request, body: dict[str, Any], usage: dict[str, Any], rid: str, chat: bool
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        words = self.reply.split()
        per = max(1, len(words) // max(1, self.stream_chunks))
        pieces = [" ".join(words[i : i + per]) for i in range(0, len(words), per)] or [""]
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": 0, "model": body.get("model")}
        for i, piece in enumerate(pieces):
            if self.break_stream_after is not None and i == self.break_stream_after:
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(3600)  # cancelled by the lost connection
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None}
            if i == len(pieces) - 1:
                choice["finish_reason"] = "stop"
            chunk = {
                **base,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [choice],
            }
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.chunk_interval_s:
                await asyncio.sleep(self.chunk_interval_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if not self.omit_done:
            await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        self.finished += 1
        return out

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # what the gateway forwards, it takes
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@contextlib.asynccontextmanager
async def fake_engines(n: int, **kwargs: Any) -> AsyncIterator[list[FakeEngine]]:
    engines = [FakeEngine(**kwargs) for _ in range(n)]
    for e in engines:
        await e.start()
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop()


def free_closed_port_url() -> str:
    """A URL on a local port nothing listens on (connect is refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


@dataclass
class TenantRow:
    name: str
    tier: SlaTier = SlaTier.STANDARD
    isolation: Isolation = Isolation.SALTED
    pool: str = "shared"
    models: tuple[str, ...] = (MODEL,)
    rate_limits: RateLimits = field(default_factory=RateLimits)
    hbm_burst_blocks: int = 0
    keys: int = 1
    fair_share_weight: float = 1.0


def build_table(tenants: list[TenantRow], pools: dict[str, list[str]], block_size: int = 16) -> TenantTable:
    entries = {}
    for t in tenants:
        salt_id = "pool-shared" if t.isolation is Isolation.SHARED else f"tenant-{t.name}"
        entries[t.name] = TenantEntry(
            name=t.name,
            tier=t.tier,
            priority=TIER_PRIORITY[t.tier],
            isolation=t.isolation,
            salt_id=salt_id,
            pool=t.pool,
            models=list(t.models),
            quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=t.hbm_burst_blocks),
            rate_limits=t.rate_limits,
            fair_share_weight=t.fair_share_weight,
        )
    return TenantTable(
        model_deployment="md",
        served_model_name=MODEL,
        pool_salt_id="pool-shared",
        pools={
            name: PoolEntry(name=name, endpoints=urls, block_size=block_size, hbm_blocks_per_replica=1000)
            for name, urls in pools.items()
        },
        tenants=entries,
    )


def build_keys(
    tenants: list[TenantRow], salt_key_hex: str | None = None
) -> tuple[KeyFile, dict[str, list[str]]]:
    """A key file and the plaintext keys per tenant (for the test client only)."""
    plain = {t.name: [f"sk-{t.name}-{secrets.token_hex(16)}" for _ in range(t.keys)] for t in tenants}
    keyfile = KeyFile(
        salt_key_hex=salt_key_hex or secrets.token_hex(32),
        key_hashes={name: [hash_api_key(k) for k in ks] for name, ks in plain.items()},
    )
    return keyfile, plain


def write_config(directory: Path, table: TenantTable, keys: KeyFile) -> tuple[Path, Path]:
    config = directory / "tenants.json"
    keyfile = directory / "keys.json"
    config.write_text(dump_json(table))
    keyfile.write_text(dump_json(keys))
    return config, keyfile


@dataclass
class GatewayProcess:
    """A running ``kvfleet gateway`` process."""

    url: str
    metrics_url: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def open_fds(self) -> int:
        """File descriptors the gateway process holds (sockets included)."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")


@contextlib.asynccontextmanager
async def process(log_path: Path, *command: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``command`` as a process (its output in ``log_path``) until the block ends, then SIGTERM (SIGKILL
    after 15 s)."""
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def gateway_process(
    directory: Path, config: Path, keys: Path, *flags: str, ready_timeout_s: float = 60.0
) -> AsyncIterator[GatewayProcess]:
    """Start the gateway as a process (public and metrics ports on loopback), wait until it is ready
    (it has loaded the table and found a healthy engine), yield it, then stop it with SIGTERM."""
    port, metrics_port = free_port(), free_port()
    log_path = directory / f"gateway-{port}.log"
    command = [
        sys.executable, "-m", "kvfleet_runtime", "gateway", "--config", str(config), "--keys", str(keys),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
        "--health-interval", "0.5", "--reload-interval", "0.2", *flags,
    ]  # fmt: skip
    async with process(log_path, *command) as proc:
        gateway = GatewayProcess(
            f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}", proc, log_path
        )
        deadline = time.monotonic() + ready_timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if proc.returncode is not None:
                    raise AssertionError(
                        f"the gateway exited with {proc.returncode}:\n{gateway.log()[-3000:]}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(gateway.url + "/readyz") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise AssertionError(f"the gateway was not ready in time:\n{gateway.log()[-3000:]}")
                await asyncio.sleep(0.1)
        yield gateway


async def _flood(url: str, key: str, body: bytes, seconds: float, concurrency: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    end = time.monotonic() + seconds

    async def one(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            async with http.post(url, data=body, headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(http) for _ in range(concurrency)))
    return statuses


async def flood_from_another_process(
    url: str, key: str, body_path: Path, seconds: float, concurrency: int
) -> dict[int, int]:
    """POST the body at ``body_path`` to ``url`` from ``concurrency`` connections for ``seconds``, from a
    process of its own (an attacker is another client: its sending must not slow the test's own
    measurements), and return how many answers of each status it got."""
    code = (
        "import asyncio, json, sys; from pathlib import Path; import gateway_support as g; "
        "print(json.dumps(asyncio.run(g._flood(sys.argv[1], sys.argv[2], Path(sys.argv[3]).read_bytes(), "
        "float(sys.argv[4]), int(sys.argv[5])))))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, url, key, str(body_path), str(seconds), str(concurrency),
        stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    return {int(k): v for k, v in json.loads(out).items()}


#: The two front doors the tenancy tests run through: kvfleet's own aiohttp gateway, and real Envoy 1.40
#: with kvfleet's Endpoint Picker behind it (gateway/envoy.py, gateway/epp.py).
FRONT_DOORS = ("aiohttp", "envoy")


@dataclass(frozen=True)
class FrontDoor:
    """A running front door: its public URL, the pipeline behind it, its ``/metrics`` URL, and the aiohttp
    gateway itself (None behind Envoy)."""

    url: str
    pipeline: Pipeline
    metrics_url: str
    gateway: Gateway | None


@contextlib.asynccontextmanager
async def running_front_door(settings: GatewaySettings, kind: str, workdir: Path) -> AsyncIterator[FrontDoor]:
    """``kind`` (one of ``FRONT_DOORS``) on free loopback ports, with ``settings``, until the block ends."""
    if kind == "envoy":
        async with running_envoy_gateway(settings, workdir / "envoy") as envoy:
            yield FrontDoor(envoy.url, envoy.picker.pipeline, envoy.metrics_url, None)
    else:
        async with running_gateway(settings) as (url, gateway):
            yield FrontDoor(url, gateway.pipeline, gateway.metrics_url, gateway)


@contextlib.contextmanager
def serving_gateway_metrics() -> Iterator[tuple[GatewayMetrics, int]]:
    """A gateway's metrics registry served on a free loopback port (what a Prometheus scrapes when the
    queue series are set by hand, as the autoscaling tests and benchmarks do): the registry and the port."""
    metrics = GatewayMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        yield metrics, port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
