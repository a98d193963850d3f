"""The local control plane's command lines (hack/devcluster/cluster.py) for a lost-node test: the session's
plane keeps its long grace period and kwok's Lease; a plane asked for a short grace period renews its fake
nodes' Leases often enough to keep healthy nodes Ready; pods are evicted from a tainted node as in any
cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from devcluster.cluster import (
    CONTROLLERS,
    NODE_MONITOR_GRACE_PERIOD_S,
    build_controller_manager_args,
    build_kwok_args,
    kwok_node_lease_seconds,
)
from devcluster.pki import Pki

PKI = Pki(
    *(Path(f"/pki/{n}") for n in ("ca.crt", "ca.key", "s.crt", "s.key", "a.crt", "a.key", "sa.key", "sa.pub"))
)


def _flag(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)


def test_the_session_plane_keeps_its_long_grace_period_and_kwoks_lease() -> None:
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1)
    assert _flag(kcm, "node-monitor-grace-period") == f"{NODE_MONITOR_GRACE_PERIOD_S}s" == "900s"
    assert kwok_node_lease_seconds(NODE_MONITOR_GRACE_PERIOD_S) is None
    kwok = build_kwok_args(Path("kwok"), Path("kubeconfig"), 2, [])
    assert _flag(kwok, "node-lease-duration-seconds") is None
    assert _flag(kwok, "manage-nodes-with-annotation-selector") == "kwok.x-k8s.io/node=fake"


@pytest.mark.parametrize(("grace", "lease"), [(20, 5), (12, 4), (60, 15)])
def test_a_short_grace_period_gets_leases_renewed_well_within_it(grace: int, lease: int) -> None:
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1, grace)
    assert _flag(kcm, "node-monitor-grace-period") == f"{grace}s"
    assert kwok_node_lease_seconds(grace) == lease
    # kwok renews at a quarter of the Lease: eight renewals or more fit in the grace period, so a few late
    # ones on a loaded machine do not make a healthy node NotReady.
    assert lease / 4 <= grace / 8
    kwok = build_kwok_args(Path("kwok"), Path("kubeconfig"), 2, [], "lost", node_lease_s=lease)
    assert _flag(kwok, "node-lease-duration-seconds") == str(lease)
    assert _flag(kwok, "manage-nodes-with-annotation-selector") == "kwok.x-k8s.io/node=lost"


def test_the_taint_eviction_controller_runs() -> None:
    """Since Kubernetes 1.29 the node lifecycle controller only taints; without this controller nothing
    evicts a pod from a lost node (a pod's tolerationSeconds would mean nothing)."""
    assert {"node-lifecycle-controller", "taint-eviction-controller"} <= set(CONTROLLERS)
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1)
    assert "taint-eviction-controller" in (_flag(kcm, "controllers") or "").split(",")
