"""Attacks on a dedicated GPU group, on the real API server (controller manager, scheduler, kwok GPU nodes).

Threat: a dedicated GPU group (nodes labelled and tainted ``kvfleet.io/gpu-group=<group>``) holds one
tenant's KV cache, in GPU memory and on its NVMe. A neighbour must not run there: not another Tenant
naming the same group, not a user who can create pods or workloads (whatever labels or identity it puts on
them), not a ModelDeployment whose tolerations match every taint. And nothing of the tenant stays behind
when it goes.

Defences under test: the operator's ownership rule (``build/gpu_groups.py``: a group belongs to whom the
platform bound it to, chart value ``dedicatedGpuGroups.owners``; any other claimant, however early, gets
``GpuGroupInUse`` naming the binding, a claimant of an unbound group ``GpuGroupNotBound``, and nothing is
built for either; a pool already running on a group nobody bound yet keeps running); the chart's
ValidatingAdmissionPolicies (``charts/kvfleet/templates/dedicated-gpu-groups.yaml``), enforced by the API
server itself; the shared pool's required ``DoesNotExist`` affinity for wildcard tolerations; and the
engine StatefulSets' PVC retention policy (the NVMe volumes go with the pool).

Setup: the chart's RBAC (watching the two namespaces of the test) and its policies, rendered by helm and
applied as an install would; the operator's reconcile runs in process **as the chart's ServiceAccount**
(a TokenRequest token), since the policies check who creates an engine workload. The attacks are made as
the cluster admin: the policies refuse even that. At the end the policies are removed, so that later
tests may create whatever pods they like.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import apply_crds, create_namespace, delete_namespace, run_tool, wait_for
from devcluster import ControlPlane
from test_operator_reconcile import CONFIG, condition, create, get, load_example, provision_local_nvme, tenant

from kvfleet_operator.api import reasons
from kvfleet_operator.build.gpu_groups import GroupBinding
from kvfleet_operator.handlers.reconcile import OperatorConfig, ReconcileResult, reconcile_model_deployment
from kvfleet_operator.k8s.client import Credentials, KubeClient

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
#: The release name; it contains the chart's name, so it is also the full name and the ServiceAccount's.
RELEASE = "kvfleet-sec"
GROUP = "bank-h200"
GROUP_KEY = "kvfleet.io/gpu-group"
MD = "qwen72b"
POD_POLICY = f"{RELEASE}-dedicated-gpu-pods"
WORKLOAD_POLICY = f"{RELEASE}-dedicated-gpu-workloads"
REFUSED = "dedicated GPU group (kvfleet.io/gpu-group), which belongs to one Tenant"
BANK_KEY = "kvf-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Setup:
    plane: ControlPlane
    release_ns: str
    owner_ns: str
    thief_ns: str
    operator_kubeconfig: Path
    config: OperatorConfig
    rendered: str


def _probe_pod(namespace: str, name: str = "probe", **spec: Any) -> dict[str, Any]:
    """A pod that passes the restricted Pod Security level, so that only the policies can refuse it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "c",
                    "image": "busybox:1",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
            **spec,
        },
    }


def _group_toleration(group: str = GROUP) -> dict[str, Any]:
    return {"key": GROUP_KEY, "operator": "Equal", "value": group, "effect": "NoSchedule"}


def _affinity(operator: str, *values: str) -> dict[str, Any]:
    expression: dict[str, Any] = {"key": GROUP_KEY, "operator": operator}
    if values:
        expression["values"] = list(values)
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [expression]}]
            }
        }
    }


def _post(plane: ControlPlane, doc: dict[str, Any], *, dry_run: bool = False) -> tuple[int, Any]:
    meta = doc["metadata"]
    group, _, version = doc["apiVersion"].rpartition("/")
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    plural = doc["kind"].lower() + "s"
    path = f"{prefix}/namespaces/{meta['namespace']}/{plural}" + ("?dryRun=All" if dry_run else "")
    return plane.request("POST", path, doc)


def _refused_by(body: Any, policy: str) -> bool:
    message = str((body or {}).get("message", ""))
    return f"ValidatingAdmissionPolicy '{policy}'" in message and REFUSED in message


