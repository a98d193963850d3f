"""The operator killed at chosen points of a reconcile (``KVFLEET_FAULT_POINT``, handlers/faults.py), on the
real control plane: it dies exactly there (exit status 86, and the state it left proves where), then a
fresh operator (another replica: it waits for the dead one's Lease to expire) converges everything, with
no orphan, no duplicate, no stuck finalizer; converged is proven twice: one more reconcile plans no write,
and the API server's audit log holds no write of the operator's ServiceAccount but its Lease over two
resync periods of the fresh replica. The random kills are in test_operator_process.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster_helpers import wait_for
from devcluster import ControlPlane
from operators import (
    EXAMPLE_TENANTS,
    EXPECTED_CHILDREN,
    OperatorReplica,
    assert_audited_quiet,
    leftover_mutations,
    prepared_namespace,
    tenants_ready,
)
from test_operator_reconcile import condition, get, owned_children, tenant

from kvfleet_operator.handlers.faults import FAULT_ENV, FAULT_EXIT_CODE, FAULT_POINTS

API = "/apis/kvfleet.io/v1alpha1"


Replicas = Callable[[str], OperatorReplica]


@pytest.fixture
def namespace(full_cluster: ControlPlane) -> Iterator[str]:
    with prepared_namespace(full_cluster, "fault") as ns:
        yield ns


@pytest.fixture
def replica(full_cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Replicas]:
    """``replica(identity)``: an operator replica in the test's namespace, killed after the test."""
    made: list[OperatorReplica] = []

    def make(identity: str) -> OperatorReplica:
        made.append(OperatorReplica(full_cluster, namespace, identity, tmp_path))
        return made[-1]

    yield make
    for each in made:
        each.kill()


def _assert_died_at(replica: OperatorReplica, point: str, timeout: float = 90) -> None:
    code = replica.wait_exit(timeout=timeout)
    assert code == FAULT_EXIT_CODE, replica.log()[-3000:]
    assert f"fault point {point} reached" in replica.log()


def _key_secrets(plane: ControlPlane, namespace: str) -> dict[str, dict[str, str]]:
    """Secret name -> data of the Secrets labelled as tenants' keys."""
    items = get(plane, f"/api/v1/namespaces/{namespace}/secrets?labelSelector=kvfleet.io/tenant")["items"]
    return {s["metadata"]["name"]: s.get("data") or {} for s in items}


def _converge_with_a_fresh_operator(plane: ControlPlane, namespace: str, replica: Replicas) -> None:
    fresh = replica("fresh")
    fresh.start()
    wait_for(lambda: tenants_ready(plane, namespace), timeout=90, interval=0.5, what="tenants Ready")
    assert len(owned_children(plane, namespace, "qwen72b")) == EXPECTED_CHILDREN  # nothing extra
    keys = _key_secrets(plane, namespace)
    assert len(keys) == len(EXAMPLE_TENANTS), sorted(keys)  # one generated key per tenant, no duplicate
    wait_for(lambda: leftover_mutations(plane, namespace) == 0, timeout=30, what="nothing left to do")
    assert_audited_quiet(plane, fresh)


def test_the_fault_points_are_the_ones_tested() -> None:
    tested = {"after-children-before-status", "between-key-secrets", "before-finalizer-removal"}
    assert set(FAULT_POINTS) == tested


def test_killed_after_the_children_before_any_status(
    full_cluster: ControlPlane, namespace: str, replica: Replicas
) -> None:
    doomed = replica("doomed")
    doomed.start(env={FAULT_ENV: "after-children-before-status"})
    _assert_died_at(doomed, "after-children-before-status")
    assert len(owned_children(full_cluster, namespace, "qwen72b")) == EXPECTED_CHILDREN
    assert all(not condition(tenant(full_cluster, namespace, n)) for n in EXAMPLE_TENANTS)  # no status yet
    _converge_with_a_fresh_operator(full_cluster, namespace, replica)


def test_killed_between_two_tenants_key_secrets(
    full_cluster: ControlPlane, namespace: str, replica: Replicas
) -> None:
    doomed = replica("doomed")
    doomed.start(env={FAULT_ENV: "between-key-secrets"})
    _assert_died_at(doomed, "between-key-secrets")
    first = _key_secrets(full_cluster, namespace)
    assert len(first) == 1, sorted(first)  # one key Secret made, the next not yet
    assert not owned_children(full_cluster, namespace, "qwen72b")  # children come after the keys
    _converge_with_a_fresh_operator(full_cluster, namespace, replica)
    after = _key_secrets(full_cluster, namespace)
    ((name, data),) = first.items()
    assert after[name] == data  # the key handed out before the crash is kept, never regenerated


def test_killed_before_the_finalizer_is_removed(
    full_cluster: ControlPlane, namespace: str, replica: Replicas
) -> None:
    doomed = replica("doomed")
    doomed.start(env={FAULT_ENV: "before-finalizer-removal"})
    wait_for(lambda: tenants_ready(full_cluster, namespace), timeout=90, interval=0.5, what="tenants Ready")
    assert doomed.running()
    for name in EXAMPLE_TENANTS:
        status, body = full_cluster.request("DELETE", f"{API}/namespaces/{namespace}/tenants/{name}")
        assert status == 200, body
    md_path = f"{API}/namespaces/{namespace}/modeldeployments/qwen72b"
    status, body = full_cluster.request("DELETE", md_path)
    assert status == 200, body
    _assert_died_at(doomed, "before-finalizer-removal")
    held = get(full_cluster, md_path)
    assert (
        held["metadata"].get("deletionTimestamp") and "kvfleet.io/finalizer" in held["metadata"]["finalizers"]
    )
    replica("fresh").start()
    wait_for(
        lambda: full_cluster.request("GET", md_path)[0] == 404,
        timeout=60,
        interval=0.5,
        what="the ModelDeployment gone (no stuck finalizer)",
    )
    # Its children and the tenants' generated keys go with their owners (garbage collector): no orphan.
    wait_for(
        lambda: (
            not owned_children(full_cluster, namespace, "qwen72b")
            and not _key_secrets(full_cluster, namespace)
        ),
        timeout=60,
        interval=0.5,
        what="no orphaned child or key Secret",
    )


def test_an_unknown_fault_point_stops_the_start(replica: Replicas) -> None:
    """A typo in the variable must not silently run an operator that never crashes where asked."""
    typo = replica("typo")
    typo.start(env={FAULT_ENV: "after-chidlren"})
    assert typo.wait_exit(timeout=60) not in (0, FAULT_EXIT_CODE)
    assert "is not one of" in typo.log()
