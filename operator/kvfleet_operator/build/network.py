"""NetworkPolicies: tenants reach engines only through the gateway; metrics only from scrapers. Pure.

Every engine pod is selected by its pool's policy, so it is isolated for ingress (default deny). Three
rules admit what the pod must serve, and nothing else:

* vLLM's OpenAI port (``ENGINE_PORT``) from this ModelDeployment's gateway pods, in its namespace only;
* vLLM's KV events (``KV_EVENTS_PORT``, ZMQ; they carry every tenant's token ids) from this
  ModelDeployment's gateway and Endpoint Picker pods only, which route by them (precise routing);
* the plugin's metrics port (``PLUGIN_METRICS_PORT``, which serves no inference API: it re-exports vLLM's,
  LMCache's and the quota sync's series, see ``kvfleet_runtime.engine.metrics_server``) from the
  configured metrics scrapers (:class:`MetricsScrapers`) and, when it runs in the cluster, the operator's
  own pods (:class:`OperatorPeer`): it reads the KV blocks vLLM allocated there
  (``kvfleet_operator.reconcile.capacity``), and nowhere else on the pod.

The shared KV tier's pod (``spec.kvCache.shared``, ``build.shared_tier``) has its own policy: its KV port
from the shared pool's engine pods only, its metrics port from the scrapers.

Where the ModelDeployment runs an Endpoint Picker (``build.endpoint_picker``), its pods are a peer of the
engines' OpenAI port too: the picker checks each replica's ``/health`` there, as the gateway does (it
forwards nothing itself). With ``spec.gateway.inferencePool``, the platform gateway's pods
(``spec.gateway.inferencePool.gatewayPods``: a namespace by name AND pod labels, allowed by the chart's
``guardrails.inferenceGatewayNamespaces``) are another, the one thing an InferencePool needs of an engine.
The picker's own pods admit on their gRPC port (``EPP_PORT``) this ModelDeployment's gateway pods (the
Envoy data plane) and the platform gateway's pods (an InferencePool), and on their metrics port
(``EPP_METRICS_PORT``) the scrapers; nothing else.

LMCache's ZMQ and HTTP ports, the sync's metrics and the plugin's debug endpoint are in no rule: they bind
the pod's loopback (the launcher), which no other pod reaches and NetworkPolicy does not govern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from kvfleet_operator.api.common import CrdModel
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    EPP_COMPONENT,
    EPP_METRICS_PORT,
    EPP_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KV_EVENTS_PORT,
    LABEL_SCRAPER,
    PLUGIN_METRICS_PORT,
    SHARED_POOL,
    SHARED_TIER_COMPONENT,
    SHARED_TIER_METRICS_PORT,
    SHARED_TIER_PORT,
    Obj,
    Owner,
    engine_name,
    epp_name,
    gateway_name,
    metadata,
    object_labels,
    selector_labels,
    shared_tier_name,
)

#: The label the API server sets on every namespace to its name; no tenant can put it on another namespace.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: Where the default scrapers run (kube-prometheus-stack's usual namespace).
DEFAULT_MONITORING_NAMESPACE = "monitoring"


class SelectorRequirement(CrdModel):
    """One ``matchExpressions`` entry of a Kubernetes label selector."""

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> SelectorRequirement:
        # As the API server checks it: In/NotIn need values, Exists/DoesNotExist take none.
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(
                f"{self.operator} on {self.key!r}: In/NotIn need values, Exists/DoesNotExist none"
            )
        return self


class LabelSelector(CrdModel):
    """A Kubernetes label selector; ``{}`` selects everything."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[SelectorRequirement] = Field(default_factory=list)

    def render(self) -> Obj:
        out: Obj = {}
        if self.match_labels:
            out["matchLabels"] = dict(sorted(self.match_labels.items()))
        if self.match_expressions:
            out["matchExpressions"] = [
                e.model_dump(by_alias=True, exclude_defaults=True) for e in self.match_expressions
            ]
        return out


def _default_namespaces() -> LabelSelector:
    return LabelSelector(match_labels={NAMESPACE_NAME_LABEL: DEFAULT_MONITORING_NAMESPACE})


def _default_pods() -> LabelSelector:
    return LabelSelector(match_labels={LABEL_SCRAPER: "true"})


class MetricsScrapers(CrdModel):
    """Who may scrape the engines' and gateways' metrics ports: pods matching ``podSelector`` in
    namespaces matching ``namespaceSelector`` (both, one NetworkPolicy peer). Set by the chart
    (``metricsScrapers``, passed as ``KVFLEET_METRICS_SCRAPERS``); the default is pods labelled
    ``kvfleet.io/metrics-scraper=true`` in the namespace named ``monitoring``. The metrics name every
    tenant; scrapers never reach an inference or LMCache port."""

    namespace_selector: LabelSelector = Field(default_factory=_default_namespaces)
    pod_selector: LabelSelector = Field(default_factory=_default_pods)

    def peer(self) -> Obj:
        return {
            "namespaceSelector": self.namespace_selector.render(),
            "podSelector": self.pod_selector.render(),
        }


class OperatorPeer(CrdModel):
    """The operator's own pods, as one NetworkPolicy peer: admitted to the engines' metrics port only,
    where it reads the KV blocks each engine allocated. Set by the chart from its release
    (``KVFLEET_OPERATOR_PEER``: its namespace by name, its pods by the Deployment's selector labels); unset
    when the operator runs outside the cluster (then no engine policy names it)."""

    namespace_selector: LabelSelector
    pod_selector: LabelSelector

    def peer(self) -> Obj:
        return {
            "namespaceSelector": self.namespace_selector.render(),
            "podSelector": self.pod_selector.render(),
        }


