"""Start and stop a real local Kubernetes control plane on 127.0.0.1.

Three tiers:

* ``api``: etcd + kube-apiserver (RBAC, PodSecurity and the usual admission plugins, client-certificate
  auth, service-account token signing). Enough for CRDs, CEL validation, server-side apply and RBAC.
* ``full``: ``api`` plus kube-controller-manager (garbage collector, Deployments, ReplicaSets,
  namespaces, service accounts and their tokens, ...), kube-scheduler and kwok keeping the fake GPU
  nodes of a :class:`~devcluster.layout.NodeLayout` Ready and their pods Running.
* ``node``: ``full`` without the fake nodes, plus one real node (:mod:`devcluster.node`: containerd,
  kubelet, kube-proxy, CoreDNS, kube-router's NetworkPolicy firewall) that runs kvfleet's own images. The
  API server then listens on the machine's own address (pods must reach it), not on loopback.

Every component listens on a free loopback port (the ``node`` tier's API server: the node address);
everything lives in one temporary folder (PKI, etcd data, logs, the admin kubeconfig) that
:meth:`ControlPlane.stop` removes after killing every process group it started.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from . import binaries
from .layout import (
    DEFAULT_LAYOUT,
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_ANNOTATION_VALUE,
    NodeLayout,
    build_node_manifest,
)
from .node import RealNode, detect_node_ip, start_real_node, stop_real_node
from .pki import FRONT_PROXY_CLIENT_CN, Pki, build_pki
from .processes import ManagedProcess, find_free_port, start_process, wait_until

Tier = Literal["api", "full", "node"]
#: The processes a real node adds (stopped through :func:`~devcluster.node.stop_real_node`).
NODE_PROCESSES = frozenset({"containerd", "kubelet", "kube-proxy", "coredns", "kube-router"})

#: Admission plugins on top of the defaults that matter for an operator: PodSecurity labels on
#: namespaces, NodeRestriction with the Node authorizer, quota and limit ranges.
ADMISSION_PLUGINS = (
    "NamespaceLifecycle",
    "LimitRanger",
    "ServiceAccount",
    "NodeRestriction",
    "PodSecurity",
    "Priority",
    "DefaultTolerationSeconds",
    "DefaultStorageClass",
    "MutatingAdmissionWebhook",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionWebhook",
    "ResourceQuota",
)

#: Controllers kube-controller-manager runs. The node-lifecycle controller removes the
#: ``node.kubernetes.io/not-ready`` taint admission puts on every new node once kwok reports it Ready, and
#: taints a node that stopped reporting; the taint-eviction controller (split from it in Kubernetes 1.29)
#: evicts the pods that do not tolerate such a NoExecute taint, as in any cluster.
CONTROLLERS = (
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "garbage-collector-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "service-cidr-controller",
    "pod-garbage-collector-controller",
    "resourcequota-controller",
    "disruption-controller",
    "ttl-after-finished-controller",
    "persistentvolume-binder-controller",  # binds the static local-NVMe PVs the operator tests provide
    "persistentvolume-protection-controller",
    "persistentvolumeclaim-protection-controller",
    # KEDA's ScaledObjects scale through an HPA (devcluster.keda); without KEDA no HPA exists and it idles.
    "horizontal-pod-autoscaler-controller",
)

#: How often the HPA controller evaluates each HPA (Kubernetes' default: 15 s): short, so an autoscaling
#: test sees a metric's step acted on within seconds.
HPA_SYNC_PERIOD_S = 3

#: The API server's audit policy: every write (whoever sends it) at Metadata level, one event per request
#: (when the response is complete), and nothing else: reads and watches would dwarf the writes. Tests and
#: benchmarks count writes by user and User-Agent from it (``ControlPlane.audit_log``).
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted", "Panic"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}

SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.0/16"


@dataclass
class ControlPlane:
    """A running control plane: where to reach it and what runs.

    ``kubeconfig`` is an admin kubeconfig (client certificate in ``system:masters``, everything
    embedded); ``server`` the API server's ``https://127.0.0.1:<port>``; ``layout`` the fake nodes (only
    present in the ``full`` tier).
    """

    workdir: Path
    tier: Tier
    kubeconfig: Path
    server: str
    etcd_url: str
    pki: Pki
    layout: NodeLayout = DEFAULT_LAYOUT
    processes: list[ManagedProcess] = field(default_factory=list)
    started_in: dict[str, float] = field(default_factory=dict)
    node: RealNode | None = None

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines, one per write; see :data:`AUDIT_POLICY`)."""
        return self.workdir / "apiserver" / "audit.log"

    # --- clients --------------------------------------------------------------------------------------

    def api_client(self) -> Any:
        """A new admin ``kubernetes.client.ApiClient`` for this cluster (the caller closes it)."""
        from kubernetes import config  # noqa: PLC0415 - only callers that want the client need it

        new_client: Any = config.new_client_from_config  # untyped library
        return new_client(config_file=str(self.kubeconfig))

    def service_account_kubeconfig(self, namespace: str, sa: str, path: Path, seconds: int = 7200) -> Path:
        """A kubeconfig (mode 0600) that authenticates as ServiceAccount ``namespace/sa`` with a
        TokenRequest token valid for ``seconds``: run a program with exactly that identity's RBAC."""
        status, body = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds},
            },
        )
        if status != 201:
            raise RuntimeError(f"TokenRequest for {namespace}/{sa} failed: {status} {body}")
        ca = base64.b64encode(self.pki.ca_cert.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": sa, "user": {"token": body["status"]["token"]}}],
            "contexts": [{"name": "sa", "context": {"cluster": "c", "user": sa}}],
            "current-context": "sa",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def env(self) -> dict[str, str]:
        """Environment for kubectl/helm subprocesses: ``KUBECONFIG`` and the binary cache on ``PATH``."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{binaries.bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}",
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 10.0,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """One admin API call (JSON in, JSON out); returns ``(status, decoded body)`` for any status.

        ``content_type`` selects the patch flavour for PATCH (``application/apply-patch+yaml`` for
        server-side apply, ``application/merge-patch+json``, ...); the body is always sent as JSON.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path, data=data, method=method, headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    # --- readiness ------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        try:
            status, _ = self.request("GET", "/readyz", timeout=2)
        except OSError:
            return False
        return status == 200

    def nodes_ready(self) -> bool:
        """Every node of the layout exists, reports ``Ready=True`` and has no condition taint left."""
        try:
            status, body = self.request("GET", "/api/v1/nodes")
        except OSError:
            return False
        if status != 200:
            return False
        ready = {item["metadata"]["name"] for item in body.get("items", []) if _node_schedulable(item)}
        return set(self.layout.node_names) <= ready

    def default_service_account_exists(self) -> bool:
        try:
            status, _ = self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        except OSError:
            return False
        return status == 200

    # --- lifecycle ------------------------------------------------------------------------------------

    def stop(self, remove_workdir: bool = True) -> None:
        """Kill every started process group (last started first) and remove the work folder; a real node
        is drained and its changes to the machine undone first."""
        if self.node is not None:
            node_procs = [p for p in self.processes if p.name in NODE_PROCESSES]
            stop_real_node(self, self.node, node_procs)
            self.processes = [p for p in self.processes if p.name not in NODE_PROCESSES]
            self.node = None
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes)

    def to_state(self) -> dict[str, Any]:
        """A JSON-able description, enough for another process to reach and stop this cluster."""
        return {
            "workdir": str(self.workdir),
            "tier": self.tier,
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "etcd_url": self.etcd_url,
            "processes": [
                {"name": p.name, "pid": p.pid, "argv": p.argv, "log": str(p.log_path)} for p in self.processes
            ],
            "started_in": self.started_in,
            "node": None if self.node is None else self.node.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ControlPlane:
        workdir = Path(state["workdir"])
        return cls(
            workdir=workdir,
            tier=state["tier"],
            kubeconfig=Path(state["kubeconfig"]),
            server=state["server"],
            etcd_url=state["etcd_url"],
            pki=_pki_paths(workdir / "pki"),
            processes=[
                ManagedProcess(name=p["name"], pid=p["pid"], argv=p["argv"], log_path=Path(p["log"]))
                for p in state["processes"]
            ],
            started_in=dict(state.get("started_in", {})),
            node=None if not state.get("node") else RealNode.from_state(state["node"]),
        )


def _node_schedulable(node: dict[str, Any]) -> bool:
    """Ready=True and none of the ``node.kubernetes.io/*`` condition taints (not-ready, unreachable, ...)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints", []) or []
    return ready and not any(t.get("key", "").startswith("node.kubernetes.io/") for t in taints)


def _pki_paths(directory: Path) -> Pki:
    return Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "apiserver.crt",
        server_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )


def build_kubeconfig(server: str, pki: Pki, name: str = "kvfleet-dev") -> dict[str, Any]:
    """An admin kubeconfig with the CA and the client certificate embedded (self-contained)."""
    import base64  # noqa: PLC0415

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)}}
        ],
        "users": [
            {
                "name": f"{name}-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_cert),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": f"{name}-admin"}}],
        "current-context": name,
    }


def build_etcd_args(etcd: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(etcd),
        "--name=default",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        # Throw-away data: skipping fsync makes a test cluster several times faster (as envtest does).
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def build_apiserver_args(
    apiserver: Path, pki: Pki, etcd_url: str, port: int, cert_dir: Path, address: str = "127.0.0.1"
) -> list[str]:
    """``address``: where it listens and what it advertises; loopback unless a real node's pods must
    reach it (then the ``kubernetes`` Service gets endpoints and the API server a kubelet client cert)."""
    if address == "127.0.0.1":
        # The endpoint reconciler refuses a loopback advertise address; nothing in the cluster needs the
        # endpoints of the `kubernetes` Service (kwok's pods run no code).
        reach = ["--endpoint-reconciler-type=none"]
    else:
        # Pods reach the API server through the `kubernetes` Service (endpoints: this address); the API
        # server reaches the kubelet (logs, exec) with the admin client certificate.
        reach = [
            f"--kubelet-client-certificate={pki.admin_cert}",
            f"--kubelet-client-key={pki.admin_key}",
            # The node's name (kvfleet-node) resolves nowhere; its InternalIP does.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]
    return [
        str(apiserver),
        f"--etcd-servers={etcd_url}",
        f"--bind-address={address}",
        f"--advertise-address={address}",
        *reach,
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={pki.server_cert}",
        f"--tls-private-key-file={pki.server_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        *build_aggregator_args(pki),
        *build_audit_args(cert_dir),
        f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
        "--allow-privileged=true",
        "--profiling=false",
        "--v=1",
    ]


def build_aggregator_args(pki: Pki) -> list[str]:
    """The aggregation layer's flags, as kubeadm sets them: the API server proxies an APIService's requests
    (``external.metrics.k8s.io`` to KEDA's metrics API server, :mod:`devcluster.keda`) with the front
    proxy's client certificate and the caller in ``X-Remote-*`` headers, which the extension server trusts
    from the ``requestheader`` settings the API server publishes in ``kube-system``.

    ``--enable-aggregator-routing``: to an endpoint's address, not the Service's cluster IP, which nothing
    routes without kube-proxy (the ``api`` and ``full`` tiers have none)."""
    return [
        f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT_CN}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.front_proxy_client_cert}",
        f"--proxy-client-key-file={pki.front_proxy_client_key}",
        "--enable-aggregator-routing=true",
    ]


def build_audit_args(directory: Path) -> list[str]:
    """Flags for an audit log of every write in ``directory``/audit.log (writes the policy file there).

    Blocking mode: the event is written before the API server answers, so a test that reads the log after
    its last call has returned sees every event of that call."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = directory / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={directory / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
        "--audit-log-maxsize=0",  # never rotated: a test cluster lives minutes
    ]


#: How long kube-controller-manager waits for a node's heartbeat before calling it NotReady (see below).
NODE_MONITOR_GRACE_PERIOD_S = 900


def kwok_node_lease_seconds(node_monitor_grace_period_s: int) -> int | None:
    """kwok's node Lease duration for a grace period: its default (40 s, renewed every 10 s) with the usual
    900 s; with a short grace period a Lease of a quarter of it (renewed every sixteenth), so a renewal a
    loaded machine delays by seconds does not make a healthy node NotReady."""
    if node_monitor_grace_period_s >= NODE_MONITOR_GRACE_PERIOD_S:
        return None
    return max(4, node_monitor_grace_period_s // 4)


def build_controller_manager_args(
    kcm: Path,
    pki: Pki,
    kubeconfig: Path,
    port: int,
    node_monitor_grace_period_s: int = NODE_MONITOR_GRACE_PERIOD_S,
) -> list[str]:
    """``node_monitor_grace_period_s``: a test of a lost node passes a short one on its own plane."""
    return [
        str(kcm),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        # Each controller acts as its own service account, so RBAC applies to it as in a real cluster.
        "--use-service-account-credentials=true",
        # kwok renews node leases, but on a loaded 2-core machine a renewal can be late: wait long before
        # calling a fake node unreachable. A node called unreachable gets its pods marked not Ready, and
        # kwok never marks them Ready again (its pod-ready stage only runs once per pod): at 120 s this
        # left gateway pods not Ready in some full CI runs.
        f"--node-monitor-grace-period={node_monitor_grace_period_s}s",
        f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD_S}s",
        "--leader-elect=false",
        f"--cluster-cidr={POD_CIDR}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--v=1",
    ]


def build_scheduler_args(scheduler: Path, kubeconfig: Path, port: int) -> list[str]:
    return [
        str(scheduler),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--leader-elect=false",
        "--v=1",
    ]


def build_kwok_args(
    kwok: Path,
    kubeconfig: Path,
    port: int,
    stages: list[Path],
    annotation_value: str = KWOK_NODE_ANNOTATION_VALUE,
    node_lease_s: int | None = None,
) -> list[str]:
    """``annotation_value``: the nodes it manages (another value: a second kwok, as one node's kubelet);
    ``node_lease_s``: the nodes' Lease duration (kwok renews at a quarter of it; ``None``: kwok's 40 s)."""
    lease = [] if node_lease_s is None else [f"--node-lease-duration-seconds={node_lease_s}"]
    return [
        str(kwok),
        f"--kubeconfig={kubeconfig}",
        # Manage only the nodes we create (annotated), never a real node that might join.
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={annotation_value}",
        f"--server-address=127.0.0.1:{port}",
        f"--cidr={POD_CIDR.replace('.0/16', '.1/16')}",
        "--node-ip=127.0.0.1",
        *lease,
        *[f"--config={stage}" for stage in stages],
    ]


def _https_ok(port: int, path: str = "/healthz") -> bool:
    # The controller manager and scheduler serve self-signed certificates and allow /healthz anonymously.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def start_control_plane(
    tier: Tier = "api",
    *,
    layout: NodeLayout = DEFAULT_LAYOUT,
    workdir: Path | None = None,
    timeout: float = 120.0,
    node_monitor_grace_period_s: int = NODE_MONITOR_GRACE_PERIOD_S,
) -> ControlPlane:
    """Start a ``tier`` control plane and wait until it is ready; stop everything if that fails.

    Ready means: ``/readyz`` of the API server answers 200 (``api``); additionally the controller manager
    and scheduler are healthy, every layout node is Ready without a ``node.kubernetes.io/*`` taint and the
    ``default`` service account exists
    (``full``). Raises ``FileNotFoundError`` when a binary is missing (see ``hack/build-cluster.sh``).
    """
    names = binaries.API_TIER_BINARIES if tier == "api" else binaries.FULL_TIER_BINARIES
    paths = {name: binaries.require_binary(name) for name in names}
    root = workdir or Path(tempfile.mkdtemp(prefix="kvfleet-cluster-"))
    started = time.monotonic()
    address = detect_node_ip() if tier == "node" else "127.0.0.1"
    pki = build_pki(root / "pki", extra_ips=() if address == "127.0.0.1" else (address,))
    etcd_port, peer_port, api_port = find_free_port(), find_free_port(), find_free_port()
    plane = ControlPlane(
        workdir=root,
        tier="api",
        kubeconfig=root / "kubeconfig",
        server=f"https://{address}:{api_port}",
        etcd_url=f"http://127.0.0.1:{etcd_port}",
        pki=pki,
        # The node tier's pods must land on the real node: no fake nodes beside it by default.
        layout=NodeLayout(shared_pool=()) if tier == "node" and layout is DEFAULT_LAYOUT else layout,
    )
    plane.kubeconfig.write_text(yaml.safe_dump(build_kubeconfig(plane.server, pki), sort_keys=False))
    plane.kubeconfig.chmod(0o600)
    logs = root / "logs"
    try:
        etcd_args = build_etcd_args(paths["etcd"], root / "etcd", etcd_port, peer_port)
        etcd = start_process("etcd", etcd_args, logs)
        plane.processes.append(etcd)
        apiserver = start_process(
            "kube-apiserver",
            build_apiserver_args(
                paths["kube-apiserver"], pki, plane.etcd_url, api_port, root / "apiserver", address
            ),
            logs,
        )
        plane.processes.append(apiserver)
        wait_until(plane.is_ready, timeout=timeout, what="kube-apiserver /readyz", watch=plane.processes)
        plane.started_in["api"] = time.monotonic() - started
        if tier in ("full", "node"):
            extend_to_full(plane, timeout=timeout, node_monitor_grace_period_s=node_monitor_grace_period_s)
        if tier == "node":
            plane.node = start_real_node(plane, node_ip=address, service_cidr=SERVICE_CIDR, timeout=timeout)
            plane.tier = "node"
            plane.started_in["node"] = plane.node.started_in["node"]
    except BaseException:
        plane.stop()
        raise
    return plane


