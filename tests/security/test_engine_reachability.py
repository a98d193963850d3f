"""Attacks on the way to an engine: who can open a connection to which port of an engine pod.

Threat: an engine trusts whoever reaches vLLM's OpenAI port: no key, no rate limit, and the caller picks
its own ``cache_salt`` (so it can read another tenant's cached prefixes by timing) and ``priority``.
LMCache's HTTP API changes quotas (``PUT /quota``) and clears the cache; its ZMQ port moves KV; the
metrics and debug endpoints list every tenant. Only the ModelDeployment's gateway may reach the inference
port, only the configured metrics scrapers the metrics port (never the inference port), and nobody any
other port.

Defences under test, as the operator renders them for a ModelDeployment with a shared and a dedicated pool
(the real builders, ``build_desired_children``) and as the chart configures the operator:

* the engine NetworkPolicies (``build/network.py``): default deny for every pool's pods, the OpenAI port
  from this ModelDeployment's gateway pods only (same namespace), the metrics port from the scrapers only
  (``metricsScrapers``: namespace AND pod selector), no rule for any other port;
* the PodMonitor and ServiceMonitor scrape metrics ports only;
* the engine pod's command line: LMCache, the quota sync's metrics and the plugin's debug endpoint bind
  the pod's loopback, which no other pod reaches (the real sockets: tests/engine/test_engine_ports.py).

Until the local cluster's node tier enforces policies in these tests (tests/e2e/test_real_node.py probes
the real network), the rendered policies are evaluated by tests/netpol_eval.py, a NetworkPolicy evaluator
with its own tests of the Kubernetes semantics (tests/unit/test_netpol_eval.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary

from components import missing_component
from engine_fixtures import TINY_MODEL_DEPLOYMENT, load_manifest, render_engine
from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KV_EVENTS_PORT,
    LABEL_SCRAPER,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
)
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.network import MetricsScrapers, parse_metrics_scrapers
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import PLUGIN_DEBUG_PORT, KeyFile
from kvfleet_runtime.engine import launcher
from kvfleet_runtime.engine.cli import resolve_launch
from kvfleet_runtime.engine.plugin_config import ENV_METRICS_UPSTREAMS, parse_metrics_upstreams
from netpol_eval import ContainerPort, Namespace, Pod, allowed_ports, is_allowed

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NS = "llm"  # the examples' namespace
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})

#: Every port an engine pod listens on, by what it is.
ENGINE_PORTS = {
    "vLLM OpenAI": ENGINE_PORT,
    "vLLM KV events": KV_EVENTS_PORT,
    "plugin metrics": PLUGIN_METRICS_PORT,
    "LMCache ZMQ": LMCACHE_PORT,
    "LMCache HTTP": LMCACHE_HTTP_PORT,
    "quota-sync metrics": LMCACHE_SYNC_METRICS_PORT,
    "plugin debug": PLUGIN_DEBUG_PORT,
}

NAMESPACES = [
    Namespace(NS, {"pod-security.kubernetes.io/enforce": "restricted"}),
    Namespace("monitoring"),
    # An attacker may label its own namespace as it likes, but not with another namespace's name.
    Namespace("attacker", {"team": "monitoring", "kubernetes.io/metadata.name": "monitoring"}),
]


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def render(md_name: str = "qwen72b", scrapers: MetricsScrapers | None = None) -> list[dict[str, Any]]:
    """Everything the operator builds for the qwen72b example named ``md_name`` and its four example
    tenants (``bank`` is dedicated: a second pool), monitoring on."""
    md_doc = _doc("modeldeployment-qwen72b.yaml", uid=f"uid-{md_name}")
    md_doc["metadata"]["name"] = md_name
    md = ModelDeployment.model_validate(md_doc)
    tenants = []
    for i, name in enumerate(("bank", "saas", "startup-a", "startup-b")):
        doc = _doc(
            f"tenant-{name}.yaml", uid=f"uid-{md_name}-{name}", creationTimestamp=f"2026-01-01T00:00:0{i}Z"
        )
        doc["metadata"]["name"] = f"{name}-{md_name}"
        doc["spec"]["modelDeploymentRef"]["name"] = md_name
        if doc["spec"].get("dedicated"):
            doc["spec"]["dedicated"]["gpuGroup"] = f"{name}-{md_name}"
        tenants.append(Tenant.model_validate(doc))
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    return build_desired_children(md, capacity, tenants, decisions, KEYS, IMAGES, True, scrapers)


def pod_of(workload: dict[str, Any], name: str) -> Pod:
    """A pod of ``workload`` (StatefulSet, Deployment) as the API server would create it: its template's
    labels and container ports."""
    template = workload["spec"]["template"]
    ports = tuple(
        ContainerPort(p["containerPort"], p.get("name"), p.get("protocol", "TCP"))
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
    )
    return Pod(workload["metadata"]["namespace"], name, dict(template["metadata"]["labels"]), ports)


def _one(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


CHILDREN = render()
OTHER_MD = render("other")
#: Every policy in the namespace: the union is what the network enforces.
POLICIES = [c for c in CHILDREN + OTHER_MD if c["kind"] == "NetworkPolicy"]

SHARED_ENGINE = pod_of(_one(CHILDREN, "StatefulSet", "qwen72b-engine"), "qwen72b-engine-0")
BANK_ENGINE = pod_of(_one(CHILDREN, "StatefulSet", "qwen72b-dedicated-bank-qwen72b-engine"), "bank-engine-0")
ENGINES = {"shared pool": SHARED_ENGINE, "dedicated pool": BANK_ENGINE}
GATEWAY = pod_of(_one(CHILDREN, "Deployment", "qwen72b-gateway"), "qwen72b-gateway-abc")
PROMETHEUS = Pod(
    "monitoring", "prometheus-0", {LABEL_SCRAPER: "true", "app.kubernetes.io/name": "prometheus"}
)

ATTACKERS = {
    "a pod in another namespace": Pod("attacker", "x", {"app": "x"}),
    "a pod in another namespace wearing the gateway's labels": Pod("attacker", "x", dict(GATEWAY.labels)),
    "a same-namespace pod that is not the gateway": Pod(NS, "debug", {"app": "debug"}),
    "a labelled scraper in another namespace": Pod("attacker", "scraper", {LABEL_SCRAPER: "true"}),
    "an unlabelled pod of the monitoring namespace": Pod("monitoring", "grafana-0", {"app": "grafana"}),
    "another ModelDeployment's gateway": pod_of(_one(OTHER_MD, "Deployment", "other-gateway"), "other-gw"),
    "another ModelDeployment's engine": pod_of(
        _one(OTHER_MD, "StatefulSet", "other-engine"), "other-engine-0"
    ),
}


def reach(source: Pod, destination: Pod, port: int, policies: list[dict[str, Any]] = POLICIES) -> bool:
    return is_allowed(policies, NAMESPACES, source, destination, port)


def test_the_rendered_model_deployment_has_a_shared_and_a_dedicated_pool() -> None:
    """Setup check: the attacks below run against both kinds of pool, and both are isolated."""
    pools = {c["metadata"]["labels"].get("kvfleet.io/pool") for c in CHILDREN if c["kind"] == "StatefulSet"}
    assert pools == {"shared", "dedicated-bank-qwen72b"}
    assert BANK_ENGINE.labels["kvfleet.io/pool"] != SHARED_ENGINE.labels["kvfleet.io/pool"]


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
@pytest.mark.parametrize("port_name", sorted(ENGINE_PORTS))
def test_no_one_but_the_gateway_and_the_scrapers_reaches_an_engine_port(
    attacker: str, engine: str, port_name: str
) -> None:
    """Threat: a pod that is not this ModelDeployment's gateway calls an engine directly (no key, its own
    salt and priority), changes LMCache quotas, clears its cache, or reads every tenant's metrics."""
    assert not reach(ATTACKERS[attacker], ENGINES[engine], ENGINE_PORTS[port_name]), (
        f"{attacker} reaches the {engine}'s {port_name} port"
    )


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
def test_attackers_reach_no_port_at_all(attacker: str, engine: str) -> None:
    """Threat: a port nobody thought of (a debugger, a profiler, a new vLLM endpoint): the engine pods are
    default-deny, so no port of 1-65535 is open to a pod that is not the gateway or a scraper."""
    assert allowed_ports(POLICIES, NAMESPACES, ATTACKERS[attacker], ENGINES[engine]) == set()