def _reconcile_as_operator(s: Setup, namespace: str, config: OperatorConfig | None = None) -> ReconcileResult:
    async def go() -> ReconcileResult:
        async with KubeClient(Credentials.from_kubeconfig(s.operator_kubeconfig)) as client:
            return await reconcile_model_deployment(client, config or s.config, namespace, MD)

    return asyncio.run(go())


def _model_deployment(namespace: str, **pool: Any) -> dict[str, Any]:
    doc = load_example("modeldeployment-qwen72b.yaml", namespace)
    doc["spec"]["pool"] |= {"replicas": 1, **pool}  # one 8-GPU node each: the tests share the fake nodes
    return doc


def _dedicated_tenant(namespace: str, name: str) -> dict[str, Any]:
    doc = load_example("tenant-bank.yaml", namespace)
    doc["metadata"]["name"] = name
    doc["spec"].pop("apiKeySecretRef")  # generated, if it is ever admitted
    return doc


def _status(plane: ControlPlane, path: str) -> int:
    return int(plane.request("GET", path)[0])


@pytest.fixture(scope="module")
def setup(full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    plane = full_cluster
    apply_crds(plane)
    release_ns = create_namespace(plane, "kvfleet-system")
    restricted = {"pod-security.kubernetes.io/enforce": "restricted"}
    owner_ns = create_namespace(plane, "bank", labels=restricted)
    thief_ns = create_namespace(plane, "thief", labels=restricted)
    status, body = plane.request(
        "POST", f"/api/v1/namespaces/{release_ns}/serviceaccounts", {"metadata": {"name": RELEASE}}
    )
    assert status == 201, body
    rendered = run_tool(
        plane, "helm", "template", RELEASE, str(CHART), "-n", release_ns,
        "--set", f"operator.watchNamespaces={{{owner_ns},{thief_ns}}}",
        "-s", "templates/rbac.yaml", "-s", "templates/dedicated-gpu-groups.yaml",
    )  # fmt: skip
    kinds_rendered = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Role"} <= kinds_rendered
    try:
        apply_args = ("apply", "--server-side", "--field-manager=helm", "-f", "-")
        run_tool(plane, "kubectl", *apply_args, stdin=rendered)
        # The API server enforces a policy once its informer has it: wait for the first refusal.
        probe = _probe_pod(thief_ns, tolerations=[_group_toleration()])
        wait_for(
            lambda: _refused_by(_post(plane, probe, dry_run=True)[1], POD_POLICY),
            timeout=60,
            what="the dedicated-GPU pod policy in force",
        )
        for namespace in (owner_ns, thief_ns):
            provision_local_nvme(plane, namespace)
        kubeconfig = plane.service_account_kubeconfig(
            release_ns, RELEASE, tmp_path_factory.mktemp("operator") / "sa.kubeconfig"
        )
        # The platform bound the group to the bank (dedicatedGpuGroups.owners).
        config = replace(
            CONFIG,
            watch_namespaces=(owner_ns, thief_ns),
            gpu_group_owners={GROUP: GroupBinding(owner_ns, "bank")},
        )
        yield Setup(plane, release_ns, owner_ns, thief_ns, kubeconfig, config, rendered)
    finally:
        run_tool(plane, "kubectl", "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=rendered)
        for namespace in (owner_ns, thief_ns, release_ns):
            delete_namespace(plane, namespace, wait=True)


@pytest.fixture(scope="module")
def owner(setup: Setup) -> Setup:
    """The bank's ModelDeployment and its dedicated tenant ``bank`` (the group's first claimant),
    reconciled by the operator until nothing changes."""
    s, ns = setup, setup.owner_ns
    create(s.plane, _model_deployment(ns))
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "bank-api-key", "namespace": ns, "labels": {"kvfleet.io/tenant": "bank"}},
        "data": {"api-key": base64.b64encode(BANK_KEY.encode()).decode()},
    }
    create(s.plane, secret)
    create(s.plane, load_example("tenant-bank.yaml", ns))
    for _ in range(4):
        if not _reconcile_as_operator(s, ns).applied:
            break
    ready = condition(tenant(s.plane, ns, "bank"))
    assert ready.get("reason") in {reasons.READY, reasons.MODEL_DEPLOYMENT_NOT_READY}, ready
    return s


