"""The commands the Envoy data plane's pods run (``kvfleet epp``, ``kvfleet envoy``), as processes on real
sockets in front of a ``FakeEngine``: a request through them, the EPP's gRPC health, and the EPP's
metrics on their own port."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from factories import free_port
from gateway_support import MODEL, TenantRow, build_keys, build_table, fake_engines, process, write_config
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway.epp import SERVICE_NAME


async def _until_ok(
    http: aiohttp.ClientSession, url: str, procs: list[asyncio.subprocess.Process], logs: list[Path]
) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.returncode is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise AssertionError(
        "not ready in time:\n" + "\n".join(p.read_text(errors="replace")[-1500:] for p in logs)
    )


async def test_kvfleet_epp_and_kvfleet_envoy_serve_a_tenant_as_the_pods_run_them(tmp_path: Path) -> None:
    tenant = TenantRow("acme")
    async with fake_engines(1) as (engine,):
        keyfile, keys = build_keys([tenant])
        config, keys_path = write_config(tmp_path, build_table([tenant], {"shared": [engine.url]}), keyfile)
        table = ("--config", str(config), "--keys", str(keys_path))
        epp_port, metrics_port, listen, admin = free_port(), free_port(), free_port(), free_port()
        kvfleet = (sys.executable, "-m", "kvfleet_runtime")
        epp_log, envoy_log = tmp_path / "epp.log", tmp_path / "envoy.log"
        async with (
            process(epp_log, *kvfleet, "epp", *table, "--listen", f"127.0.0.1:{epp_port}",
                    "--metrics-listen", f"127.0.0.1:{metrics_port}") as epp,
            process(envoy_log, *kvfleet, "envoy", *table, "--listen", f"127.0.0.1:{listen}",
                    "--epp", f"127.0.0.1:{epp_port}", "--admin-port", str(admin)) as envoy,
            aiohttp.ClientSession() as http,
        ):  # fmt: skip
            procs, logs = [epp, envoy], [epp_log, envoy_log]
            await _until_ok(http, f"http://127.0.0.1:{admin}/ready", procs, logs)
            await _until_ok(http, f"http://127.0.0.1:{metrics_port}/metrics", procs, logs)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            url = f"http://127.0.0.1:{listen}/v1/chat/completions"
            async with http.post(url, json=body, headers={"Authorization": "Bearer " + keys["acme"][0]}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] > 0
            async with http.post(url, json=body) as r:
                assert r.status == 401
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                text = await r.text()
            assert f"{m.REQUESTS_TOTAL}{{" in text and 'tenant="acme"' in text
            assert len(engine.received) == 1
