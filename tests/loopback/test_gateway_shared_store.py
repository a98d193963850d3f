"""Gateway replicas split a tenant's rate limits through a real shared store (Debian's redis-server, with
a password; gateway/shared_store.py): a tenant whose traffic all lands on one replica gets its whole
limit there instead of 1/replicas, and when the store is killed each replica falls back to its static
share within a second, answering every request meanwhile (200 or 429, never an error); when a replica is
killed, the survivor's clients see no error and it takes the whole limit once the store drops the dead one.

Two real gateway processes; the engine is ``FakeEngine`` (the rate limits are the gateway's alone, and an
engine that answers at once keeps the test short). The measured version, with 2 and 4 replicas over a
minute each, is benchmarks/gateway/shared_limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from devcluster.shared_store import SharedStoreServer, start_shared_store
from prometheus_client.parser import text_string_to_metric_families

from components import missing_component
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
from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV

RPM = 600
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[SharedStoreServer]:
    try:
        server = start_shared_store()
    except FileNotFoundError as exc:
        missing_component(f"redis-server ({exc})", "bash hack/provision.d/10-cluster.sh")
    monkeypatch.setenv(PASSWORD_ENV, server.password)  # the gateways inherit it, as from a Secret
    try:
        yield server
    finally:
        server.stop()


async def gauge(http: aiohttp.ClientSession, gw: GatewayProcess, name: str) -> float:
    async with http.get(gw.metrics_url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not on {gw.metrics_url}/metrics")


async def wait_gauge(
    http: aiohttp.ClientSession, gw: GatewayProcess, name: str, want: float, timeout_s: float
) -> float:
    """Seconds until ``name`` reads ``want`` (fails after ``timeout_s``)."""
    start = time.monotonic()
    while (value := await gauge(http, gw, name)) != want:
        assert time.monotonic() - start < timeout_s, f"{name} still {value} after {timeout_s} s, not {want}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


class Load:
    """Clients sending to one gateway as fast as it admits (a 429 waits 50 ms), counting statuses."""

    def __init__(self, http: aiohttp.ClientSession, gw: GatewayProcess, key: str) -> None:
        self.http, self.gw, self.key = http, gw, key
        self.statuses: Counter[int] = Counter()

    async def _client(self) -> None:
        while True:
            async with self.http.post(
                self.gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {self.key}"},
            ) as r:
                await r.read()
                self.statuses[r.status] += 1
            if r.status == 429:
                await asyncio.sleep(0.05)

    @contextlib.asynccontextmanager
    async def running(self, clients: int = 4) -> AsyncIterator[Load]:
        tasks = [asyncio.create_task(self._client()) for _ in range(clients)]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def first_refusal(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.statuses[429]:
                return
            assert time.monotonic() < deadline, f"no 429 in {timeout_s} s: {self.statuses}"
            await asyncio.sleep(0.1)

    async def admitted_in(self, seconds: float) -> int:
        before = self.statuses[200]
        await asyncio.sleep(seconds)
        return self.statuses[200] - before


async def test_replicas_split_a_limit_by_where_traffic_lands_and_fall_back_when_the_store_dies(
    tmp_path: Path, store: SharedStoreServer
) -> None:
    tenants = [TenantRow("acme", rate_limits=RateLimits(requests_per_minute=RPM))]
    keys, plain = build_keys(tenants)
    async with fake_engines(1) as engines, aiohttp.ClientSession() as http:
        config, keys_path = write_config(tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys)
        flags = ("--replicas", "2", "--shared-store", store.url, "--parse-workers", "0")
        async with (
            gateway_process(tmp_path, config, keys_path, *flags) as a,
            gateway_process(tmp_path, config, keys_path, *flags) as b,
        ):
            for gw in (a, b):
                await wait_gauge(http, gw, "kvfleet_gateway_shared_store_replicas", 2, 5)
            assert await gauge(http, a, "kvfleet_gateway_shared_store_up") == 1
            load = Load(http, a, plain["acme"][0])
            async with load.running():
                # The first seconds spend the full bucket; then replica a admits at its rate, which the
                # split gives almost all of the limit (every request lands on a, none on b).
                await load.first_refusal(timeout_s=30)
                await asyncio.sleep(1.0)
                shared = await load.admitted_in(4.0)
                store.kill()
                fell_back_s = await wait_gauge(http, a, "kvfleet_gateway_shared_store_up", 0, 5)
                await asyncio.sleep(1.0)
                static = await load.admitted_in(4.0)
                store.start()
                await wait_gauge(http, a, "kvfleet_gateway_shared_store_up", 1, 5)
            assert set(load.statuses) == {200, 429}, (
                load.statuses
            )  # nothing failed, with or without the store
    whole, half = RPM / 60 * 4, RPM / 60 / 2 * 4  # admitted in 4 s: the whole limit's rate, a static share's
    assert whole * 0.85 <= shared <= whole * 1.05 + 1, (shared, whole)
    assert fell_back_s < 1.0, fell_back_s
    assert half * 0.7 <= static <= half * 1.15 + 1, (static, half)


async def test_replicas_share_the_engines_by_weight_under_skewed_ingress(
    tmp_path: Path, store: SharedStoreServer
) -> None:
    """Fair queuing across gateway replicas: tenant ``light`` (weight 1) sends 90% of its requests to
    replica a, ``heavy`` (weight 4) 90% to replica b, both far past what the engine holds at once (each
    replica may hold 10 there; requests take 0.5 s). Each replica alone gives its own tenant most of its
    10 slots (about 1:1); with the store the replicas split the pool's 20 slots by weight and order by
    counters that include the other replica's service: service per weight is even (Jain >= 0.95)."""
    tenants = [TenantRow("light"), TenantRow("heavy", fair_share_weight=4.0)]
    keys, plain = build_keys(tenants)
    async with fake_engines(1, delay_s=0.5) as engines, aiohttp.ClientSession() as http:
        config, keys_path = write_config(tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys)
        flags = (
            "--replicas", "2", "--shared-store", store.url, "--parse-workers", "0",
            "--engine-in-flight-per-replica", "10", "--queue-timeout", "30",
        )  # fmt: skip
        async with (
            gateway_process(tmp_path, config, keys_path, *flags) as a,
            gateway_process(tmp_path, config, keys_path, *flags) as b,
        ):
            loads = {
                (tenant, gw.url): Load(http, gw, plain[tenant][0])
                for tenant in ("light", "heavy")
                for gw in (a, b)
            }
            clients = {("light", a.url): 18, ("light", b.url): 2, ("heavy", b.url): 18, ("heavy", a.url): 2}
            async with contextlib.AsyncExitStack() as stack:
                for key, load in loads.items():
                    await stack.enter_async_context(load.running(clients=clients[key]))
                await asyncio.sleep(4.0)  # both backlogged, the split settled
                done = await asyncio.gather(*(load.admitted_in(8.0) for load in loads.values()))
            statuses = {s for load in loads.values() for s in load.statuses}
            assert statuses == {200}, {key: load.statuses for key, load in loads.items()}
    by_tenant = dict.fromkeys(("light", "heavy"), 0)
    for (tenant, _), n in zip(loads, done, strict=True):
        by_tenant[tenant] += n
    served = [by_tenant["light"], by_tenant["heavy"]]
    weighted = [served[0] / 1.0, served[1] / 4.0]
    jain = sum(weighted) ** 2 / (2 * sum(x * x for x in weighted))
    # Replica a's own part of the engines is 5 slots, shared 3.6:1.6 by the split; each replica rounds a
    # tenant's part up to a whole request, so light gets a little more than its fifth (measured: 1:2.8).
    assert jain >= 0.95 and served[1] / served[0] >= 2.5, (served, jain, done)


