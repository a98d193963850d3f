"""The chart's reserved-labels admission policies, as ``helm template`` renders them: they reserve the very
labels the operator's Services and policies select its pods by, name the identities that create kvfleet's
pods and workloads, bind to the watched namespaces, and can be turned off; the schema takes only
per-controller identities. Their behaviour on a real API server: tests/security/test_reserved_labels.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary

from components import missing_component
from kvfleet_operator.build.common import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_SCRAPER,
    MANAGED_BY,
    SHARED_TIER_COMPONENT,
    object_labels,
    selector_labels,
)

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    helm = find_binary("helm")
    if helm is None:
        missing_component("helm", "hack/build-cluster.sh")
    return subprocess.run(
        [str(helm), "template", "kvfleet", str(CHART), "-n", "kvfleet-system", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _render(*args: str) -> list[dict[str, Any]]:
    done = _helm(*args)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return [
        d
        for d in docs
        if d["kind"].startswith("ValidatingAdmissionPolicy") and "-reserved-labels-" in d["metadata"]["name"]
    ]


def test_the_policies_reserve_the_labels_the_operator_selects_its_pods_by() -> None:
    policies = {d["metadata"]["name"]: d for d in _render() if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) == {"kvfleet-reserved-labels-pods", "kvfleet-reserved-labels-workloads"}
    for policy in policies.values():
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        reserved = next(v["expression"] for v in spec["variables"] if v["name"] == "reserved")
        # Every Service, NetworkPolicy and monitor selector the builders make carries name=kvfleet ...
        for component in ("engine", "gateway", SHARED_TIER_COMPONENT):
            assert selector_labels("m", component)[LABEL_NAME] == "kvfleet"
            assert object_labels("m", component)[LABEL_MANAGED_BY] == MANAGED_BY
        assert f"[?'{LABEL_NAME}'].orValue('') == 'kvfleet'" in reserved
        assert f"[?'{LABEL_MANAGED_BY}'].orValue('') == '{MANAGED_BY}'" in reserved
        # ... but the chart's own operator pod (component operator) and a platform's scrapers stay free.
        assert f"[?'{LABEL_COMPONENT}'].orValue('') != 'operator'" in reserved
        assert f"k != '{LABEL_SCRAPER}'" in reserved and "k.startsWith('kvfleet.io/')" in reserved
    pods = policies["kvfleet-reserved-labels-pods"]["spec"]
    assert pods["matchConstraints"]["resourceRules"][0]["resources"] == ["pods", "pods/ephemeralcontainers"]
    text = pods["validations"][0]["expression"]
    assert "system:serviceaccount:kube-system:statefulset-controller" in text
    assert "system:serviceaccount:kube-system:replicaset-controller" in text
    workloads = policies["kvfleet-reserved-labels-workloads"]["spec"]
    kinds = {r for rule in workloads["matchConstraints"]["resourceRules"] for r in rule["resources"]}
    assert kinds == {
        "deployments", "replicasets", "statefulsets", "daemonsets", "jobs", "cronjobs",
        "replicationcontrollers", "podtemplates",
    }  # fmt: skip
    text = workloads["validations"][0]["expression"]
    assert "'system:serviceaccount:kvfleet-system:kvfleet'" in text  # the operator's ServiceAccount
    assert "system:serviceaccount:kube-system:deployment-controller" in text


def test_bindings_cover_the_watched_namespaces_and_the_policies_can_be_turned_off() -> None:
    def namespaces(*args: str) -> list[Any]:
        bindings = [d for d in _render(*args) if d["kind"] == "ValidatingAdmissionPolicyBinding"]
        assert len(bindings) == 2 and all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)
        return [b["spec"].get("matchResources", {}).get("namespaceSelector") for b in bindings]

    def only(*names: str) -> dict[str, Any]:
        key = "kubernetes.io/metadata.name"
        return {"matchExpressions": [{"key": key, "operator": "In", "values": list(names)}]}

    assert namespaces() == [only("kvfleet-system")] * 2
    assert namespaces("--set", "operator.watchNamespaces={a,b}") == [only("a", "b")] * 2
    assert namespaces("--set", "operator.watchAllNamespaces=true") == [None, None]
    assert _render("--set", "reservedLabels.admissionPolicy=false") == []


@pytest.mark.parametrize(
    "value",
    [
        "reservedLabels.podCreators={system:kube-controller-manager}",
        "reservedLabels.workloadCreators={system:kube-controller-manager}",
        "dedicatedGpuGroups.podCreators={system:kube-controller-manager}",
        "dedicatedGpuGroups.podCreators={system:serviceaccount:kube-system}",
    ],
)
def test_creators_must_be_one_controllers_own_service_account(value: str) -> None:
    """Without ``--use-service-account-credentials`` every controller (the ReplicationController's and the
    DaemonSet's included) is ``system:kube-controller-manager``: naming that user would let any workload's
    pods through. The schema refuses it with a message naming the value."""
    done = _helm("--set", value)
    assert done.returncode != 0
    assert "does not match pattern '^system:serviceaccount:" in done.stderr, done.stderr
