"""Attacks on the new way in: the platform's GIE gateway (``spec.gateway.inferencePool``) and Envoy
(``spec.gateway.dataPlane: envoy``) call the Endpoint Picker, and the platform gateway calls the engines.

Threat: the Endpoint Picker decides who is which tenant and where a request goes, and an engine's OpenAI
port trusts whoever reaches it (no key, the caller's own ``cache_salt`` and ``priority``). Opening them to
the platform's gateway must open them to exactly its pods (its namespace by name AND its pods' labels),
on exactly the two ports it needs (the picker's gRPC port, vLLM's OpenAI port), and to nobody else: not a
pod of that namespace without the labels, not a pod wearing the labels elsewhere, not a scraper, not
another ModelDeployment's gateway. The picker's metrics (every tenant's series) are the scrapers' only.

Defences under test, as the operator renders them (the real builders, ``build_desired_children``, for the
qwen72b example with a dedicated tenant, so a shared and a dedicated pool), evaluated by
tests/netpol_eval.py: the engine policies' OpenAI-port rule with the platform peer, the picker's policy
(``build/network.py``: ``build_epp_network_policy``), and nothing new anywhere else.
"""

from __future__ import annotations

from typing import Any

import pytest

from gie_builders import GATEWAY_PODS, NS, render
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    EPP_METRICS_PORT,
    EPP_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KV_EVENTS_PORT,
    LABEL_SCRAPER,
    PLUGIN_METRICS_PORT,
)
from netpol_eval import ContainerPort, Namespace, Pod, allowed_ports

EDGE_LABELS = dict(GATEWAY_PODS["matchLabels"])
NAMESPACES = [
    Namespace(NS),
    Namespace("gateways"),
    Namespace("monitoring"),
    # An attacker labels its own namespace as it likes, but cannot take another namespace's name.
    Namespace("attacker", {"kubernetes.io/metadata.name": "gateways", "team": "gateways"}),
]
PLATFORM_GATEWAY = Pod("gateways", "edge-istio-abc", EDGE_LABELS)
PROMETHEUS = Pod("monitoring", "prometheus-0", {LABEL_SCRAPER: "true"})


def pod_of(workload: dict[str, Any], name: str) -> Pod:
    template = workload["spec"]["template"]
    ports = tuple(
        ContainerPort(p["containerPort"], p.get("name"), p.get("protocol", "TCP"))
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
    )
    return Pod(workload["metadata"]["namespace"], name, dict(template["metadata"]["labels"]), ports)


