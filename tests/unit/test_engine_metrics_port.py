"""The engine pod's one metrics port (engine/metrics_server.py) without a socket: how upstream families are
merged with the pool's own, the loopback rules for upstreams and the debug route, and the launcher's
loopback plumbing. The servers on real loopback sockets: tests/loopback/test_engine_metrics_servers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from factories import metric_families, vllm_like_registry
from kvfleet_runtime.config import (
    ENGINE_PORT,
    LMCACHE_HTTP_PORT,
    PLUGIN_DEBUG_PORT,
    EngineSettings,
    LMCacheSettings,
)
from kvfleet_runtime.engine import launcher
from kvfleet_runtime.engine.metrics import METRICS_UPSTREAM_UP, POOL_BLOCKS
from kvfleet_runtime.engine.metrics_server import (
    merge_families,
)
from kvfleet_runtime.engine.plugin_config import (
    ENV_DEBUG_PORT,
    ENV_METRICS_UPSTREAMS,
    MetricsUpstream,
    is_loopback_host,
    load_plugin_settings,
    parse_metrics_upstreams,
)

# --- merging (pure) ----------------------------------------------------------------------------------------


def test_upstream_families_are_re_exported_with_their_names_labels_and_values() -> None:
    own = [GaugeMetricFamily(POOL_BLOCKS, "Blocks.", value=100)]
    text = generate_latest(vllm_like_registry()).decode()
    registry = CollectorRegistry(auto_describe=False)

    class Merged:
        def collect(self) -> list[object]:
            return merge_families(own, [("vllm", text)])  # type: ignore[return-value]

    registry.register(Merged())  # type: ignore[arg-type]
    served = metric_families(generate_latest(registry).decode())
    upstream = metric_families(text)
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
