"""Operator HA on the real control plane, proven from the API server's own audit log.

Two ``kvfleet operator`` replicas (real processes, each with its own identity and User-Agent, both
authenticated as the operator's ServiceAccount) share one Lease. The operator's writes are counted by
user, the ServiceAccount; the User-Agent tells the two replicas apart. What the audit log must show:

* a standby writes nothing at all, not even its own Lease while another replica holds it;
* a converged operator's resyncs write nothing but their Lease renewals (kopf's patches included);
* across a fail-over (kill -9) and a hand-over (SIGTERM), the writes of the two replicas never
  interleave: every write of the old leader comes before the first write of the new one;
* a leader that loses its Lease stops at once, with no write after it was lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from audit import AuditLog, Write, by_operator, count_by, terms
from cluster_helpers import delete_namespace, wait_for
from devcluster import ControlPlane
from operators import (
    OperatorReplica,
    holder,
    lease,
    leftover_mutations,
    operator_user,
    prepare_namespace,
    tenants_ready,
    wait_holder,
)
from test_operator_reconcile import create, load_example

from kvfleet_operator.k8s.leader import LOST_EXIT_CODE

#: Fail-over budget in this test (the benchmark measures it: benchmarks/operator_failover.py). The Lease
#: lasts 8 s; the new leader then starts kopf and reconciles. Generous for a loaded 2-core machine.
FAILOVER_BUDGET_S = 25.0


@dataclass
class Scene:
    plane: ControlPlane
    namespace: str
    a: OperatorReplica
    b: OperatorReplica
    audit: AuditLog


@pytest.fixture(scope="module")
def scene(full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    namespace = prepare_namespace(full_cluster, "ha")
    logs: Path = tmp_path_factory.mktemp("ha")
    a = OperatorReplica(full_cluster, namespace, "kvfleet-a", logs)
    b = OperatorReplica(full_cluster, namespace, "kvfleet-b", logs)
    audit = AuditLog(full_cluster.audit_log)
    a.start()
    wait_holder(full_cluster, namespace, {"kvfleet-a"})
    wait_for(lambda: tenants_ready(full_cluster, namespace), timeout=120, interval=1, what="tenants Ready")
    try:
        yield Scene(full_cluster, namespace, a, b, audit)
    finally:
        for replica in (a, b):
            replica.kill()
        delete_namespace(full_cluster, namespace)


def _operator_writes(scene: Scene) -> list[Write]:
    """The writes of the operator's ServiceAccount in the scene's namespace. Also checked: every write whose
    User-Agent names a replica came from that user, so counting by user misses none (kopf's included)."""
    writes = scene.audit.writes()
    mine = by_operator(writes, scene.namespace, user=operator_user(scene.namespace))
    named = [w for w in writes if w.identity is not None and w.namespace == scene.namespace]
    assert mine == named, "\n".join(w.describe() + f" as {w.user}" for w in set(mine) ^ set(named))
    return mine


def _assert_no_interleaving(writes: list[Write], old: str, new: str) -> None:
    """All of ``old``'s writes come before the first of ``new``'s: one term after the other."""
    runs = [(who, len(run)) for who, run in terms(w for w in writes if w.identity in (old, new))]
    assert [who for who, _ in runs] in ([old, new], [new], [old]), (
        f"writes of {old} and {new} interleave: {runs}\n" + "\n".join(w.describe() for w in writes[-40:])
    )


def test_a_converged_resync_writes_nothing_but_its_lease(scene: Scene) -> None:
    """Two resync periods (5 s each) of a converged operator, and a standby beside it: the audit log holds
    no write of either but the leader's Lease renewals (kopf's own annotation and status patches would be
    there too: there are none)."""
    wait_for(lambda: leftover_mutations(scene.plane, scene.namespace) == 0, timeout=60, what="converged")
    scene.b.start()
    time.sleep(3)  # the standby's start-up, then looks at the Lease
    scene.audit.mark()
    time.sleep(12)
    writes = _operator_writes(scene)
    work = [w for w in writes if not w.is_lease]
    assert not work, "a converged resync wrote:\n" + "\n".join(w.describe() for w in work)
    renewals = [w for w in writes if w.is_lease]
    assert {w.identity for w in renewals} == {"kvfleet-a"}, count_by(renewals, "user_agent")
    assert 6 <= len(renewals) <= 14, len(renewals)  # one per second (retry period 1 s) over 12 s
    assert all(w.verb == "update" and w.succeeded for w in renewals)
    assert holder(scene.plane, scene.namespace) == "kvfleet-a"


def test_kill_9_of_the_leader_fails_over_and_the_terms_never_interleave(scene: Scene) -> None:
    assert scene.b.running(), "the standby of the previous test"
    transitions = int((lease(scene.plane, scene.namespace) or {})["spec"].get("leaseTransitions") or 0)
    scene.audit.mark()
    scene.a.kill()
    killed = time.monotonic()
    doc = load_example("tenant-startup-a.yaml", scene.namespace)
    doc["metadata"]["name"] = "after-failover"
    create(scene.plane, doc)
    wait_for(
        lambda: tenants_ready(scene.plane, scene.namespace, ("after-failover",)),
        timeout=FAILOVER_BUDGET_S + 20,
        interval=0.2,
        what="the new tenant Ready through the standby",
    )
    took = time.monotonic() - killed
    assert holder(scene.plane, scene.namespace) == "kvfleet-b"
    assert took <= FAILOVER_BUDGET_S, took
    new = lease(scene.plane, scene.namespace) or {}
    assert int(new["spec"]["leaseTransitions"]) == transitions + 1
    writes = _operator_writes(scene)
    assert {w.identity for w in writes if not w.is_lease} == {"kvfleet-b"}  # the dead leader wrote nothing
    _assert_no_interleaving(writes, "kvfleet-a", "kvfleet-b")
    assert leftover_mutations(scene.plane, scene.namespace) == 0


def test_sigterm_hands_over_at_once(scene: Scene) -> None:
    """SIGTERM (what the kubelet sends): kopf stops, the Lease is released, and the standby leads at its
    next look (1 s), without waiting for the Lease to expire (8 s)."""
    assert holder(scene.plane, scene.namespace) == "kvfleet-b"
    scene.a.start()  # the killed replica, back as a standby
    wait_for(lambda: scene.a.role() == "standby", timeout=60, what="kvfleet-a standing by")
    time.sleep(2)  # it has looked at the Lease
    assert holder(scene.plane, scene.namespace) == "kvfleet-b"
    scene.audit.mark()
    asked = time.monotonic()
    assert scene.b.terminate(timeout=30) == 0, scene.b.log()[-3000:]
    exited = time.monotonic()
    wait_holder(scene.plane, scene.namespace, {"kvfleet-a"}, timeout=10)
    # The old leader renews until kopf has stopped (kopf waits up to 5 s for its leftover tasks), then
    # releases and exits; the standby leads at its next look (1 s), not 8 s after the last renewal.
    handed = time.monotonic() - exited
    assert handed < 2.5, (handed, exited - asked)
    assert "released" in scene.b.log()
    writes = _operator_writes(scene)
    released = [w for w in writes if w.is_lease and w.identity == "kvfleet-b"]
    assert released and released[-1].verb == "update"  # the release
    _assert_no_interleaving(writes, "kvfleet-b", "kvfleet-a")
    # The new leader works: a change is reconciled.
    doc = load_example("tenant-startup-a.yaml", scene.namespace)
    doc["metadata"]["name"] = "after-handover"
    create(scene.plane, doc)
    wait_for(
        lambda: tenants_ready(scene.plane, scene.namespace, ("after-handover",)),
        timeout=30,
        interval=0.2,
        what="the new tenant Ready through the new leader",
    )


def test_a_leader_that_loses_its_lease_stops_writing_at_once(scene: Scene) -> None:
    """Someone else takes the Lease (here the test, as the admin): the leader's next renewal conflicts, and
    it exits with LOST_EXIT_CODE without one more write."""
    assert holder(scene.plane, scene.namespace) == "kvfleet-a"
    path = f"/apis/coordination.k8s.io/v1/namespaces/{scene.namespace}/leases/kvfleet-leader"
    scene.audit.mark()
    for _ in range(10):  # the leader renews every second: a renewal between our read and write conflicts
        current = lease(scene.plane, scene.namespace) or {}
        current["spec"]["holderIdentity"] = "someone-else"
        status, body = scene.plane.request("PUT", path, current)
        if status != 409:
            break
    assert status == 200, body
    assert scene.a.wait_exit(timeout=10) == LOST_EXIT_CODE, scene.a.log()[-3000:]
    logged = scene.audit.writes()
    stolen = next(
        i
        for i, w in enumerate(logged)
        if w.is_lease and w.user != operator_user(scene.namespace) and w.succeeded
    )
    user = operator_user(scene.namespace)
    after = [
        w for w in by_operator(logged[stolen + 1 :], scene.namespace, user=user) if w.identity == "kvfleet-a"
    ]
    # At most the renewal that found the Lease changed (refused with 409), nothing else.
    assert all(w.is_lease and w.code == 409 for w in after), [w.describe() for w in after]
    assert "leadership lost" in scene.a.log()


def test_without_leader_election_it_reconciles_and_makes_no_lease(
    full_cluster: ControlPlane, tmp_path: Path
) -> None:
    """``--no-leader-election`` (one replica, e.g. a local run): kopf starts at once, the tenants become
    Ready, and no Lease exists or is ever written; the probe says it leads."""
    namespace = prepare_namespace(full_cluster, "nolease")
    audit = AuditLog(full_cluster.audit_log)
    alone = OperatorReplica(full_cluster, namespace, "kvfleet-alone", tmp_path, leader_election=False)
    try:
        alone.start()
        wait_for(
            lambda: tenants_ready(full_cluster, namespace), timeout=120, interval=1, what="tenants Ready"
        )
        assert alone.role() == "leader"
        writes = by_operator(audit.writes(), namespace, user=operator_user(namespace))
        assert writes and not [w for w in writes if w.is_lease], [w.describe() for w in writes if w.is_lease]
        status, body = full_cluster.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        )
        assert status == 200 and body["items"] == [], body
        assert "leader election" not in alone.log()
        assert alone.running(), alone.log()[-3000:]
    finally:
        alone.kill()
        delete_namespace(full_cluster, namespace)
