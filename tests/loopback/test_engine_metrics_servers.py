"""The engine pod's metrics and debug servers (engine/metrics_server.py) on real loopback sockets, as the
engine core starts them: the metrics port serves the pool's series and each upstream's (an upstream
``/metrics`` served by prometheus_client's own server, as vLLM and LMCache serve theirs) with an up series
per upstream, serves no inference API, and routes debug only on loopback-bound sockets. The pool's series
come from a fixed snapshot (the block pool itself needs vLLM: tests/engine/test_engine_ports.py runs the
real one)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from prometheus_client import start_http_server

from factories import free_port, metric_families, vllm_like_registry
from kvfleet_runtime.engine.metrics import METRICS_UPSTREAM_UP, POOL_BLOCKS, PoolSnapshot, TenantSnapshot
from kvfleet_runtime.engine.metrics_server import LOOPBACK, start_debug_server, start_metrics_server
from kvfleet_runtime.engine.plugin_config import MetricsUpstream

SNAPSHOT = PoolSnapshot(
    total_blocks=100,
    used_blocks=3,
    cached_blocks=7,
    tenants={"acme": TenantSnapshot(7, 3, 50, 80, 30.0)},
    queries={"acme": 2},
)


class FixedSource:
    def snapshot(self) -> PoolSnapshot:
        return SNAPSHOT

    def count_vllm_blocks(self) -> dict[str, int]:
        return {"cached": 7}


def request(port: int, method: str, path: str, host: str = LOOPBACK) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def upstream() -> Iterator[int]:
    """A real ``/metrics`` on loopback (prometheus_client's server, as vLLM and LMCache serve theirs)."""
    port = free_port()
    server, _thread = start_http_server(port, addr=LOOPBACK, registry=vllm_like_registry())
    yield port
    server.shutdown()


# --- the servers (real sockets) ----------------------------------------------------------------------------


def test_the_metrics_port_serves_the_pools_and_the_upstreams_series(upstream: int) -> None:
    port = free_port()
    upstreams = (
        MetricsUpstream("vllm", f"http://127.0.0.1:{upstream}/metrics"),
        MetricsUpstream("sync", f"http://127.0.0.1:{free_port()}/metrics"),  # nothing listens: down
    )
    server = start_metrics_server(LOOPBACK, port, FixedSource(), upstreams)
    try:
        status, body = request(port, "GET", "/metrics")
        assert status == 200
        served = metric_families(body.decode())
        assert served["vllm:prompt_tokens"][0][2] == 42.0
        assert served["process_open_fds"] == [("process_open_fds", {}, 11.0)]
        assert served[POOL_BLOCKS] == [(POOL_BLOCKS, {}, 100.0)]
        up = {labels["upstream"]: value for _, labels, value in served[METRICS_UPSTREAM_UP]}
        assert up == {"vllm": 1.0, "sync": 0.0}
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/models", 404),
        ("POST", "/v1/completions", 404),
        ("POST", "/v1/chat/completions", 404),
        ("GET", "/health", 404),
        ("POST", "/metrics", 405),
        ("PUT", "/quota/x", 404),
        ("DELETE", "/metrics", 405),
    ],
)
def test_the_metrics_port_serves_no_inference_api(method: str, path: str, status: int) -> None:
    port = free_port()
    server = start_metrics_server("0.0.0.0", port, FixedSource())
    try:
        assert request(port, method, path)[0] == status
    finally:
        server.shutdown()


def test_debug_is_routed_only_on_loopback_bound_sockets() -> None:
    public, loopback, debug = free_port(), free_port(), free_port()
    servers = [
        start_metrics_server("0.0.0.0", public, FixedSource()),
        start_metrics_server(LOOPBACK, loopback, FixedSource()),
        start_debug_server(debug, FixedSource()),
    ]
    try:
        # A socket other pods can reach has no debug route at all, even for a loopback peer.
        assert request(public, "GET", "/debug/kv")[0] == 404
        for port in (loopback, debug):
            status, body = request(port, "GET", "/debug/kv")
            assert status == 200
            assert json.loads(body)["plugin"]["total_blocks"] == 100
        assert servers[2].server_address[0] == LOOPBACK
        assert request(debug, "GET", "/metrics")[0] == 404  # the debug server is only that
    finally:
        for server in servers:
            server.shutdown()