def _engine_pods(plane: ControlPlane, namespace: str) -> dict[str, str]:
    pods = get(plane, f"/api/v1/namespaces/{namespace}/pods?labelSelector=app.kubernetes.io/component=engine")
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods["items"]}


def test_the_owners_engine_workload_is_admitted_and_lands_on_its_group(owner: Setup) -> None:
    """The legitimate path through the policies: the operator's identity creates the StatefulSet, the
    StatefulSet controller creates the pod with the engine labels, the scheduler puts it on the group."""
    s = owner
    sts = get(s.plane, f"/apis/apps/v1/namespaces/{s.owner_ns}/statefulsets/{MD}-dedicated-bank-engine")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Retain",
    }
    group_nodes = {n.name for n in s.plane.layout.dedicated_groups[GROUP]}
    placed = wait_for(
        lambda: _engine_pods(s.plane, s.owner_ns).get(f"{MD}-dedicated-bank-engine-0"),
        timeout=90,
        what="the bank's engine pod scheduled",
    )
    assert placed in group_nodes
    assert condition(tenant(s.plane, s.owner_ns, "bank")).get("reason") != reasons.GPU_GROUP_IN_USE


def _owner_sts(s: Setup) -> dict[str, Any]:
    return get(s.plane, f"/apis/apps/v1/namespaces/{s.owner_ns}/statefulsets/{MD}-dedicated-bank-engine")


def _owner_pod(s: Setup) -> dict[str, Any]:
    return get(s.plane, f"/api/v1/namespaces/{s.owner_ns}/pods/{MD}-dedicated-bank-engine-0")