def test_pools_do_not_reach_each_other() -> None:
    """Threat: a compromised shared-pool engine (it runs every shared tenant's requests) reaches the
    dedicated pool's engines, or the reverse: engines are no one's allowed peers, not even each other's."""
    assert allowed_ports(POLICIES, NAMESPACES, SHARED_ENGINE, BANK_ENGINE) == set()
    assert allowed_ports(POLICIES, NAMESPACES, BANK_ENGINE, SHARED_ENGINE) == set()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_gateway_reaches_vllm_and_nothing_else(engine: str) -> None:
    """Threat: a compromised or buggy gateway talks to LMCache or reads the metrics; and, the other way,
    a policy so strict that the gateway cannot serve or route. It reaches exactly the OpenAI port and the
    KV events (precise routing) of both pools."""
    assert allowed_ports(POLICIES, NAMESPACES, GATEWAY, ENGINES[engine]) == {ENGINE_PORT, KV_EVENTS_PORT}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_prometheus_reaches_the_metrics_port_only(engine: str) -> None:
    """Threat: the metrics scraper as a way around the gateway (pods labelled
    ``kvfleet.io/metrics-scraper=true`` in any other namespace must not reach vLLM's OpenAI port). A
    scraper of the monitoring namespace reaches the metrics port of every pool, and nothing else."""
    assert allowed_ports(POLICIES, NAMESPACES, PROMETHEUS, ENGINES[engine]) == {PLUGIN_METRICS_PORT}


