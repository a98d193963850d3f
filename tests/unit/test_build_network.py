"""NetworkPolicies (build/network.py): only the gateway reaches engines, only scrapers read metrics."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.build.common import (
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
    Owner,
    selector_labels,
)
from kvfleet_operator.build.network import build_engine_network_policy, build_gateway_network_policy

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
TENANT_OWNER = Owner("kvfleet.io/v1alpha1", "Tenant", "bank", "t-uid")


def _ports(rule: dict[str, Any]) -> set[int]:
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    return {p["port"] for p in rule["ports"]}


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
    inference, metrics = spec["ingress"]
    # Inference only from this ModelDeployment's gateway pods (same namespace: no namespaceSelector).
    assert inference["from"] == [{"podSelector": {"matchLabels": selector_labels("m", "gateway")}}]
    assert _ports(inference) == {ENGINE_PORT}
    # Metrics from pods labelled as scrapers, in any namespace.
    assert metrics["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"kvfleet.io/metrics-scraper": "true"}}}
    ]
    assert _ports(metrics) == {ENGINE_PORT, PLUGIN_METRICS_PORT, LMCACHE_SYNC_METRICS_PORT}
    # LMCache's ports stay on the pod's loopback: no rule admits them.
    for rule in spec["ingress"]:
        assert not _ports(rule) & {LMCACHE_PORT, LMCACHE_HTTP_PORT}


def test_gateway_policy_admits_anyone_on_its_api_port_and_scrapers_on_its_metrics_port() -> None:
    policy = build_gateway_network_policy("ns", "m", OWNER)
    assert policy["metadata"]["name"] == "m-gateway"
    assert policy["spec"]["podSelector"] == {"matchLabels": selector_labels("m", "gateway")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    api, metrics = policy["spec"]["ingress"]
    assert "from" not in api  # any source
    assert _ports(api) == {GATEWAY_PORT}
    # The metrics name every tenant: only pods labelled as scrapers, in any namespace.
    assert metrics["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"kvfleet.io/metrics-scraper": "true"}}}
    ]
    assert _ports(metrics) == {GATEWAY_METRICS_PORT}