async def test_a_killed_replica_costs_only_its_own_requests_and_the_survivor_takes_the_whole_limit(
    tmp_path: Path, store: SharedStoreServer
) -> None:
    """Fault: one of two gateway replicas is killed (SIGKILL) mid-load. Its own clients lose what they had
    in flight to it (a load balancer sends their next connections to the survivor); the survivor's never
    see an error, and once the store drops the dead replica (3 s without a sync) the survivor admits the
    tenant's whole limit instead of its half."""
    tenants = [TenantRow("acme", rate_limits=RateLimits(requests_per_minute=RPM))]
    keys, plain = build_keys(tenants)
    async with fake_engines(1) as engines, aiohttp.ClientSession() as http:
        config, keys_path = write_config(tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys)
        flags = ("--replicas", "2", "--shared-store", store.url, "--parse-workers", "0")
        async with (
            gateway_process(tmp_path, config, keys_path, *flags) as a,
            gateway_process(tmp_path, config, keys_path, *flags) as b,
        ):
            for gw in (a, b):
                await wait_gauge(http, gw, "kvfleet_gateway_shared_store_replicas", 2, 5)
            survivor, doomed = Load(http, a, plain["acme"][0]), Load(http, b, plain["acme"][0])
            async with survivor.running(), doomed.running():
                await survivor.first_refusal(timeout_s=30)
                await asyncio.sleep(1.0)
                b.proc.kill()
                await b.proc.wait()
                dropped_s = await wait_gauge(http, a, "kvfleet_gateway_shared_store_replicas", 1, 8)
                await asyncio.sleep(1.5)  # the demand's time constant: the split follows
                alone = await survivor.admitted_in(4.0)
            assert set(survivor.statuses) == {200, 429}, survivor.statuses
    whole = RPM / 60 * 4
    assert dropped_s < 5.0, dropped_s
    assert whole * 0.85 <= alone <= whole * 1.05 + 1, (alone, whole)
