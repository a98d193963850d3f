"""NetworkPolicies (build/network.py): only the gateway reaches engines, only scrapers read metrics, and
the scrapers are configurable. Who they really admit: tests/security/test_engine_reachability.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator.build.common import (
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KV_EVENTS_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
    Owner,
    selector_labels,
)
from kvfleet_operator.build.network import (
    MetricsScrapers,
    build_engine_network_policy,
    build_gateway_network_policy,
    parse_metrics_scrapers,
    parse_operator_peer,
)
from kvfleet_runtime.config import PLUGIN_DEBUG_PORT
from netpol_eval import Namespace, Pod, allowed_ports

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
TENANT_OWNER = Owner("kvfleet.io/v1alpha1", "Tenant", "bank", "t-uid")


def _ports(rule: dict[str, Any]) -> set[int]:
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    return {p["port"] for p in rule["ports"]}


DEFAULT_SCRAPERS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"kvfleet.io/metrics-scraper": "true"}},
}


@pytest.mark.parametrize(
    ("pool", "owner", "name"),
    [
        pytest.param("shared", OWNER, "m-engine", id="shared-pool"),
        pytest.param("dedicated-bank", TENANT_OWNER, "m-dedicated-bank-engine", id="dedicated-pool"),
    ],
)
def test_engine_policy(pool: str, owner: Owner, name: str) -> None:
    policy = build_engine_network_policy("ns", "m", pool, owner)
    assert policy["metadata"]["name"] == name
    assert policy["metadata"]["ownerReferences"][0]["uid"] == owner.uid
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": selector_labels("m", "engine", pool)}
    assert spec["policyTypes"] == ["Ingress"]  # default deny for everything not listed below
    inference, metrics, events = spec["ingress"]
    # Inference only from this ModelDeployment's gateway pods (same namespace: no namespaceSelector).
    gateway = {"podSelector": {"matchLabels": selector_labels("m", "gateway")}}
    assert inference["from"] == [gateway]
    assert _ports(inference) == {ENGINE_PORT}
    # The KV events (every tenant's token ids): its own gateway and Endpoint Picker pods only.
    assert events["from"] == [gateway, {"podSelector": {"matchLabels": selector_labels("m", "epp")}}]
    assert _ports(events) == {KV_EVENTS_PORT}
    # Metrics from labelled pods of the monitoring namespace, on the metrics port only.
    assert metrics["from"] == [DEFAULT_SCRAPERS]
    assert _ports(metrics) == {PLUGIN_METRICS_PORT}
    # LMCache's ports, the sync's metrics and the debug endpoint stay on the pod's loopback.
    for rule in spec["ingress"]:
        assert not _ports(rule) & {
            LMCACHE_PORT,
            LMCACHE_HTTP_PORT,
            LMCACHE_SYNC_METRICS_PORT,
            PLUGIN_DEBUG_PORT,
        }


def test_gateway_policy_admits_anyone_on_its_api_port_and_scrapers_on_its_metrics_port() -> None:
    policy = build_gateway_network_policy("ns", "m", OWNER)
    assert policy["metadata"]["name"] == "m-gateway"
    assert policy["spec"]["podSelector"] == {"matchLabels": selector_labels("m", "gateway")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    api, metrics = policy["spec"]["ingress"]
    assert "from" not in api  # any source
    assert _ports(api) == {GATEWAY_PORT}
    # The metrics name every tenant: only the configured scrapers.
    assert metrics["from"] == [DEFAULT_SCRAPERS]
    assert _ports(metrics) == {GATEWAY_METRICS_PORT}


def test_configured_scrapers_reach_both_policies() -> None:
    scrapers = parse_metrics_scrapers(
        '{"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["obs"]}]},'
        ' "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}'
    )
    peer = {
        "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["obs"]}]},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    engine = build_engine_network_policy("ns", "m", "shared", OWNER, scrapers)
    gateway = build_gateway_network_policy("ns", "m", OWNER, scrapers)
    assert engine["spec"]["ingress"][1]["from"] == [peer]
    assert gateway["spec"]["ingress"][1]["from"] == [peer]
    # Exists takes no values, and an empty selector stays empty (every namespace).
    exists = parse_metrics_scrapers(
        '{"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": "s", "operator": "Exists"}]}}'
    )
    assert exists.peer() == {
        "namespaceSelector": {},
        "podSelector": {"matchExpressions": [{"key": "s", "operator": "Exists"}]},
    }


@pytest.mark.parametrize("text", [None, "", "  "])
def test_no_configuration_is_the_default(text: str | None) -> None:
    assert parse_metrics_scrapers(text) == MetricsScrapers()
    assert MetricsScrapers().peer() == DEFAULT_SCRAPERS


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"podSelector": {"matchLabel": {"a": "b"}}}', id="typo"),
        pytest.param(
            '{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Gt"}]}}', id="operator"
        ),
        pytest.param(
            '{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}', id="in-no-values"
        ),
        pytest.param(
            '{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}}',
            id="exists-with-values",
        ),
        pytest.param('{"namespaces": ["monitoring"]}', id="unknown-field"),
        pytest.param("monitoring", id="not-json"),
    ],
)
def test_malformed_scrapers_are_refused(text: str) -> None:
    with pytest.raises(ValidationError):
        parse_metrics_scrapers(text)


def test_the_operator_reaches_engines_on_the_metrics_port_only() -> None:
    """The chart's operator peer (its namespace by name, its pods by the Deployment's selector labels):
    the operator's pods read the engines' metrics port and nothing else; a pod in the operator's namespace
    without its labels, and a pod with its labels in another namespace, reach nothing."""
    operator_labels = {
        "app.kubernetes.io/name": "kvfleet",
        "app.kubernetes.io/instance": "kvfleet",
        "app.kubernetes.io/component": "operator",
    }
    peer = parse_operator_peer(
        '{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvfleet-system"}},'
        ' "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfleet",'
        ' "app.kubernetes.io/instance": "kvfleet", "app.kubernetes.io/component": "operator"}}}'
    )
    assert peer is not None
    policy = build_engine_network_policy("llm", "m", "shared", OWNER, operator=peer)
    namespaces = [Namespace("llm"), Namespace("kvfleet-system"), Namespace("tenant-x")]
    engine = Pod("llm", "m-engine-0", selector_labels("m", "engine", "shared"))
    operator = Pod("kvfleet-system", "kvfleet-abc", operator_labels)
    assert allowed_ports([policy], namespaces, operator, engine) == {PLUGIN_METRICS_PORT}
    neighbour = Pod("kvfleet-system", "other", {"app.kubernetes.io/name": "kvfleet"})
    impostor = Pod("tenant-x", "fake-operator", operator_labels)
    assert allowed_ports([policy], namespaces, neighbour, engine) == set()
    assert allowed_ports([policy], namespaces, impostor, engine) == set()
    # Without a peer (an operator outside the cluster) the policy is the scrapers' alone, as before.
    assert build_engine_network_policy("llm", "m", "shared", OWNER)["spec"]["ingress"][1]["from"] == [
        DEFAULT_SCRAPERS
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"namespaceSelector": {}, "podSelector": {"matchLabels": {"a": "b"}}}',
        '{"namespaceSelector": {"matchLabels": {"a": "b"}}, "podSelector": {}}',
        '{"namespaceSelector": {"matchLabels": {"a": "b"}}}',
    ],
)
def test_an_operator_peer_that_would_admit_too_much_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_operator_peer(text)