def _copy_of(obj: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    doc = copy.deepcopy(obj)
    meta = doc["metadata"]
    doc["metadata"] = {"name": name, "namespace": namespace, "labels": meta.get("labels", {})}
    doc.pop("status", None)
    return doc


def _workload(
    kind: str, namespace: str, pod_spec: dict[str, Any], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """A workload of ``kind`` whose pods run ``pod_spec``: every kind that keeps a pod template."""
    labels = labels or {"app": "intruder"}
    template = {"metadata": {"labels": labels}, "spec": pod_spec}
    spec: dict[str, Any] = {"template": template}
    api = {"Job": "batch/v1", "CronJob": "batch/v1", "ReplicationController": "v1", "PodTemplate": "v1"}
    if kind in {"Job", "CronJob"}:
        template["spec"] = {**pod_spec, "restartPolicy": "Never"}
    elif kind == "ReplicationController":
        spec["selector"] = labels
    elif kind != "PodTemplate":
        spec["selector"] = {"matchLabels": labels}
    if kind == "StatefulSet":
        spec["serviceName"] = "intruder"
    doc: dict[str, Any] = {
        "apiVersion": api.get(kind, "apps/v1"),
        "kind": kind,
        "metadata": {"name": "intruder", "namespace": namespace},
    }
    if kind == "CronJob":
        doc["spec"] = {"schedule": "0 0 1 1 *", "jobTemplate": {"spec": spec}}
    elif kind == "PodTemplate":
        doc["template"] = template
    else:
        doc["spec"] = spec
    return doc


def _pod_spec_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec a pod or workload document runs (the path each kind keeps its template under)."""
    kind = doc["kind"]
    spec: dict[str, Any]
    if kind == "Pod":
        spec = doc["spec"]
    elif kind == "PodTemplate":
        spec = doc["template"]["spec"]
    elif kind == "CronJob":
        spec = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    else:
        spec = doc["spec"]["template"]["spec"]
    return spec


#: Each attack: (what it is, the object it creates, the policy that must refuse it). The thief's
#: namespace enforces the restricted Pod Security level and every object passes it.
ATTACKS: dict[str, Callable[[Setup], tuple[dict[str, Any], str]]] = {
    "pod-tolerating-the-group": lambda s: (
        _probe_pod(s.thief_ns, tolerations=[_group_toleration()]),
        POD_POLICY,
    ),
    "pod-tolerating-every-group": lambda s: (
        _probe_pod(s.thief_ns, tolerations=[{"key": GROUP_KEY, "operator": "Exists"}]),
        POD_POLICY,
    ),
    "pod-with-a-wildcard-toleration": lambda s: (
        _probe_pod(s.thief_ns, tolerations=[{"operator": "Exists"}]),
        POD_POLICY,
    ),
    "pod-selecting-the-group-by-node-selector": lambda s: (
        _probe_pod(s.thief_ns, nodeSelector={GROUP_KEY: GROUP}),
        POD_POLICY,
    ),
    "pod-requiring-the-group-by-affinity": lambda s: (
        _probe_pod(s.thief_ns, affinity=_affinity("In", GROUP), tolerations=[_group_toleration()]),
        POD_POLICY,
    ),
    "pod-dressed-as-the-owners-engine-pod-in-its-namespace": lambda s: (
        _copy_of(_owner_pod(s), "impostor-0", s.owner_ns),
        POD_POLICY,
    ),
    "statefulset-copied-from-the-operators-in-the-owners-namespace": lambda s: (
        _copy_of(_owner_sts(s), "impostor", s.owner_ns),
        WORKLOAD_POLICY,
    ),
    "deployment-tolerating-the-group": lambda s: (
        _workload(
            "Deployment", s.thief_ns, _probe_pod(s.thief_ns, tolerations=[_group_toleration()])["spec"]
        ),
        WORKLOAD_POLICY,
    ),
    "daemonset-with-a-wildcard-toleration": lambda s: (
        _workload(
            "DaemonSet", s.thief_ns, _probe_pod(s.thief_ns, tolerations=[{"operator": "Exists"}])["spec"]
        ),
        WORKLOAD_POLICY,
    ),
    "job-selecting-the-group": lambda s: (
        _workload("Job", s.thief_ns, _probe_pod(s.thief_ns, nodeSelector={GROUP_KEY: GROUP})["spec"]),
        WORKLOAD_POLICY,
    ),
    # Issue 23, hole 10: the kinds the workload policy once left to the pod policy alone.
    "replicationcontroller-tolerating-the-group": lambda s: (
        _workload(
            "ReplicationController",
            s.thief_ns,
            _probe_pod(s.thief_ns, tolerations=[_group_toleration()])["spec"],
        ),
        WORKLOAD_POLICY,
    ),
    "cronjob-selecting-the-group": lambda s: (
        _workload("CronJob", s.thief_ns, _probe_pod(s.thief_ns, nodeSelector={GROUP_KEY: GROUP})["spec"]),
        WORKLOAD_POLICY,
    ),
    "podtemplate-tolerating-the-group": lambda s: (
        _workload(
            "PodTemplate", s.thief_ns, _probe_pod(s.thief_ns, tolerations=[_group_toleration()])["spec"]
        ),
        WORKLOAD_POLICY,
    ),
}


def _without_group(doc: dict[str, Any]) -> dict[str, Any]:
    """The same object with everything that reaches a group removed: what the policies must let through.
    A workload's template also loses the dedicated pool label (it becomes the shared pool's), the label the
    pod policy lets onto a group."""
    benign = copy.deepcopy(doc)
    spec = _pod_spec_of(benign)
    for key in ("tolerations", "nodeSelector", "affinity"):
        spec.pop(key, None)
    if benign["kind"] in {"StatefulSet", "Deployment", "ReplicaSet", "DaemonSet"}:
        template_labels = benign["spec"]["template"]["metadata"].get("labels", {})
        for labels in (template_labels, benign["spec"]["selector"].get("matchLabels", {})):
            if str(labels.get("kvfleet.io/pool", "")).startswith("dedicated-"):
                labels["kvfleet.io/pool"] = "shared"
    return benign


@pytest.mark.parametrize("attack", ATTACKS, ids=ATTACKS)
def test_a_foreign_pod_or_workload_reaching_the_group_is_refused_by_the_api_server(
    owner: Setup, attack: str
) -> None:
    """Attack: a user who may create pods or workloads (here the cluster admin) puts them on the bank's
    GPUs: by toleration, node selector, affinity, a wildcard toleration, or a copy of the operator's own
    StatefulSet or engine pod with all its labels. The API server refuses each with the policy's message;
    the same object without its way onto the group is admitted (so the policy is what refused it)."""
    doc, policy = ATTACKS[attack](owner)
    status, body = _post(owner.plane, doc)
    assert status == 403 and _refused_by(body, policy), (status, body)
    status, body = _post(owner.plane, _without_group(doc), dry_run=True)
    assert status == 201, body


def test_adding_a_toleration_to_a_pending_pod_is_refused(owner: Setup) -> None:
    """Attack: create an ordinary pod that cannot be scheduled yet, then add the group's toleration and
    node selector by an update (tolerations of a pod may be added). Label changes stay allowed."""
    s = owner
    pod = _probe_pod(s.thief_ns, "pending", nodeSelector={"no-such-label": "anywhere"})
    status, body = _post(s.plane, pod)
    assert status == 201, body
    path = f"/api/v1/namespaces/{s.thief_ns}/pods/pending"
    patch = {"spec": {"tolerations": [_group_toleration()]}}
    status, body = s.plane.request("PATCH", path, patch, content_type="application/merge-patch+json")
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)
    label = {"metadata": {"labels": {"touched": "yes"}}}
    assert s.plane.request("PATCH", path, label, content_type="application/merge-patch+json")[0] == 200


def _events_about(plane: ControlPlane, namespace: str, kind: str, name: str) -> list[str]:
    items = get(
        plane,
        f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.kind={kind},"
        f"involvedObject.name={name}",
    )["items"]
    return [str(e.get("message", "")) for e in items]


def test_a_user_statefulset_dressed_as_a_dedicated_engine_pool_is_refused(owner: Setup) -> None:
    """Attack (issue 23, hole 10): a StatefulSet whose template wears the labels of the bank's engine pods
    and neither tolerates nor selects the group itself: a RuntimeClass adds the toleration to each pod
    after every check of the template (``scheduling.tolerations``, merged by the API server's RuntimeClass
    admission; a mutating webhook does the same). Its pods would be created by the StatefulSet controller
    with the dedicated labels, which the pod policy lets onto the group. The workload policy refuses the
    dressed StatefulSet; the same StatefulSet under its own labels is admitted, and the pods the controller
    then tries to create, tolerations added, are refused by the pod policy (the controller's event)."""
    s = owner
    runtime_class = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "intruder-gpu"},
        "handler": "runc",
        "scheduling": {"tolerations": [_group_toleration()]},
    }
    status, body = s.plane.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", runtime_class)
    assert status == 201, body
    try:
        pod_spec = {**_probe_pod(s.thief_ns)["spec"], "runtimeClassName": "intruder-gpu"}
        dressed_labels = _owner_sts(s)["spec"]["template"]["metadata"]["labels"]
        dressed = _workload("StatefulSet", s.thief_ns, pod_spec, labels=dict(dressed_labels))
        status, body = _post(s.plane, dressed)
        assert status == 403 and _refused_by(body, WORKLOAD_POLICY), (status, body)

        plain = _workload("StatefulSet", s.thief_ns, pod_spec)
        status, body = _post(s.plane, plain)
        assert status == 201, body
        wait_for(
            lambda: any(
                f"ValidatingAdmissionPolicy '{POD_POLICY}'" in m
                for m in _events_about(s.plane, s.thief_ns, "StatefulSet", "intruder")
            ),
            timeout=60,
            what="the controller's pod, given the group's toleration by the RuntimeClass, refused",
        )
        assert _status(s.plane, f"/api/v1/namespaces/{s.thief_ns}/pods/intruder-0") == 404
    finally:
        s.plane.request("DELETE", f"/apis/apps/v1/namespaces/{s.thief_ns}/statefulsets/intruder")
        s.plane.request("DELETE", "/apis/node.k8s.io/v1/runtimeclasses/intruder-gpu")