def test_the_gateways_metrics_port_is_for_scrapers_and_its_api_for_everyone() -> None:
    """Threat: the gateway's metrics (every tenant's name and traffic) read by any pod; the front door
    itself must stay open to every client."""
    assert allowed_ports(POLICIES, NAMESPACES, PROMETHEUS, GATEWAY) == {GATEWAY_PORT, GATEWAY_METRICS_PORT}
    for attacker in ATTACKERS.values():
        assert allowed_ports(POLICIES, NAMESPACES, attacker, GATEWAY) == {GATEWAY_PORT}


def test_monitors_scrape_only_metrics_ports_the_policies_open_to_prometheus() -> None:
    """Threat: a monitor that scrapes vLLM's port forces the policy to open it to scrapers."""
    pod_monitor = _one(CHILDREN, "PodMonitor", "qwen72b-engines")
    for engine in ENGINES.values():
        by_name = {p.name: p.port for p in engine.ports}
        scraped = {by_name[e["port"]] for e in pod_monitor["spec"]["podMetricsEndpoints"]}
        assert scraped == {PLUGIN_METRICS_PORT}
        assert all(reach(PROMETHEUS, engine, port) for port in scraped)
    service_monitor = _one(CHILDREN, "ServiceMonitor", "qwen72b-gateway")
    service = _one(CHILDREN, "Service", "qwen72b-gateway-metrics")  # the client Service has no metrics port
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    by_name = {p.name: p.port for p in GATEWAY.ports}
    scraped = {by_name.get(ports[e["port"]], ports[e["port"]]) for e in service_monitor["spec"]["endpoints"]}
    assert scraped == {GATEWAY_METRICS_PORT}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_engine_pod_declares_only_the_inference_and_metrics_ports(engine: str) -> None:
    """Threat: a Service or a hostPort built from the pod's declared ports exposes LMCache. The pod names
    two ports, vLLM's and the metrics port; the headless Services publish no other."""
    assert {p.port for p in ENGINES[engine].ports} == {ENGINE_PORT, PLUGIN_METRICS_PORT}
    for service in (
        c for c in CHILDREN if c["kind"] == "Service" and c["metadata"]["name"].endswith("-engine")
    ):
        assert {p["port"] for p in service["spec"]["ports"]} == {ENGINE_PORT, PLUGIN_METRICS_PORT}


