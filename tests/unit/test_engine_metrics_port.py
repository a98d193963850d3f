"""The engine pod's one metrics port (engine/metrics_server.py) and the loopback plumbing of the launcher.

Real sockets on loopback: upstream ``/metrics`` served by prometheus_client's own server, the plugin's
metrics and debug servers as the engine core starts them. The source of the pool's series is a fixed
snapshot (the block pool itself needs vLLM: tests/engine/test_engine_ports.py runs the real one).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import free_port
from kvfleet_runtime.config import (
    ENGINE_PORT,
    LMCACHE_HTTP_PORT,
    PLUGIN_DEBUG_PORT,
    EngineSettings,
    LMCacheSettings,
)
from kvfleet_runtime.engine import launcher
from kvfleet_runtime.engine.metrics import METRICS_UPSTREAM_UP, POOL_BLOCKS, PoolSnapshot, TenantSnapshot
from kvfleet_runtime.engine.metrics_server import (
    LOOPBACK,
    merge_families,
    start_debug_server,
    start_metrics_server,
)
from kvfleet_runtime.engine.plugin_config import (
    ENV_DEBUG_PORT,
    ENV_METRICS_UPSTREAMS,
    MetricsUpstream,
    is_loopback_host,
    load_plugin_settings,
    parse_metrics_upstreams,
)

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


def _vllm_like_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry).labels("tiny").inc(42)
    Gauge("vllm:num_requests_running", "Running.", registry=registry).set(1)
    Histogram("vllm:time_to_first_token_seconds", "TTFT.", registry=registry).observe(0.2)
    Gauge("process_open_fds", "fds of vLLM's API server.", registry=registry).set(11)
    return registry


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"{family.name} served twice"
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


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
    server, _thread = start_http_server(port, addr=LOOPBACK, registry=_vllm_like_registry())
    yield port
    server.shutdown()


# --- merging (pure) ----------------------------------------------------------------------------------------


def test_upstream_families_are_re_exported_with_their_names_labels_and_values() -> None:
    own = [GaugeMetricFamily(POOL_BLOCKS, "Blocks.", value=100)]
    text = generate_latest(_vllm_like_registry()).decode()
    registry = CollectorRegistry(auto_describe=False)

    class Merged:
        def collect(self) -> list[object]:
            return merge_families(own, [("vllm", text)])  # type: ignore[return-value]

    registry.register(Merged())  # type: ignore[arg-type]
    served = _families(generate_latest(registry).decode())
    upstream = _families(text)
    for name in ("vllm:prompt_tokens", "vllm:num_requests_running", "vllm:time_to_first_token_seconds"):
        assert served[name] == upstream[name]
    assert served[POOL_BLOCKS] == [(POOL_BLOCKS, {}, 100.0)]
    assert served[METRICS_UPSTREAM_UP] == [(METRICS_UPSTREAM_UP, {"upstream": "vllm"}, 1.0)]


def test_a_family_is_served_once_own_first_then_upstreams_in_order() -> None:
    own = [GaugeMetricFamily("shared_name", "Own.", value=1)]
    first = "# TYPE shared_name gauge\nshared_name 2\n# TYPE process_open_fds gauge\nprocess_open_fds 3\n"
    second = "# TYPE process_open_fds gauge\nprocess_open_fds 4\n# TYPE only_second gauge\nonly_second 5\n"
    merged = merge_families(own, [("a", first), ("b", second)])
    values = {f.name: [s.value for s in f.samples] for f in merged if f.name != METRICS_UPSTREAM_UP}
    assert values == {"shared_name": [1.0], "process_open_fds": [3.0], "only_second": [5.0]}


def test_an_unreadable_or_malformed_upstream_is_down_and_the_rest_is_served() -> None:
    merged = merge_families([], [("gone", None), ("garbage", "this is { not metrics"), ("ok", "x 1\n")])
    up = next(f for f in merged if f.name == METRICS_UPSTREAM_UP)
    assert {s.labels["upstream"]: s.value for s in up.samples} == {"gone": 0.0, "garbage": 0.0, "ok": 1.0}
    assert [f.name for f in merged] == ["x", METRICS_UPSTREAM_UP]
    assert merge_families([], []) == []  # no upstreams: no up series either


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
        served = _families(body.decode())
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


# --- settings and the launcher's plumbing (pure) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("engine-0.svc", False)],
)  # fmt: skip
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_upstreams_parse_in_order_and_only_to_loopback() -> None:
    text = "vllm=http://127.0.0.1:8000/metrics,lmcache=http://localhost:6556/metrics"
    assert parse_metrics_upstreams(text) == (
        MetricsUpstream("vllm", "http://127.0.0.1:8000/metrics"),
        MetricsUpstream("lmcache", "http://localhost:6556/metrics"),
    )
    assert parse_metrics_upstreams("") == ()
    for bad in (
        "vllm=http://10.0.0.5:8000/metrics",  # another pod: never a way out of this one
        "vllm=https://127.0.0.1:8000/metrics",
        "vllm",
        "Bad=http://127.0.0.1:1/metrics",
        "a=http://127.0.0.1:1/metrics,a=http://127.0.0.1:2/metrics",
    ):
        with pytest.raises(ValueError):
            parse_metrics_upstreams(bad)


def test_plugin_settings_read_the_upstreams_and_the_debug_port() -> None:
    base = {"KVFLEET_TENANT_TABLE": "/t", "KVFLEET_KEY_FILE": "/k", "KVFLEET_POOL": "p"}
    settings = load_plugin_settings(base)
    assert (
        settings is not None and settings.debug_port == PLUGIN_DEBUG_PORT and settings.metrics_upstreams == ()
    )
    settings = load_plugin_settings(
        {**base, ENV_DEBUG_PORT: "0", ENV_METRICS_UPSTREAMS: "vllm=http://127.0.0.1:1/metrics"}
    )
    assert settings is not None and settings.debug_port == 0
    assert settings.metrics_upstreams == (MetricsUpstream("vllm", "http://127.0.0.1:1/metrics"),)
    for bad in (
        {ENV_DEBUG_PORT: "x"},
        {ENV_DEBUG_PORT: "70000"},
        {ENV_METRICS_UPSTREAMS: "v=http://1.2.3.4/m"},
    ):
        with pytest.raises(RuntimeError):
            load_plugin_settings({**base, **bad})


def _replica(host: str, lmcache: bool = True) -> launcher.EngineReplica:
    engine = EngineSettings(model="/m", lmcache=LMCacheSettings(cpu_bytes=1 << 30) if lmcache else None)
    return launcher.EngineReplica(engine, "tiny", 32, launcher.ReplicaSite(host=host))


def test_lmcache_is_bound_and_dialled_on_loopback_whatever_vllm_binds() -> None:
    replica = _replica("0.0.0.0")
    vllm = launcher.build_vllm_args(replica)
    assert vllm[vllm.index("--host") + 1] == "0.0.0.0"  # the gateway dials the pod IP
    extra = json.loads(vllm[vllm.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1"
    assert replica.engine.lmcache is not None
    argv = launcher.build_lmcache_args(replica.engine.lmcache)
    assert (argv[argv.index("--host") + 1], argv[argv.index("--http-host") + 1]) == ("127.0.0.1", "127.0.0.1")
    assert replica.lmcache_url == f"http://127.0.0.1:{LMCACHE_HTTP_PORT}"
    assert replica.vllm_url == f"http://127.0.0.1:{ENGINE_PORT}"  # dialled from inside the pod
    assert _replica("10.1.2.3").vllm_url == f"http://10.1.2.3:{ENGINE_PORT}"


def test_metrics_upstreams_follow_what_the_replica_runs(tmp_path: Path) -> None:
    assert launcher.build_metrics_upstreams(_replica("0.0.0.0"), 8002) == {
        "vllm": f"http://127.0.0.1:{ENGINE_PORT}/metrics",
        "lmcache": f"http://127.0.0.1:{LMCACHE_HTTP_PORT}/metrics",
        "sync": "http://127.0.0.1:8002/metrics",
    }
    assert set(launcher.build_metrics_upstreams(_replica("0.0.0.0"), None)) == {"vllm", "lmcache"}
    no_lmcache = _replica("0.0.0.0", lmcache=False)
    assert set(launcher.build_metrics_upstreams(no_lmcache, 8002)) == {"vllm"}  # no LMCache: no sync
    replica = launcher.with_metrics_upstreams(no_lmcache, {"vllm": "http://127.0.0.1:1/metrics"})
    env = launcher.build_vllm_env(replica, {}, tmp_path)
    assert env[ENV_METRICS_UPSTREAMS] == "vllm=http://127.0.0.1:1/metrics"