def _ephemeral_patch(target: str) -> dict[str, Any]:
    debugger = {
        "name": "debugger",
        "image": "busybox:1",
        "targetContainerName": target,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    return {"spec": {"ephemeralContainers": [debugger]}}


def test_an_ephemeral_container_in_the_owners_engine_pod_is_refused(owner: Setup) -> None:
    """Attack (issue 23, hole 10): ``kubectl debug`` on the bank's engine pod, an update of its
    ``pods/ephemeralcontainers`` subresource, which the pod policy once did not match: foreign code in the
    pod that holds the tenant's KV cache, sharing its network (loopback LMCache, ``/debug/kv``) and, with a
    target container, its processes. The API server refuses it; the same debug container in an ordinary pod
    is admitted (so the policy is what refused it)."""
    s = owner
    name = f"{MD}-dedicated-bank-engine-0"
    wait_for(
        lambda: _status(s.plane, f"/api/v1/namespaces/{s.owner_ns}/pods/{name}") == 200,
        timeout=90,
        what="the bank's engine pod",
    )
    target = _owner_pod(s)["spec"]["containers"][0]["name"]
    strategic = "application/strategic-merge-patch+json"
    path = f"/api/v1/namespaces/{s.owner_ns}/pods/{name}/ephemeralcontainers"
    status, body = s.plane.request("PATCH", path, _ephemeral_patch(target), content_type=strategic)
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)
    assert not _owner_pod(s)["spec"].get("ephemeralContainers")

    status, body = _post(s.plane, _probe_pod(s.thief_ns, "debuggable"))
    assert status == 201, body
    path = f"/api/v1/namespaces/{s.thief_ns}/pods/debuggable/ephemeralcontainers"
    status, body = s.plane.request("PATCH", path, _ephemeral_patch("c"), content_type=strategic)
    assert status == 200, body


