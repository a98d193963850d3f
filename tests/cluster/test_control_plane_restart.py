"""The API server and etcd die while the operator reconciles, and come back: the operator recovers and
converges.

A Tenant is created and, at once, etcd and kube-apiserver are killed (kill -9) for longer than the
leader's renew deadline. The leader cannot renew its Lease, so its watchdog ends it (exit status 3); the
"kubelet" here restarts it, as Kubernetes would, and it waits as a standby until the API server answers
again. Then it takes its own Lease back (same pod, same identity), and everything converges: the new
Tenant is admitted and Ready, one more reconcile has nothing left to do, and the API server's audit log
holds no write of the operator's ServiceAccount but its Lease over two resync periods.

The test restarts the session's own control plane in place (same ports, same etcd data), so it runs last
in its module and leaves the plane as it found it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import wait_for
from devcluster import ControlPlane
from devcluster.processes import ManagedProcess, start_process
from operators import (
    EXAMPLE_TENANTS,
    Kubelet,
    OperatorReplica,
    assert_audited_quiet,
    holder,
    leftover_mutations,
    prepared_namespace,
    tenants_ready,
)
from test_operator_reconcile import create, load_example

from kvfleet_operator.k8s.leader import LOST_EXIT_CODE

OUTAGE_S = 10.0  # longer than the renew deadline (5 s): the leader must give up its term


def _kill(process: ManagedProcess) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.popen is not None:
        process.popen.wait(timeout=10)


def _restart(plane: ControlPlane, name: str) -> None:
    """Start ``name`` again with its own command line, in the plane's process list (stopped with it)."""
    index = next(i for i, p in enumerate(plane.processes) if p.name == name)
    old = plane.processes[index]
    plane.processes[index] = start_process(name, old.argv, plane.workdir / "logs")


@pytest.fixture
def namespace(full_cluster: ControlPlane) -> Iterator[str]:
    with prepared_namespace(full_cluster, "outage") as ns:
        yield ns


def test_the_operator_recovers_when_the_api_server_and_etcd_restart_mid_reconcile(
    full_cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    replica = OperatorReplica(full_cluster, namespace, "kvfleet-0", tmp_path)
    with Kubelet(replica) as kubelet:
        wait_for(
            lambda: tenants_ready(full_cluster, namespace), timeout=120, interval=0.5, what="tenants Ready"
        )
        doc = load_example("tenant-startup-a.yaml", namespace)
        doc["metadata"]["name"] = "during-outage"
        create(full_cluster, doc)
        processes = {p.name: p for p in full_cluster.processes}
        _kill(processes["kube-apiserver"])
        _kill(processes["etcd"])
        time.sleep(OUTAGE_S)
        assert not full_cluster.is_ready()
        _restart(full_cluster, "etcd")
        _restart(full_cluster, "kube-apiserver")
        wait_for(full_cluster.is_ready, timeout=120, interval=0.5, what="the API server back")
        wait_for(
            lambda: tenants_ready(full_cluster, namespace, (*EXAMPLE_TENANTS, "during-outage")),
            timeout=120,
            interval=0.5,
            what="every tenant Ready after the outage, the new one included",
        )
        assert holder(full_cluster, namespace) == "kvfleet-0"
        wait_for(lambda: leftover_mutations(full_cluster, namespace) == 0, timeout=60, what="converged")
        assert_audited_quiet(full_cluster, replica)
        # The leader could not renew during the outage: it ended its term rather than risk a second writer.
        assert LOST_EXIT_CODE in kubelet.exits, (kubelet.exits, replica.log()[-3000:])