def test_the_engine_pod_binds_lmcache_the_sync_and_debug_to_loopback() -> None:
    """Threat: LMCache on the pod IP (``--host 0.0.0.0`` reached its ZMQ and HTTP ports: ``PUT /quota``,
    cache clear, per-salt metrics). The pod's own command line (the CPU example, which ``kvfleet engine
    launch`` can resolve here), parsed by the real ``kvfleet`` parser and resolved as the command resolves
    it: vLLM binds every interface (for the gateway), LMCache binds loopback and vLLM dials it there, and
    the plugin re-exports loopback URLs only."""
    rendered = render_engine(load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid"))
    args = build_parser().parse_args(rendered.command[1:])
    assert args.host == "0.0.0.0"
    _, replica = resolve_launch(args, rendered.table)
    assert replica.engine.lmcache is not None
    vllm = launcher.build_vllm_args(replica)
    assert vllm[vllm.index("--host") + 1] == "0.0.0.0"
    lmcache = launcher.build_lmcache_args(replica.engine.lmcache)
    assert lmcache[lmcache.index("--host") + 1] == "127.0.0.1"
    assert lmcache[lmcache.index("--http-host") + 1] == "127.0.0.1"
    transfer = json.loads(vllm[vllm.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://127.0.0.1"
    assert replica.lmcache_url == f"http://127.0.0.1:{LMCACHE_HTTP_PORT}"
    upstreams = parse_metrics_upstreams(replica.site.env[ENV_METRICS_UPSTREAMS])
    assert {u.name: u.url for u in upstreams} == {
        "vllm": f"http://127.0.0.1:{ENGINE_PORT}/metrics",
        "lmcache": f"http://127.0.0.1:{LMCACHE_HTTP_PORT}/metrics",
        "sync": f"http://127.0.0.1:{LMCACHE_SYNC_METRICS_PORT}/metrics",
    }


def test_configured_scrapers_replace_the_default() -> None:
    """Threat: a platform whose Prometheus runs elsewhere widens the policy by hand (or labels any pod a
    scraper). The selector is configuration: only what it selects gets the metrics port, still never the
    inference port."""
    scrapers = parse_metrics_scrapers(
        '{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},'
        ' "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}'
    )
    policies = [c for c in render(scrapers=scrapers) if c["kind"] == "NetworkPolicy"]
    theirs = Pod("observability", "prom-0", {"app.kubernetes.io/name": "prometheus"})
    for engine in ENGINES.values():
        assert allowed_ports(policies, NAMESPACES, theirs, engine) == {PLUGIN_METRICS_PORT}
        assert allowed_ports(policies, NAMESPACES, PROMETHEUS, engine) == set()  # the default is gone


def _chart_scrapers(*values: str) -> MetricsScrapers:
    helm = find_binary("helm")
    if helm is None:
        missing_component("helm", "hack/build-cluster.sh")
    out = subprocess.run(
        [str(helm), "template", "kvfleet", str(REPO / "charts/kvfleet"), "-n", "kvfleet-system", *values],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (deployment,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    return parse_metrics_scrapers(env["KVFLEET_METRICS_SCRAPERS"])


def test_the_charts_default_admits_labelled_scrapers_of_the_monitoring_namespace_only() -> None:
    """Threat: the shipped default admits scrapers from any namespace (anyone who can create a pod can
    label it a scraper). The chart's value, rendered by helm and parsed as the operator parses it, admits
    the labelled pods of the namespace named ``monitoring`` (by the label the API server sets), and a
    custom value (``--set``) replaces it."""
    default = _chart_scrapers()
    assert default == MetricsScrapers()
    policies = [c for c in render(scrapers=default) if c["kind"] == "NetworkPolicy"]
    assert allowed_ports(policies, NAMESPACES, PROMETHEUS, SHARED_ENGINE) == {PLUGIN_METRICS_PORT}
    forged = ATTACKERS["a labelled scraper in another namespace"]
    assert allowed_ports(policies, NAMESPACES, forged, SHARED_ENGINE) == set()
    custom = _chart_scrapers("--set", "metricsScrapers.namespaceSelector.matchLabels.team=obs")
    assert custom.namespace_selector.match_labels == {
        "kubernetes.io/metadata.name": "monitoring",
        "team": "obs",
    }
    policies = [c for c in render(scrapers=custom) if c["kind"] == "NetworkPolicy"]
    assert (
        allowed_ports(policies, NAMESPACES, PROMETHEUS, SHARED_ENGINE) == set()
    )  # monitoring lacks team=obs