@pytest.mark.parametrize(
    ("what", "spec"),
    [
        pytest.param("ordinary", {}, id="an-ordinary-pod"),
        pytest.param(
            "wildcard-kept-off",
            {"tolerations": [{"operator": "Exists"}], "affinity": _affinity("DoesNotExist")},
            id="a-wildcard-toleration-that-excludes-every-group",
        ),
        pytest.param(
            "not-in-the-group",
            {"affinity": _affinity("NotIn", GROUP)},
            id="an-affinity-that-avoids-the-group",
        ),
    ],
)
def test_pods_that_stay_off_the_groups_are_admitted(owner: Setup, what: str, spec: dict[str, Any]) -> None:
    """The policies must not break the cluster: pods that cannot reach a group pass them."""
    status, body = _post(owner.plane, _probe_pod(owner.thief_ns, f"fine-{what}", **spec), dry_run=True)
    assert status == 201, body


def test_the_exempt_namespace_keeps_its_node_agents(owner: Setup) -> None:
    """kube-system (dedicatedGpuGroups.exemptNamespaces) is left alone: node agents tolerate everything."""
    agent = _probe_pod("kube-system", "node-agent", tolerations=[{"operator": "Exists"}])
    status, body = _post(owner.plane, agent, dry_run=True)
    assert status == 201, body


def test_a_second_claimant_gets_a_condition_naming_the_owner_and_nothing_is_built(owner: Setup) -> None:
    """Attack: a Tenant in another namespace names the bank's group. It gets Ready=False with
    GpuGroupInUse naming the owner, no engine pool, no API key; its ModelDeployment's shared pool, whose
    wildcard toleration would match the group's taint, runs on the shared nodes only."""
    s, ns = owner, owner.thief_ns
    create(s.plane, _model_deployment(ns, tolerations=[{"operator": "Exists"}]))
    create(s.plane, _dedicated_tenant(ns, "thief"))
    for _ in range(3):
        _reconcile_as_operator(s, ns)
    ready = condition(tenant(s.plane, ns, "thief"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.GPU_GROUP_IN_USE), ready
    assert f"{s.owner_ns}/bank" in ready["message"] and GROUP in ready["message"]
    assert _status(s.plane, f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-dedicated-thief-engine") == 404
    assert _status(s.plane, f"/api/v1/namespaces/{ns}/secrets/thief-api-key") == 404
    assert (
        _status(s.plane, f"/apis/apps/v1/namespaces/{s.owner_ns}/statefulsets/{MD}-dedicated-bank-engine")
        == 200
    )

    shared = get(s.plane, f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine")["spec"]["template"][
        "spec"
    ]
    terms = shared["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": GROUP_KEY, "operator": "DoesNotExist"}]}
    ]
    shared_nodes = {n.name for n in s.plane.layout.shared_pool}
    placed = wait_for(
        lambda: _engine_pods(s.plane, ns).get(f"{MD}-engine-0"),
        timeout=90,
        what="the shared engine pod scheduled",
    )
    assert placed in shared_nodes

    # Watching every namespace (one cluster-wide list) finds the owner just the same.
    everywhere = replace(s.config, watch_namespaces=())
    admin = asyncio.run(_reconcile_with_admin(s, ns, everywhere))
    assert not [a for a in admin.applied if "dedicated-thief" in a]
    assert condition(tenant(s.plane, ns, "thief")).get("reason") == reasons.GPU_GROUP_IN_USE