def _workload(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


class Rendered:
    """One rendering's pods and policies, with another ModelDeployment's beside it in the namespace."""

    def __init__(self, **gateway: Any) -> None:
        children = render(**gateway)
        self.children = children
        self.engines = {
            "shared pool": pod_of(_workload(children, "StatefulSet", "qwen72b-engine"), "engine-0"),
            "dedicated pool": pod_of(
                _workload(children, "StatefulSet", "qwen72b-dedicated-bank-engine"), "bank-engine-0"
            ),
        }
        self.gateway = pod_of(_workload(children, "Deployment", "qwen72b-gateway"), "gateway-abc")
        epp = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen72b-epp"]
        self.epp = pod_of(epp[0], "epp-abc") if epp else None
        other = [
            {**c, "metadata": {**c["metadata"], "name": c["metadata"]["name"].replace("qwen72b", "other")}}
            for c in render()
        ]
        other_gateway = _workload(other, "Deployment", "other-gateway")
        # Another ModelDeployment's gateway: the same labels but its own instance.
        labels = dict(other_gateway["spec"]["template"]["metadata"]["labels"])
        labels["app.kubernetes.io/instance"] = "other"
        self.other_gateway = Pod(NS, "other-gateway-abc", labels)
        self.policies = [c for c in children if c["kind"] == "NetworkPolicy"]

    def ports(self, source: Pod, destination: Pod) -> set[int]:
        return allowed_ports(self.policies, NAMESPACES, source, destination)


POOL = Rendered(inferencePool={"gatewayPods": GATEWAY_PODS})
ENVOY = Rendered(dataPlane="envoy")
BOTH = Rendered(inferencePool={"gatewayPods": GATEWAY_PODS}, dataPlane="envoy")
RENDERINGS = {"inferencePool": POOL, "envoy": ENVOY, "both": BOTH}

ATTACKERS = {
    "an unlabelled pod of the gateway's namespace": Pod("gateways", "debug", {"app": "debug"}),
    "a pod wearing the gateway's labels in another namespace": Pod("attacker", "x", EDGE_LABELS),
    "a pod wearing the gateway's labels in the model's namespace": Pod(NS, "x", EDGE_LABELS),
    "a same-namespace pod": Pod(NS, "debug", {"app": "debug"}),
    "a labelled scraper in another namespace": Pod("attacker", "scraper", {LABEL_SCRAPER: "true"}),
}


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
def test_attackers_reach_neither_the_picker_nor_an_engine(rendering: str, attacker: str) -> None:
    """Threat: a pod that is not the platform's gateway (or this ModelDeployment's Envoy) asks the picker
    for a destination, reads the picker's metrics, or calls an engine directly."""
    r = RENDERINGS[rendering]
    assert r.epp is not None
    assert r.ports(ATTACKERS[attacker], r.epp) == set()
    for engine in r.engines.values():
        assert r.ports(ATTACKERS[attacker], engine) == set()


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_another_model_deployments_gateway_reaches_no_port_of_this_picker(rendering: str) -> None:
    r = RENDERINGS[rendering]
    assert r.epp is not None
    assert r.ports(r.other_gateway, r.epp) == set()


@pytest.mark.parametrize("engine", ["shared pool", "dedicated pool"])
@pytest.mark.parametrize("rendering", ["inferencePool", "both"])
def test_the_platform_gateway_reaches_the_picker_and_vllm_and_nothing_else(
    rendering: str, engine: str
) -> None:
    """What an InferencePool needs, and only that: the picker's gRPC port (not its metrics) and each
    pool's OpenAI port (not the metrics, LMCache or debug ports); and the gateway's metrics stay the
    scrapers'."""
    r = RENDERINGS[rendering]
    assert r.epp is not None
    assert r.ports(PLATFORM_GATEWAY, r.epp) == {EPP_PORT}
    assert r.ports(PLATFORM_GATEWAY, r.engines[engine]) == {ENGINE_PORT}
    assert r.ports(PLATFORM_GATEWAY, r.gateway) == {GATEWAY_PORT}


def test_without_an_inference_pool_the_platform_gateway_is_admitted_nowhere() -> None:
    """Envoy alone adds a caller of the picker (this ModelDeployment's gateway pods) and nothing else."""
    assert ENVOY.epp is not None
    assert ENVOY.ports(PLATFORM_GATEWAY, ENVOY.epp) == set()
    for engine in ENVOY.engines.values():
        assert ENVOY.ports(PLATFORM_GATEWAY, engine) == set()


@pytest.mark.parametrize(("rendering", "calls"), [("inferencePool", False), ("envoy", True), ("both", True)])
def test_this_model_deployments_gateway_reaches_the_picker_only_when_it_runs_envoy(
    rendering: str, calls: bool
) -> None:
    r = RENDERINGS[rendering]
    assert r.epp is not None
    assert r.ports(r.gateway, r.epp) == ({EPP_PORT} if calls else set())
    for engine in r.engines.values():
        # unchanged (kvfleet's gateway path): the OpenAI port, and the KV events its precise routing reads
        assert r.ports(r.gateway, engine) == {ENGINE_PORT, KV_EVENTS_PORT}


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_the_picker_reaches_each_engines_openai_port_and_kv_events_and_nothing_else(
    rendering: str,
) -> None:
    """The picker checks every replica's ``/health`` on vLLM's port (a picker that cannot would find no
    healthy replica and refuse every request) and reads its KV events for precise routing; it reaches no
    metrics, LMCache or debug port. The platform's gateway never reads the events (every tenant's tokens)."""
    r = RENDERINGS[rendering]
    assert r.epp is not None
    for engine in r.engines.values():
        assert r.ports(r.epp, engine) == {ENGINE_PORT, KV_EVENTS_PORT}
        assert KV_EVENTS_PORT not in r.ports(PLATFORM_GATEWAY, engine)


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_the_pickers_metrics_are_for_the_scrapers_only(rendering: str) -> None:
    r = RENDERINGS[rendering]
    assert r.epp is not None
    assert r.ports(PROMETHEUS, r.epp) == {EPP_METRICS_PORT}
    assert {p.port for p in r.epp.ports} == {EPP_PORT, EPP_METRICS_PORT}
    for engine in r.engines.values():
        assert r.ports(PROMETHEUS, engine) == {PLUGIN_METRICS_PORT}


def test_nothing_new_opens_on_the_gateway() -> None:
    """The gateway's policy is the same whatever it runs: its API for everyone, metrics for scrapers."""
    for r in RENDERINGS.values():
        assert r.ports(PROMETHEUS, r.gateway) == {GATEWAY_PORT, GATEWAY_METRICS_PORT}
        for attacker in ATTACKERS.values():
            assert r.ports(attacker, r.gateway) == {GATEWAY_PORT}
