"""``spec.pool.podTemplate`` on the real API server: a ModelDeployment whose template sets every field a
user may override is stored (schema and CEL), the operator's reconcile applies an engine StatefulSet the
API server's own validation accepts, the overrides are in the stored pod template beside the operator's
security settings (which no template can change), the memory request carries the LMCache CPU tier, and a
later reconcile finds nothing to write (no field the API server defaults or normalises drifts forever).

The refusals (security fields, ``kvfleet.io/`` labels, operator env) are rows of tests/invalid_manifests.py,
sent to the same API server by test_cluster_api.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from devcluster import ControlPlane

from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.k8s import kinds
from operator_support import API, converge, model_deployment, reconcile, tiny_namespace

MD = "tiny"
ENGINE = f"{MD}-engine"
ZONE_A = {"key": "zone", "operator": "In", "values": ["a"]}
TEMPLATE: dict[str, Any] = {
    "labels": {"team": "inference"},
    "annotations": {"example.com/owner": "ml-platform"},
    "resources": {"requests": {"cpu": "1500m", "memory": "3Gi"}, "limits": {"memory": "5Gi"}},
    "env": [
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
        {"name": "EXTRA_TOKEN", "valueFrom": {"secretKeyRef": {"name": "extra", "key": "token"}}},
    ],
    "envFrom": [{"prefix": "TUNING_", "configMapRef": {"name": "vllm-tuning"}}],
    "runtimeClassName": "kvfleet-test",
    "priorityClassName": "inference-high",
    "imagePullSecrets": [{"name": "registry"}],
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [ZONE_A]}}
            ]
        }
    },
}  # fmt: skip


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    yield from tiny_namespace(api_cluster, "podtpl", ("basic-a",), schedulable=True)


def _engine_template(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    status, body = plane.request("GET", kinds.STATEFUL_SET.path(namespace, ENGINE))
    assert status == 200, body
    template: dict[str, Any] = body["spec"]["template"]
    return template


def test_every_overridable_field_reaches_the_stored_engine_pods(
    api_cluster: ControlPlane, namespace: str
) -> None:
    plane = api_cluster
    converge(plane, namespace, MD)
    before = _engine_template(plane, namespace)

    md = model_deployment(plane, namespace, MD)
    md["spec"]["pool"]["podTemplate"] = copy.deepcopy(TEMPLATE)
    status, body = plane.request("PUT", f"{API}/namespaces/{namespace}/modeldeployments/{MD}", md)
    assert status == 200, body  # the CRD's schema and CEL rules accept every overridable field
    assert reconcile(plane, namespace, MD)[1] >= 1  # the StatefulSet changed, accepted by the API server
    converge(plane, namespace, MD)  # reconciles until one writes nothing: no override drifts forever

    template = _engine_template(plane, namespace)
    meta, pod = template["metadata"], template["spec"]
    assert meta["labels"]["team"] == "inference"
    assert meta["labels"]["app.kubernetes.io/component"] == "engine"  # the operator's own labels stay
    assert meta["annotations"]["example.com/owner"] == "ml-platform"
    assert pod["runtimeClassName"] == "kvfleet-test"
    assert pod["priorityClassName"] == "inference-high"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["affinity"]["nodeAffinity"] == TEMPLATE["affinity"]["nodeAffinity"]
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    env = {e["name"]: e for e in engine["env"]}
    assert env["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
    assert env["EXTRA_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "extra", "key": "token"}
    assert {e["name"] for e in before["spec"]["containers"][0]["env"]} <= set(env)  # the operator's env stays
    assert engine["envFrom"] == [{"prefix": "TUNING_", "configMapRef": {"name": "vllm-tuning"}}]
    # Memory is the template's plus what the pod holds besides: the LMCache CPU tier (kvCache.cpuSize) and,
    # on a CPU engine, vLLM's own KV space (pool.cpuKvCacheSpace).
    held = parse_quantity(md["spec"]["kvCache"]["cpuSize"]) + parse_quantity(
        md["spec"]["pool"]["cpuKvCacheSpace"]
    )
    requests = engine["resources"]["requests"]
    assert parse_quantity(requests["memory"]) == parse_quantity("3Gi") + held, requests
    assert requests["cpu"] == "1500m", requests
    assert parse_quantity(engine["resources"]["limits"]["memory"]) == parse_quantity("5Gi") + held
    # What carries isolation and security is the operator's, template or not.
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == before["spec"]["securityContext"]
    assert engine["securityContext"] == before["spec"]["containers"][0]["securityContext"]
    assert engine["securityContext"]["allowPrivilegeEscalation"] is False