def extend_to_full(
    plane: ControlPlane,
    *,
    timeout: float = 120.0,
    node_monitor_grace_period_s: int = NODE_MONITOR_GRACE_PERIOD_S,
) -> None:
    """Add controller manager, scheduler, kwok and the layout's nodes to a running ``api`` plane."""
    if plane.tier == "full":
        return
    paths = {name: binaries.require_binary(name) for name in binaries.FULL_TIER_BINARIES}
    started = time.monotonic()
    logs = plane.workdir / "logs"
    kcm_port, sched_port, kwok_port = find_free_port(), find_free_port(), find_free_port()
    kcm_args = build_controller_manager_args(
        paths["kube-controller-manager"], plane.pki, plane.kubeconfig, kcm_port, node_monitor_grace_period_s
    )
    kcm = start_process("kube-controller-manager", kcm_args, logs)
    plane.processes.append(kcm)
    scheduler = start_process(
        "kube-scheduler", build_scheduler_args(paths["kube-scheduler"], plane.kubeconfig, sched_port), logs
    )
    plane.processes.append(scheduler)
    if plane.layout.nodes:
        stages = binaries.kwok_stage_files()
        if not stages:
            where = binaries.kwok_stage_dir()
            raise FileNotFoundError(f"no kwok stage configs in {where}; run {binaries.BUILD_COMMAND}")
        lease = kwok_node_lease_seconds(node_monitor_grace_period_s)
        kwok = start_process(
            "kwok",
            build_kwok_args(paths["kwok"], plane.kubeconfig, kwok_port, stages, node_lease_s=lease),
            logs,
        )
        plane.processes.append(kwok)
    for node in plane.layout.nodes:
        status, body = plane.request("POST", "/api/v1/nodes", build_node_manifest(node))
        if status not in (201, 409):
            raise RuntimeError(f"creating node {node.name} failed ({status}): {body}")
    checks = (
        (lambda: _https_ok(kcm_port), "kube-controller-manager /healthz"),
        (lambda: _https_ok(sched_port), "kube-scheduler /healthz"),
        (plane.nodes_ready, "fake nodes Ready"),
        (plane.default_service_account_exists, "the default service account"),
    )
    for check, what in checks:
        wait_until(check, timeout=timeout, what=what, watch=plane.processes)
    plane.tier = "full"
    plane.started_in["full"] = time.monotonic() - started
