"""The gateways' shared store's password, attacked where a co-tenant of the node or a log reader would look:
the gateway process's command line and environment as another process sees them, and its log when the
store fails. The gateway is its own process (tests/gateway_support.py), the store a real ``redis-server``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from devcluster.shared_store import start_shared_store

from components import missing_component
from gateway_support import TenantRow, build_keys, build_table, fake_engines, gateway_process, write_config
from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV


async def test_the_store_password_is_not_on_the_command_line_nor_in_the_log_when_the_store_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        store = start_shared_store()
    except FileNotFoundError as exc:
        missing_component(f"redis-server ({exc})", "bash hack/provision.d/10-cluster.sh")
    monkeypatch.setenv(PASSWORD_ENV, store.password)
    try:
        tenants = [TenantRow("acme")]
        keys, _ = build_keys(tenants)
        async with fake_engines(1) as engines:
            config, keys_path = write_config(
                tmp_path, build_table(tenants, {"shared": [engines[0].url]}), keys
            )
            flags = ("--shared-store", store.url, "--replicas", "2", "--parse-workers", "0")
            async with gateway_process(tmp_path, config, keys_path, *flags) as gw:
                cmdline = await asyncio.to_thread(Path(f"/proc/{gw.proc.pid}/cmdline").read_bytes)
                assert store.url.encode() in cmdline and store.password.encode() not in cmdline
                store.kill()  # the failure path logs: the store's address, never its password
                for _ in range(50):
                    if "unreachable" in gw.log() or "sync failed" in gw.log():
                        break
                    await asyncio.sleep(0.1)
                log = gw.log()
                assert f"127.0.0.1:{store.port}" in log, log[-2000:]
                assert store.password not in log
    finally:
        store.stop()