#: A second group of the bank's, which a squatter names before the bank does.
SQUATTED = "bank-b200"


def test_a_group_a_squatter_named_first_goes_to_the_tenant_it_is_bound_to(owner: Setup) -> None:
    """Attack (the squat): a team names the bank's next group in a Tenant before the bank creates its own.
    Under the first-come rule the squatter owned the group and the bank was refused. The platform bound
    the group to the bank: the squatter gets GpuGroupInUse naming the binding and the chart value, nothing
    is built for it, and the bank gets its pool. A group bound to nobody builds nothing for anyone
    (GpuGroupNotBound, naming the entry to add)."""
    s = owner
    bound = {**s.config.gpu_group_owners, SQUATTED: GroupBinding(s.owner_ns, "bank-b")}
    config = replace(s.config, gpu_group_owners=bound)
    squatter = _dedicated_tenant(s.thief_ns, "squatter")
    squatter["spec"]["dedicated"]["gpuGroup"] = SQUATTED
    create(s.plane, squatter)
    created = tenant(s.plane, s.thief_ns, "squatter")["metadata"]["creationTimestamp"]
    _reconcile_as_operator(s, s.thief_ns, config)
    # Creation times have one-second resolution: the bank comes strictly later (first come would serve
    # the squatter).
    wait_for(lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) > created, timeout=5, what="1 s")
    bank_b = _dedicated_tenant(s.owner_ns, "bank-b")
    bank_b["spec"]["dedicated"]["gpuGroup"] = SQUATTED
    create(s.plane, bank_b)
    for _ in range(3):
        _reconcile_as_operator(s, s.thief_ns, config)
        _reconcile_as_operator(s, s.owner_ns, config)

    ready = condition(tenant(s.plane, s.thief_ns, "squatter"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.GPU_GROUP_IN_USE), ready
    assert f"Tenant {s.owner_ns}/bank-b" in ready["message"], ready["message"]
    assert "dedicatedGpuGroups.owners" in ready["message"], ready["message"]
    sts = "/apis/apps/v1/namespaces/{}/statefulsets/" + MD + "-dedicated-{}-engine"
    assert _status(s.plane, sts.format(s.thief_ns, "squatter")) == 404
    assert _status(s.plane, sts.format(s.owner_ns, "bank-b")) == 200
    bank_ready = condition(tenant(s.plane, s.owner_ns, "bank-b"))
    assert bank_ready.get("reason") not in {reasons.GPU_GROUP_IN_USE, reasons.GPU_GROUP_NOT_BOUND}, bank_ready

    loose = _dedicated_tenant(s.thief_ns, "loose")
    loose["spec"]["dedicated"]["gpuGroup"] = "nobodys-h100"
    create(s.plane, loose)
    _reconcile_as_operator(s, s.thief_ns, config)
    ready = condition(tenant(s.plane, s.thief_ns, "loose"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.GPU_GROUP_NOT_BOUND), ready
    assert f"dedicatedGpuGroups.owners.nobodys-h100={s.thief_ns}/loose" in ready["message"], ready
    assert _status(s.plane, sts.format(s.thief_ns, "loose")) == 404
    for namespace, name in ((s.thief_ns, "squatter"), (s.thief_ns, "loose"), (s.owner_ns, "bank-b")):
        path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants/{name}"
        assert s.plane.request("DELETE", path)[0] == 200


def test_an_upgrade_without_bindings_keeps_the_running_owner_and_says_what_to_set(owner: Setup) -> None:
    """Upgrade: the release before bindings let the oldest claimant own a group, and nobody has set
    dedicatedGpuGroups.owners yet. The bank's pool keeps running (same StatefulSet, nothing deleted), the
    bank is still served, and Degraded says which entry to add; the thief is still refused."""
    s = owner
    unbound = replace(s.config, gpu_group_owners={})
    path = f"/apis/apps/v1/namespaces/{s.owner_ns}/statefulsets/{MD}-dedicated-bank-engine"
    before = get(s.plane, path)["metadata"]["uid"]
    for _ in range(2):
        result = _reconcile_as_operator(s, s.owner_ns, unbound)
        assert not [d for d in result.deleted if "dedicated-bank" in d], result.deleted
    assert get(s.plane, path)["metadata"]["uid"] == before
    bank = tenant(s.plane, s.owner_ns, "bank")
    degraded = condition(bank, "Degraded")
    assert (degraded.get("status"), degraded.get("reason")) == ("True", reasons.GPU_GROUP_NOT_BOUND), degraded
    assert f"dedicatedGpuGroups.owners.{GROUP}={s.owner_ns}/bank" in degraded["message"], degraded
    assert condition(bank).get("status") != "False", condition(bank)
    _reconcile_as_operator(s, s.thief_ns, unbound)
    assert condition(tenant(s.plane, s.thief_ns, "thief")).get("reason") == reasons.GPU_GROUP_NOT_BOUND
    _reconcile_as_operator(s, s.owner_ns)  # bound again: the warning goes
    _reconcile_as_operator(s, s.thief_ns)
    assert condition(tenant(s.plane, s.owner_ns, "bank"), "Degraded").get("status") != "True"


async def _reconcile_with_admin(s: Setup, namespace: str, config: OperatorConfig) -> ReconcileResult:
    async with KubeClient(Credentials.from_kubeconfig(s.plane.kubeconfig)) as client:
        return await reconcile_model_deployment(client, config, namespace, MD)


def test_the_owner_keeps_the_group_until_deleted_and_its_volumes_go_with_it(owner: Setup) -> None:
    """The owner is stable: reconciling both again changes nothing. Once the bank is deleted its pool and
    its NVMe volumes are deleted (nothing of its KV stays). A refused claim does not wait for its turn: the
    group stays the bank's (it may come back) until the platform binds it to someone else."""
    s = owner
    _reconcile_as_operator(s, s.owner_ns)
    _reconcile_as_operator(s, s.thief_ns)
    assert condition(tenant(s.plane, s.thief_ns, "thief")).get("reason") == reasons.GPU_GROUP_IN_USE
    prefix = f"nvme-{MD}-dedicated-bank-engine-"

    def bank_claims() -> list[str]:
        items = get(s.plane, f"/api/v1/namespaces/{s.owner_ns}/persistentvolumeclaims")["items"]
        return [c["metadata"]["name"] for c in items if c["metadata"]["name"].startswith(prefix)]

    wait_for(bank_claims, timeout=60, what="the bank's NVMe volume claims")
    status, body = s.plane.request(
        "DELETE", f"/apis/kvfleet.io/v1alpha1/namespaces/{s.owner_ns}/tenants/bank"
    )
    assert status == 200, body
    sts = f"/apis/apps/v1/namespaces/{s.owner_ns}/statefulsets/{MD}-dedicated-bank-engine"
    wait_for(lambda: _status(s.plane, sts) == 404, timeout=120, what="the bank's engine pool deleted with it")
    wait_for(
        lambda: not bank_claims(), timeout=120, what="the bank's NVMe volume claims deleted with its pool"
    )

    path = f"/apis/apps/v1/namespaces/{s.thief_ns}/statefulsets/{MD}-dedicated-thief-engine"
    for _ in range(3):
        _reconcile_as_operator(s, s.thief_ns)
    assert condition(tenant(s.plane, s.thief_ns, "thief")).get("reason") == reasons.GPU_GROUP_IN_USE
    assert _status(s.plane, path) == 404

    rebound = replace(s.config, gpu_group_owners={GROUP: GroupBinding(s.thief_ns)})
    for _ in range(3):
        _reconcile_as_operator(s, s.thief_ns, rebound)
    assert condition(tenant(s.plane, s.thief_ns, "thief")).get("reason") != reasons.GPU_GROUP_IN_USE
    assert _status(s.plane, path) == 200
