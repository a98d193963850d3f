"""helm against the real control plane: ``install --wait`` succeeds, ``uninstall`` leaves nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cluster_helpers import create_namespace, delete_namespace, wait_for
from devcluster import ControlPlane, find_binary

from components import missing_component

CHART = Path(__file__).parent / "charts" / "trivial"


def _helm(plane: ControlPlane, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    helm = find_binary("helm")
    assert helm is not None
    return subprocess.run(
        [str(helm), *args], env=plane.env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def test_helm_install_wait_then_uninstall_leaves_nothing_behind(full_cluster: ControlPlane) -> None:
    if find_binary("helm") is None:
        missing_component("helm", "hack/build-cluster.sh")
    ns = create_namespace(full_cluster, "helm")
    release = "trivial"
    try:
        done = _helm(full_cluster, "install", release, str(CHART), "-n", ns, "--wait", "--timeout", "150s")
        assert done.returncode == 0, done.stderr
        status = json.loads(_helm(full_cluster, "status", release, "-n", ns, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed"
        code, deployment = full_cluster.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release}")
        assert code == 200 and deployment["status"]["readyReplicas"] == 1
        code, cm = full_cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{release}-config")
        assert code == 200 and cm["data"]["message"] == "hello from the trivial chart"

        done = _helm(full_cluster, "uninstall", release, "-n", ns, "--wait", "--timeout", "150s")
        assert done.returncode == 0, done.stderr
        selector = f"app.kubernetes.io/instance={release}"
        leftovers = {
            "configmaps": f"/api/v1/namespaces/{ns}/configmaps?labelSelector={selector}",
            "services": f"/api/v1/namespaces/{ns}/services?labelSelector={selector}",
            "deployments": f"/apis/apps/v1/namespaces/{ns}/deployments?labelSelector={selector}",
            "replicasets": f"/apis/apps/v1/namespaces/{ns}/replicasets?labelSelector={selector}",
            "pods": f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}",
            "release secrets": f"/api/v1/namespaces/{ns}/secrets?labelSelector=owner=helm",
        }
        for what, path in leftovers.items():
            wait_for(lambda path=path: not full_cluster.request("GET", path)[1]["items"], what=f"no {what}")
        listed = json.loads(_helm(full_cluster, "list", "-n", ns, "-a", "-o", "json").stdout)
        assert listed == []
    finally:
        delete_namespace(full_cluster, ns, wait=True)