def parse_operator_peer(text: str | None) -> OperatorPeer | None:
    """The operator's peer from its JSON (``KVFLEET_OPERATOR_PEER``); empty or ``None``: none.

    Raises ``ValueError`` (pydantic's ``ValidationError`` is one) for anything that is not a pair of label
    selectors, or for an empty selector, which would admit every namespace or every pod.
    """
    if not text or not text.strip():
        return None
    peer = OperatorPeer.model_validate_json(text)
    for selector in (peer.namespace_selector, peer.pod_selector):
        if not selector.render():
            raise ValueError("KVFLEET_OPERATOR_PEER: an empty selector would admit every pod of the cluster")
    return peer


def parse_metrics_scrapers(text: str | None) -> MetricsScrapers:
    """The scrapers from their JSON (``KVFLEET_METRICS_SCRAPERS``); empty or ``None``: the default.

    Raises ``pydantic.ValidationError`` for anything that is not a pair of label selectors."""
    if not text or not text.strip():
        return MetricsScrapers()
    return MetricsScrapers.model_validate_json(text)


def _ports(*ports: int) -> list[Obj]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def build_engine_network_policy(
    namespace: str,
    model_deployment: str,
    pool: str,
    owner: Owner,
    scrapers: MetricsScrapers | None = None,
    operator: OperatorPeer | None = None,
    callers: Sequence[Obj] = (),
) -> Obj:
    """The pool's engine pods accept the gateway (and ``callers``: the Endpoint Picker's pods,
    :func:`epp_pods_peer`, and the platform gateway's of an InferencePool) on the inference port, and
    scrapers (and the operator, when given) on the metrics port; nothing else (see the module docstring)."""
    scrapers = scrapers or MetricsScrapers()
    readers = [scrapers.peer()] + ([operator.peer()] if operator is not None else [])
    # No namespaceSelector on the first peer: only pods of the policy's own namespace.
    gateway = {"podSelector": {"matchLabels": selector_labels(model_deployment, "gateway")}}
    inference = [gateway, *callers]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            engine_name(model_deployment, pool),
            namespace,
            object_labels(model_deployment, "engine", pool),
            owner,
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, "engine", pool)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": inference, "ports": _ports(ENGINE_PORT)},
                {"from": readers, "ports": _ports(PLUGIN_METRICS_PORT)},
                # The KV events carry every tenant's token ids: this ModelDeployment's own front doors
                # only (they route by them), never a platform gateway or a scraper.
                {"from": [gateway, epp_pods_peer(model_deployment)], "ports": _ports(KV_EVENTS_PORT)},
            ],
        },
    }


def build_shared_tier_network_policy(
    namespace: str, model_deployment: str, owner: Owner, scrapers: MetricsScrapers | None = None
) -> Obj:
    """The shared KV tier holds every salted tenant's chunks of the shared pool: only that pool's engine
    pods (in this namespace) reach its KV port; scrapers its metrics port; nothing else (not the gateway,
    not a dedicated pool's engines)."""
    scrapers = scrapers or MetricsScrapers()
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            shared_tier_name(model_deployment),
            namespace,
            object_labels(model_deployment, SHARED_TIER_COMPONENT),
            owner,
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, SHARED_TIER_COMPONENT)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": selector_labels(model_deployment, "engine", SHARED_POOL)
                            }
                        }
                    ],
                    "ports": _ports(SHARED_TIER_PORT),
                },
                {"from": [scrapers.peer()], "ports": _ports(SHARED_TIER_METRICS_PORT)},
            ],
        },
    }


def build_gateway_network_policy(
    namespace: str, model_deployment: str, owner: Owner, scrapers: MetricsScrapers | None = None
) -> Obj:
    """The gateway is the front door: client traffic from anywhere on its API port; its metrics port
    only from the metrics scrapers (the metrics name every tenant)."""
    scrapers = scrapers or MetricsScrapers()
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            gateway_name(model_deployment), namespace, object_labels(model_deployment, "gateway"), owner
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, "gateway")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": _ports(GATEWAY_PORT)},
                {"from": [scrapers.peer()], "ports": _ports(GATEWAY_METRICS_PORT)},
            ],
        },
    }


def epp_pods_peer(model_deployment: str) -> Obj:
    """This ModelDeployment's Endpoint Picker pods, in the policy's own namespace: they health-check the
    engines on the OpenAI port."""
    return {"podSelector": {"matchLabels": selector_labels(model_deployment, EPP_COMPONENT)}}


def build_epp_network_policy(
    namespace: str,
    model_deployment: str,
    owner: Owner,
    scrapers: MetricsScrapers | None = None,
    *,
    own_gateway: bool,
    gateway_peers: Sequence[Obj] = (),
) -> Obj:
    """The Endpoint Picker decides who is which tenant and where each request goes: its gRPC port admits
    this ModelDeployment's gateway pods (``own_gateway``: the Envoy data plane calls it) and
    ``gateway_peers`` (the platform gateway's pods, for an InferencePool), its metrics port the scrapers.
    With neither caller the gRPC port has no rule at all (an empty ``from`` would admit everyone)."""
    scrapers = scrapers or MetricsScrapers()
    callers = [
        *(
            [{"podSelector": {"matchLabels": selector_labels(model_deployment, "gateway")}}]
            if own_gateway
            else []
        ),
        *gateway_peers,
    ]
    rules: list[Obj] = [{"from": callers, "ports": _ports(EPP_PORT)}] if callers else []
    rules.append({"from": [scrapers.peer()], "ports": _ports(EPP_METRICS_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            epp_name(model_deployment), namespace, object_labels(model_deployment, EPP_COMPONENT), owner
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, EPP_COMPONENT)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
