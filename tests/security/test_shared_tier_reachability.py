"""Attacks on the shared KV tier (``spec.kvCache.shared``): who can open a connection to its pod.

Threat: the shared tier holds the KV chunks of every tenant of the shared pool, keyed by salt. A pod that
reaches its KV port could read a tenant's chunks by key (``GET``), learn which prefixes a tenant sent
(``EXISTS``), fill it (``SET``) or delete chunks (``DEL``). Only the shared pool's engine pods (their
LMCache servers) may reach the KV port; only the metrics scrapers the metrics port; nobody any other port.
Not the gateway, not a dedicated pool's engines (a dedicated tenant shares nothing), not another
ModelDeployment's engines, not a pod in another namespace.

Defence under test: the tier's NetworkPolicy as the operator renders it (the real builders, on the
qwen72b example with the tier enabled and its dedicated ``bank`` tenant), evaluated with every other
policy of the namespace by tests/netpol_eval.py. What a reachable client can do is bounded by the
server itself (allowlisted salts, per-salt quotas: tests/unit/test_build_shared_tier.py and
tests/engine/test_shared_tier.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.common import (
    LABEL_SCRAPER,
    SHARED_TIER_METRICS_PORT,
    SHARED_TIER_PORT,
)
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import KeyFile
from netpol_eval import ContainerPort, Namespace, Pod, allowed_ports, is_allowed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NS = "llm"  # the examples' namespace
NAMESPACES = [
    Namespace(NS, {"pod-security.kubernetes.io/enforce": "restricted"}),
    Namespace("monitoring"),
    Namespace("attacker", {"team": "monitoring", "kubernetes.io/metadata.name": "monitoring"}),
]
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def render(md_name: str, shared: bool) -> list[dict[str, Any]]:
    md_doc = _doc("modeldeployment-qwen72b.yaml", uid=f"uid-{md_name}")
    md_doc["metadata"]["name"] = md_name
    if shared:
        md_doc["spec"]["kvCache"]["shared"] = {"enabled": True, "size": "64Gi"}
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
    return build_desired_children(md, capacity, tenants, admit_tenants(capacity, tenants), KEYS, IMAGES, True)


def pod_of(workload: dict[str, Any], name: str) -> Pod:
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


CHILDREN = render("qwen72b", shared=True)
#: Another ModelDeployment of the namespace, with its own shared tier.
OTHER_MD = render("other", shared=True)
POLICIES = [c for c in CHILDREN + OTHER_MD if c["kind"] == "NetworkPolicy"]

TIER = pod_of(_one(CHILDREN, "Deployment", "qwen72b-shared-tier"), "qwen72b-shared-tier-abc")
SHARED_ENGINE = pod_of(_one(CHILDREN, "StatefulSet", "qwen72b-engine"), "qwen72b-engine-0")
PROMETHEUS = Pod("monitoring", "prometheus-0", {LABEL_SCRAPER: "true"})

ATTACKERS = {
    "the gateway": pod_of(_one(CHILDREN, "Deployment", "qwen72b-gateway"), "qwen72b-gateway-abc"),
    "a dedicated pool's engine": pod_of(
        _one(CHILDREN, "StatefulSet", "qwen72b-dedicated-bank-qwen72b-engine"), "bank-engine-0"
    ),
    "a same-namespace pod": Pod(NS, "debug", {"app": "debug"}),
    "a pod in another namespace": Pod("attacker", "x", {"app": "x"}),
    "a pod in another namespace wearing the engine's labels": Pod(
        "attacker", "x", dict(SHARED_ENGINE.labels)
    ),
    "another ModelDeployment's engine": pod_of(
        _one(OTHER_MD, "StatefulSet", "other-engine"), "other-engine-0"
    ),
    "another ModelDeployment's shared tier": pod_of(
        _one(OTHER_MD, "Deployment", "other-shared-tier"), "other-shared-tier-abc"
    ),
    "a labelled scraper in another namespace": Pod("attacker", "scraper", {LABEL_SCRAPER: "true"}),
}


def test_setup_the_tier_and_its_policy_are_rendered() -> None:
    assert {p["metadata"]["name"] for p in POLICIES if p["metadata"]["name"].endswith("-shared-tier")} == {
        "qwen72b-shared-tier",
        "other-shared-tier",
    }
    assert {p.port for p in TIER.ports} == {SHARED_TIER_PORT, SHARED_TIER_METRICS_PORT}


def test_the_shared_pools_engines_reach_the_kv_port_and_nothing_else() -> None:
    assert allowed_ports(POLICIES, NAMESPACES, SHARED_ENGINE, TIER) == {SHARED_TIER_PORT}


def test_the_scrapers_reach_the_metrics_port_and_nothing_else() -> None:
    assert allowed_ports(POLICIES, NAMESPACES, PROMETHEUS, TIER) == {SHARED_TIER_METRICS_PORT}


@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
def test_no_one_else_reaches_any_port_of_the_shared_tier(attacker: str) -> None:
    """Threat: a pod other than the shared pool's engines reads, probes, fills or deletes tenants' KV."""
    assert allowed_ports(POLICIES, NAMESPACES, ATTACKERS[attacker], TIER) == set(), attacker


def test_without_the_field_there_is_no_tier_and_no_new_reachable_port() -> None:
    children = render("plain", shared=False)
    assert not [c for c in children if c["metadata"]["name"].endswith("-shared-tier")]
    engine = pod_of(_one(children, "StatefulSet", "plain-engine"), "plain-engine-0")
    policies = [c for c in children if c["kind"] == "NetworkPolicy"]
    # No policy admits the port anywhere: nothing listens on it, and nothing would be let in.
    assert not is_allowed(policies, NAMESPACES, engine, engine, SHARED_TIER_PORT)


def test_the_tiers_pod_monitor_scrapes_only_the_port_its_policy_opens_to_scrapers() -> None:
    """Threat: a scrape configuration pointed at the KV port makes Prometheus a client of the tier."""
    (monitor,) = [
        c for c in CHILDREN if c["kind"] == "PodMonitor" and c["metadata"]["name"] == "qwen72b-shared-tier"
    ]
    named = {p.name: p.port for p in TIER.ports}
    scraped = {named[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == {SHARED_TIER_METRICS_PORT}
    assert scraped <= allowed_ports(POLICIES, NAMESPACES, PROMETHEUS, TIER)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= TIER.labels.items()
