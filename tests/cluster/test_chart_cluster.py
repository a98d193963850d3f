"""charts/kvfleet on the real control plane.

* the rendered manifests validate strictly against the API server's schemas (server-side dry run);
* bad values fail ``helm install`` with the schema's message;
* ``helm install --wait`` succeeds (kwok marks the operator pod Ready without running the image), then
  the operator runs here as a process **with the chart's ServiceAccount identity** (a TokenRequest
  token in its kubeconfig, the chart Deployment's arguments and environment), so the chart's RBAC is what
  lets it reconcile the examples;
* ``helm upgrade`` with changed values rolls the operator (a new ReplicaSet), and switching to all
  namespaces swaps the Roles for a ClusterRole (checked with SubjectAccessReviews);
* ``helm uninstall`` leaves no operator object behind; the CRDs stay (``crds.keep``).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import create_namespace, delete_namespace, wait_for
from devcluster import ControlPlane, find_binary
from test_operator_reconcile import (
    BANK_KEY,
    condition,
    create,
    get,
    load_example,
    provision_local_nvme,
    tenant,
)

from components import missing_component
from factories import free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
RELEASE = "kvfleet"
CRDS = ("modeldeployments.kvfleet.io", "tenants.kvfleet.io")
TENANTS = ("tenant-bank.yaml", "tenant-saas.yaml", "tenant-startup-a.yaml", "tenant-startup-b.yaml")


def permission_error(log: str) -> bool:
    """Whether an operator's log shows an API permission error: ``forbidden``, or 403 as a token of its own
    (the random suffixes of the tests' namespace names may contain the digits 403)."""
    return bool(re.search(r"(?<![\w-])403(?![\w-])", log)) or "forbidden" in log.lower()


def _tool(
    plane: ControlPlane, name: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    path = find_binary(name)
    if path is None:
        missing_component(name, "hack/build-cluster.sh")
    return subprocess.run(
        [str(path), *args],
        env=plane.env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def helm(plane: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return _tool(plane, "helm", *args)


def _adopt_crds(plane: ControlPlane, release_ns: str) -> None:
    """CRDs applied by other tests of the session become this release's (Helm's adoption metadata)."""
    for name in CRDS:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        if plane.request("GET", path)[0] != 200:
            continue
        patch = {
            "metadata": {
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": RELEASE,
                    "meta.helm.sh/release-namespace": release_ns,
                },
            }
        }
        status, body = plane.request("PATCH", path, patch, content_type="application/merge-patch+json")
        assert status == 200, body


def _can(
    plane: ControlPlane, user: str, verb: str, resource: str, namespace: str, group: str = "", name: str = ""
) -> bool:
    attributes = {"verb": verb, "resource": resource, "namespace": namespace, "group": group, "name": name}
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "resourceAttributes": attributes,
        },
    }
    status, body = plane.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    assert status == 201, body
    return bool(body["status"]["allowed"])


def _deployment(plane: ControlPlane, ns: str) -> dict[str, Any]:
    return get(plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}")


def _replicasets(plane: ControlPlane, ns: str) -> set[str]:
    items = get(
        plane, f"/apis/apps/v1/namespaces/{ns}/replicasets?labelSelector=app.kubernetes.io/instance={RELEASE}"
    )
    return {rs["metadata"]["name"] for rs in items["items"]}


class ChartOperator:
    """``kvfleet operator`` run here with the arguments and environment of the chart's Deployment."""

    def __init__(self, plane: ControlPlane, deployment: dict[str, Any], kubeconfig: Path, log: Path) -> None:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = [
            a for a in container["args"] if not a.startswith(("--metrics-port=", "--probe-address="))
        ]  # the chart's ports may be taken here; the rest is the chart's
        self.args = [*args, "--metrics-port=0", f"--probe-address=127.0.0.1:{free_port()}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env |= {e["name"]: e["value"] for e in container["env"] if "value" in e}  # not the downward API's
        env |= {"KUBECONFIG": str(kubeconfig), "KVFLEET_RESYNC_SECONDS": "5"}
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet_runtime", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@dataclass
class Installed:
    release_ns: str
    workload_ns: str
    other_ns: str
    tmp: Path


@pytest.fixture(scope="module")
def installed(full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The chart installed with ``--wait``, watching one namespace (Roles, not a ClusterRole)."""
    if find_binary("helm") is None:
        missing_component("helm", "hack/build-cluster.sh")
    release_ns = create_namespace(full_cluster, "kvfleet-system")
    workload_ns = create_namespace(
        full_cluster, "llm", labels={"pod-security.kubernetes.io/enforce": "restricted"}
    )
    other_ns = create_namespace(full_cluster, "other")
    _adopt_crds(full_cluster, release_ns)
    done = helm(
        full_cluster, "install", RELEASE, str(CHART), "-n", release_ns, "--wait", "--timeout", "180s",
        "--set", f"operator.watchNamespaces={{{workload_ns}}}",
        # The platform binds the example bank's GPU group to it (a group nobody bound builds no pool).
        "--set", f"dedicatedGpuGroups.owners.bank-h200={workload_ns}/bank",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "examples/modeldeployment-qwen72b.yaml" in done.stdout  # NOTES
    try:
        yield Installed(release_ns, workload_ns, other_ns, tmp_path_factory.mktemp("chart"))
    finally:
        helm(full_cluster, "uninstall", RELEASE, "-n", release_ns, "--wait", "--timeout", "120s")
        for ns in (workload_ns, other_ns, release_ns):
            delete_namespace(full_cluster, ns)


def test_rendered_manifests_validate_strictly_on_the_server(full_cluster: ControlPlane) -> None:
    ns = create_namespace(full_cluster, "render")
    try:
        for extra in ((), ("--set", f"operator.watchNamespaces={{{ns}}}")):
            done = helm(full_cluster, "template", "kvfleet-check", str(CHART), "-n", ns, *extra)
            assert done.returncode == 0, done.stderr
            docs = [d for d in yaml.safe_load_all(done.stdout) if d]
            assert len(docs) >= 10
            applied = _tool(
                full_cluster, "kubectl", "apply", "--server-side", "--dry-run=server", "--validate=strict",
                "--force-conflicts", "--field-manager=kvfleet-chart-check", "-n", ns, "-f", "-",
                stdin=done.stdout,
            )  # fmt: skip
            assert applied.returncode == 0, applied.stderr
            assert applied.stdout.count("(server dry run)") == len(docs), applied.stdout
    finally:
        delete_namespace(full_cluster, ns)


def test_strict_validation_catches_a_typo(full_cluster: ControlPlane) -> None:
    """The check above can fail: a misspelt field in a manifest is rejected by the server."""
    bad = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "typo", "namespace": "default", "lables": {"a": "b"}},
    }
    done = _tool(
        full_cluster, "kubectl", "apply", "--server-side", "--dry-run=server", "--validate=strict", "-f", "-",
        stdin=yaml.safe_dump(bad),
    )  # fmt: skip
    assert done.returncode != 0 and "lables" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "operator.replica=1"), "additional properties 'replica' not allowed"),
        (("--set-string", "operator.replicas=1"), "got string, want integer"),
        (("--set", "operator.replicas=-1"), "minimum: got -1, want 0"),
    ],
    ids=["typo", "wrong-type", "negative-replicas"],
)
def test_bad_values_fail_helm_install_with_the_schema_message(
    full_cluster: ControlPlane, args: tuple[str, ...], message: str
) -> None:
    done = helm(full_cluster, "install", "kvfleet-bad", str(CHART), "-n", "default", *args)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr
    assert helm(full_cluster, "status", "kvfleet-bad", "-n", "default").returncode != 0


def test_install_wait_and_the_operator_reconciles_the_examples_with_the_charts_identity(
    full_cluster: ControlPlane, installed: Installed
) -> None:
    plane, ns = full_cluster, installed.workload_ns
    deployment = _deployment(plane, installed.release_ns)
    assert deployment["status"]["readyReplicas"] == 2  # one leader, one standby (the chart's default)
    for crd in CRDS:
        got = get(plane, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        assert got["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    provision_local_nvme(plane, ns)
    create(
        plane,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "bank-api-key", "namespace": ns, "labels": {"kvfleet.io/tenant": "bank"}},
            "data": {"api-key": base64.b64encode(BANK_KEY.encode()).decode()},
        },
    )
    create(plane, load_example("modeldeployment-qwen72b.yaml", ns))
    for name in TENANTS:
        create(plane, load_example(name, ns))

    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = plane.service_account_kubeconfig(installed.release_ns, sa, installed.tmp / "sa.kubeconfig")
    operator = ChartOperator(plane, deployment, kubeconfig, installed.tmp / "operator.log")
    assert f"--namespace={ns}" in operator.args
    try:

        def all_ready() -> bool:
            assert operator.proc.poll() is None, installed.tmp.joinpath("operator.log").read_text()[-4000:]
            return all(
                condition(tenant(plane, ns, name.removeprefix("tenant-").removesuffix(".yaml"))).get("status")
                == "True"
                for name in TENANTS
            )

        wait_for(
            all_ready, timeout=180, interval=2, what="every example tenant Ready through the chart's operator"
        )
        md = get(plane, f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/modeldeployments/qwen72b")
        assert condition(md)["status"] == "True"
        assert "kvfleet.io/finalizer" in md["metadata"].get("finalizers", [])
        # kopf's standalone mode and the chart's RBAC: no permission error anywhere in the log.
        log = installed.tmp.joinpath("operator.log").read_text()
        assert not permission_error(log), log[-4000:]
    finally:
        operator.stop()


def test_rbac_is_scoped_to_the_watched_namespace(full_cluster: ControlPlane, installed: Installed) -> None:
    user = f"system:serviceaccount:{installed.release_ns}:{RELEASE}"
    ns, other = installed.workload_ns, installed.other_ns
    assert _can(full_cluster, user, "list", "secrets", ns)
    assert _can(full_cluster, user, "patch", "statefulsets", ns, "apps")
    assert _can(full_cluster, user, "patch", "modeldeployments", ns, "kvfleet.io")
    assert not _can(full_cluster, user, "list", "secrets", other)
    assert not _can(full_cluster, user, "get", "pods", ns)
    assert not _can(full_cluster, user, "delete", "modeldeployments", ns, "kvfleet.io")
    assert not _can(full_cluster, user, "escalate", "roles", ns, "rbac.authorization.k8s.io")
    # In its own namespace: the salt master Secret only.
    rel = installed.release_ns
    assert _can(full_cluster, user, "get", "secrets", rel, name=f"{RELEASE}-salt-master")
    assert not _can(full_cluster, user, "get", "secrets", rel, name="someone-elses")
    assert not _can(full_cluster, user, "list", "secrets", rel)


def _upgrade(
    plane: ControlPlane, namespace: str, *sets: str, flag: str = "--set"
) -> subprocess.CompletedProcess[str]:
    flags = [arg for value in sets for arg in (flag, value)]
    return helm(
        plane,
        "upgrade",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--wait",
        "--timeout",
        "180s",
        "--reuse-values",
        *flags,
    )


def test_upgrade_with_changed_values_rolls_the_operator(
    full_cluster: ControlPlane, installed: Installed
) -> None:
    rel = installed.release_ns
    before_rs = _replicasets(full_cluster, rel)
    before_gen = _deployment(full_cluster, rel)["metadata"]["generation"]
    done = _upgrade(full_cluster, rel, "operator.resyncSeconds=10", "operator.podAnnotations.rollout=second")
    assert done.returncode == 0, done.stderr
    deployment = _deployment(full_cluster, rel)
    assert deployment["metadata"]["generation"] > before_gen
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["KVFLEET_RESYNC_SECONDS"] == "10"
    new_rs = wait_for(lambda: _replicasets(full_cluster, rel) - before_rs, what="a new ReplicaSet")
    assert len(new_rs) == 1
    wait_for(
        lambda: _deployment(full_cluster, rel)["status"].get("updatedReplicas") == 2,
        what="the new operator pods rolled out",
    )

    # Switching to every namespace: the Roles go, a ClusterRole (with cluster-wide Secrets) comes.
    user = f"system:serviceaccount:{rel}:{RELEASE}"
    done = _upgrade(
        full_cluster,
        rel,
        "operator.watchNamespaces=[]",
        "operator.watchAllNamespaces=true",
        flag="--set-json",
    )
    assert done.returncode == 0, done.stderr
    args = _deployment(full_cluster, rel)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args
    assert (
        full_cluster.request(
            "GET", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{installed.workload_ns}/roles/{RELEASE}"
        )[0]
        == 404
    )
    assert _can(full_cluster, user, "list", "secrets", installed.other_ns)
    assert not _can(full_cluster, user, "get", "pods", installed.other_ns)


def test_uninstall_leaves_no_operator_objects_and_keeps_the_crds(
    full_cluster: ControlPlane, installed: Installed
) -> None:
    rel = installed.release_ns
    done = helm(full_cluster, "uninstall", RELEASE, "-n", rel, "--wait", "--timeout", "120s")
    assert done.returncode == 0, done.stderr
    selector = f"labelSelector=app.kubernetes.io/instance={RELEASE}"
    leftovers = {
        "deployments": f"/apis/apps/v1/namespaces/{rel}/deployments?{selector}",
        "replicasets": f"/apis/apps/v1/namespaces/{rel}/replicasets?{selector}",
        "pods": f"/api/v1/namespaces/{rel}/pods?{selector}",
        "services": f"/api/v1/namespaces/{rel}/services?{selector}",
        "configmaps": f"/api/v1/namespaces/{rel}/configmaps?{selector}",
        "serviceaccounts": f"/api/v1/namespaces/{rel}/serviceaccounts?{selector}",
        "roles": f"/apis/rbac.authorization.k8s.io/v1/roles?{selector}",
        "rolebindings": f"/apis/rbac.authorization.k8s.io/v1/rolebindings?{selector}",
        "clusterroles": f"/apis/rbac.authorization.k8s.io/v1/clusterroles?{selector}",
        "clusterrolebindings": f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings?{selector}",
        "release secrets": f"/api/v1/namespaces/{rel}/secrets?labelSelector=owner=helm",
    }
    for what, path in leftovers.items():
        wait_for(lambda path=path: not full_cluster.request("GET", path)[1]["items"], what=f"no {what} left")
    for crd in CRDS:
        status, _ = full_cluster.request(
            "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
        )
        assert status == 200, f"CRD {crd} was deleted by the uninstall"
