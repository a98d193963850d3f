"""Operator replicas as real processes (``kvfleet operator``) for the HA, fault and fail-over tests and
``benchmarks/operator_failover.py``.

Each replica has its own identity (what ``POD_NAME`` is in a pod: its User-Agent and the Lease holder
carry it) and runs in its own process group, so ``kill()`` is ``kill -9`` of exactly that replica. Every
replica authenticates as the ServiceAccount ``kvfleet-operator`` of its namespace, as the chart's
Deployment does, so the API server's audit log names the operator by user (:func:`operator_user`); the
User-Agent then tells the replicas apart.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from audit import AuditLog, by_operator
from cluster_helpers import apply_crds, create_namespace, scratch_namespace
from devcluster import ControlPlane
from test_operator_reconcile import (
    CONFIG,
    condition,
    create,
    get,
    load_example,
    provision_local_nvme,
    reconcile,
    tenant,
)

from factories import free_port

#: Lease timings of the test replicas: the operator's defaults (``kvfleet operator --help``).
LEASE_NAME = "kvfleet-leader"
#: The ServiceAccount the replicas run as (the chart's Deployment runs as its own ServiceAccount).
OPERATOR_SERVICE_ACCOUNT = "kvfleet-operator"
TEST_IMAGES = {"KVFLEET_ENGINE_IMAGE": "kvfleet-engine:test", "KVFLEET_GATEWAY_IMAGE": "kvfleet:test"}


def operator_user(namespace: str) -> str:
    """The user the API server (and its audit log) sees for every replica watching ``namespace``."""
    return f"system:serviceaccount:{namespace}:{OPERATOR_SERVICE_ACCOUNT}"


def operator_kubeconfig(plane: ControlPlane, namespace: str, path: Path) -> Path:
    """A kubeconfig of the ServiceAccount :data:`OPERATOR_SERVICE_ACCOUNT` in ``namespace`` (created, and
    bound to ``cluster-admin`` by a ClusterRoleBinding the Namespace owns, so it goes with it).

    The operator's least-privilege RBAC is the chart's, proven where the chart is installed
    (test_chart_cluster.py, test_exposure.py); here the point is the identity the audit log records."""
    status, body = plane.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"metadata": {"name": OPERATOR_SERVICE_ACCOUNT}},
    )
    assert status in (201, 409), body
    ns = plane.request("GET", f"/api/v1/namespaces/{namespace}")[1]
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {
            "name": f"{OPERATOR_SERVICE_ACCOUNT}-{namespace}",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Namespace", "name": namespace, "uid": ns["metadata"]["uid"]}
            ],
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SERVICE_ACCOUNT, "namespace": namespace}],
    }
    status, body = plane.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
    assert status in (201, 409), body
    return plane.service_account_kubeconfig(namespace, OPERATOR_SERVICE_ACCOUNT, path)


class OperatorReplica:
    """One ``kvfleet operator`` process named ``identity``, watching ``namespace`` as the ServiceAccount
    :func:`operator_user`; its Lease and salt master Secret live in ``namespace`` too. ``leader_election``
    ``False`` runs it with ``--no-leader-election`` (no Lease at all)."""

    def __init__(
        self,
        plane: ControlPlane,
        namespace: str,
        identity: str,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        resync_seconds: float = 5,
        leader_election: bool = True,
    ) -> None:
        self.plane, self.namespace, self.identity, self.log_dir = plane, namespace, identity, log_dir
        self.leader_election = leader_election
        self.kubeconfig: Path | None = None
        self.extra_env = dict(env or {})
        self.resync_seconds = resync_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path: Path | None = None
        self.probe_port = 0

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Start (again); ``env`` adds to the environment of this start only (e.g. a fault point)."""
        self.starts += 1
        self.log_path = self.log_dir / f"{self.identity}-{self.starts}.log"
        self.probe_port = free_port()
        if self.kubeconfig is None:
            self.kubeconfig = operator_kubeconfig(
                self.plane, self.namespace, self.log_dir / f"{self.identity}.kubeconfig"
            )
        election = (
            ["--leader-election-lease", LEASE_NAME] if self.leader_election else ["--no-leader-election"]
        )
        environment = {
            **self.plane.env(),
            "KUBECONFIG": str(self.kubeconfig),
            **TEST_IMAGES,
            "POD_NAME": self.identity,
            "KVFLEET_RESYNC_SECONDS": str(self.resync_seconds),
            "KVFLEET_SALT_SECRET": f"{self.namespace}/kvfleet-salt-master",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
            **(env or {}),
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "kvfleet_runtime", "operator",
                    "--namespace", self.namespace,
                    "--metrics-port", "0",
                    "--probe-address", f"127.0.0.1:{self.probe_port}",
                    *election,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_exit(self, timeout: float) -> int:
        if self.proc is None:
            raise AssertionError(f"{self.identity} never started")
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """``kill -9`` of the replica's process group."""
        if self.running() and self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int | None:
        """SIGTERM, as the kubelet sends it; kill -9 when it has not exited after ``timeout``."""
        if not self.running() or self.proc is None:
            return self.exit_code()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def role(self) -> str | None:
        """What the replica's ``/healthz`` says it is (``leader``, ``standby``), ``None`` if it does not
        answer 200."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/healthz", timeout=2) as resp:
                state: dict[str, Any] = json.loads(resp.read())
        except (OSError, ValueError):
            return None
        return str(state.get("role")) if state.get("role") else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


class Kubelet:
    """What the kubelet does for the operator container (``restartPolicy: Always``, without back-off):
    start it again whenever it exits. ``exits`` records each exit status. Use as a context manager."""

    def __init__(self, replica: OperatorReplica) -> None:
        self.replica = replica
        self.exits: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"kubelet-{replica.identity}", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            code = self.replica.exit_code()
            if code is not None:
                self.exits.append(code)
                self.replica.start()

    def __enter__(self) -> Kubelet:
        if not self.replica.running():
            self.replica.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.replica.kill()


def lease(plane: ControlPlane, namespace: str, name: str = LEASE_NAME) -> dict[str, Any] | None:
    status, body = plane.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
    if status == 404:
        return None
    assert status == 200, body
    found: dict[str, Any] = body
    return found


def holder(plane: ControlPlane, namespace: str, name: str = LEASE_NAME) -> str:
    """The Lease's holder now ("" when released or absent)."""
    found = lease(plane, namespace, name)
    return str(((found or {}).get("spec") or {}).get("holderIdentity") or "")


def wait_holder(plane: ControlPlane, namespace: str, want: set[str], timeout: float = 60) -> str:
    """Wait until one of ``want`` holds the Lease; returns it."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = holder(plane, namespace)
        if last in want:
            return last
        time.sleep(0.1)
    raise AssertionError(f"none of {sorted(want)} holds the Lease after {timeout:.0f} s (holder: {last!r})")


# --- The scene the HA, fault and fail-over runs play in. ---------------------------------------------

EXAMPLE_TENANTS = ("saas", "startup-a", "startup-b")  # none names a key Secret: each gets a generated one
EXPECTED_CHILDREN = 11  # shared pool (4) + gateway (5, two Services) + config (2); test_operator_process


RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


def _fill_namespace(plane: ControlPlane, namespace: str, tenants: tuple[str, ...]) -> None:
    provision_local_nvme(plane, namespace, per_node=4)
    create(plane, load_example("modeldeployment-qwen72b.yaml", namespace))
    for name in tenants:
        create(plane, load_example(f"tenant-{name}.yaml", namespace))


def prepare_namespace(plane: ControlPlane, prefix: str, tenants: tuple[str, ...] = EXAMPLE_TENANTS) -> str:
    """A fresh namespace (``restricted`` Pod Security) with the qwen72b example, local NVMe volumes for its
    engines and the named example tenants; nothing reconciled yet. The caller deletes it
    (:func:`prepared_namespace` is the same for a ``with`` block, deleted when it ends)."""
    apply_crds(plane)
    namespace = create_namespace(plane, prefix, labels=RESTRICTED)
    _fill_namespace(plane, namespace, tenants)
    return namespace


@contextmanager
def prepared_namespace(
    plane: ControlPlane, prefix: str, tenants: tuple[str, ...] = EXAMPLE_TENANTS
) -> Iterator[str]:
    """:func:`prepare_namespace` for a ``with`` block (or a fixture): deleted when the block ends."""
    with scratch_namespace(plane, prefix, RESTRICTED, crds=True) as namespace:
        _fill_namespace(plane, namespace, tenants)
        yield namespace


def tenants_ready(plane: ControlPlane, namespace: str, names: tuple[str, ...] = EXAMPLE_TENANTS) -> bool:
    return all(condition(tenant(plane, namespace, n)).get("status") == "True" for n in names)


def leftover_mutations(plane: ControlPlane, namespace: str, md: str = "qwen72b") -> int:
    """The writes one more reconcile (in process, with the operator's own master key) would make: 0 when
    the operator left everything converged."""
    master = get(plane, f"/api/v1/namespaces/{namespace}/secrets/kvfleet-salt-master")
    config = dataclasses.replace(CONFIG, salt_master=base64.b64decode(master["data"]["master-key"]))
    mutations: int = reconcile(plane, namespace, md, config)[1]
    return mutations


def assert_audited_quiet(plane: ControlPlane, replica: OperatorReplica) -> None:
    """Converged, in the API server's own account: over two resync periods of ``replica`` (from now), the
    audit log holds no write of the operator's ServiceAccount in its namespace but Lease renewals (and at
    least one of those, so a log that is not being written cannot pass)."""
    audit = AuditLog(plane.audit_log)
    time.sleep(2 * replica.resync_seconds + 2)
    writes = by_operator(audit.writes(), replica.namespace, user=operator_user(replica.namespace))
    work = [w for w in writes if not w.is_lease]
    assert not work, "a converged operator wrote:\n" + "\n".join(w.describe() for w in work)
    assert any(w.is_lease for w in writes), "no Lease renewal in the audit log: is it being written?"
