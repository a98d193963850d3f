"""The chart's admission policies for dedicated GPU groups, as ``helm template`` renders them: they name the
labels and identities the operator uses, and their bindings deny everywhere but the exempt namespaces
(and can be turned off). Their behaviour on a real API server: tests/security/test_dedicated_gpu_groups.py;
who owns a group: tests/unit/test_gpu_groups.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from devcluster import find_binary

from components import missing_component
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.build.common import LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_POOL, object_labels
from kvfleet_operator.build.tenant_table import dedicated_pool_name

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"


# --- the chart's admission policies (their behaviour is tested on the real API server in
# tests/security/test_dedicated_gpu_groups.py; here: they name what the operator builds) -----------------
def _render_policies(*args: str) -> list[dict[str, Any]]:
    helm = find_binary("helm")
    if helm is None:
        missing_component("helm", "hack/build-cluster.sh")
    done = subprocess.run(
        [str(helm), "template", "kvfleet", str(CHART), "-n", "kvfleet-system", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return [
        d
        for d in docs
        if d["kind"].startswith("ValidatingAdmissionPolicy") and "-dedicated-gpu-" in d["metadata"]["name"]
    ]


def test_the_policies_name_the_labels_and_identities_the_operator_uses() -> None:
    docs = _render_policies()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) == {"kvfleet-dedicated-gpu-pods", "kvfleet-dedicated-gpu-workloads"}
    text = "\n".join(
        e["expression"]
        for p in policies.values()
        for e in (*p["spec"]["variables"], *p["spec"]["validations"])
    )
    engine_labels = object_labels("m", "engine", dedicated_pool_name("bank"))
    for key in (LABEL_MANAGED_BY, LABEL_COMPONENT, LABEL_POOL):
        assert f"'{key}'" in text, key
    assert f"'{engine_labels[LABEL_MANAGED_BY]}'" in text and f"'{engine_labels[LABEL_COMPONENT]}'" in text
    assert f"startsWith('{dedicated_pool_name('')}')" in text
    assert text.count(f"'{GPU_GROUP_LABEL}'") >= 8  # tolerations, node selector, affinity, exclusion
    assert "system:serviceaccount:kvfleet-system:kvfleet'" in text  # the operator's ServiceAccount
    assert "system:serviceaccount:kube-system:statefulset-controller" in text
    for policy in policies.values():
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert {v["reason"] for v in policy["spec"]["validations"]} == {"Forbidden"}


def test_bindings_deny_everywhere_but_the_exempt_namespaces_and_the_policies_can_be_turned_off() -> None:
    bindings = [d for d in _render_policies() if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert len(bindings) == 2
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"]
        assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
        ]
    none_exempt = _render_policies("--set-json", "dedicatedGpuGroups.exemptNamespaces=[]")
    assert all("matchResources" not in d["spec"] for d in none_exempt if "Binding" in d["kind"])
    assert _render_policies("--set", "dedicatedGpuGroups.admissionPolicy=false") == []
