"""KEDA (operator + metrics API server) against a running local control plane, for the autoscaling tests.

Opt-in: :func:`start_keda` is called by the tests and benchmarks that scale (``tests/cluster_fixtures.py``:
the ``keda`` fixture); no other test pays for it. It needs the ``full`` or ``node`` tier, whose
kube-controller-manager runs the HPA controller that acts on the HPAs KEDA's operator creates.

What runs, as in KEDA's own manifests but as processes on this machine:

* KEDA's CRDs (``$KVFLEET_CACHE/keda-crds``, copied from its Go module's ``config/crd/bases`` by
  ``hack/build-cluster.sh``, step ``keda``), server-side applied;
* ``keda-operator``: reconciles ScaledObjects into HPAs, polls the triggers (a Prometheus query, ...) and
  serves their values over its gRPC metrics service (mutual TLS);
* ``keda-adapter``: KEDA's metrics API server, an extension API server for ``external.metrics.k8s.io``
  registered as an APIService. The API server's aggregator reaches it through a Service without selector
  and an EndpointSlice naming this machine's own address (an endpoint may not be a loopback address; the
  ``api``/``full`` tiers' API server routes to endpoints, ``--enable-aggregator-routing``).

One certificate from the cluster's CA (:func:`devcluster.pki.sign_serving_cert`) serves both: the
adapter's serving certificate (the aggregator checks it against the APIService's ``caBundle`` for
``keda-metrics-apiserver.keda.svc``) and the pair both ends of the gRPC channel present. The aggregator's
own client certificate comes from the front proxy CA (:mod:`devcluster.pki`). KEDA's admission webhooks
are not run: they only refuse a bad ScaledObject early, and the operator reports the same problems in the
ScaledObject's conditions.

Both processes authenticate with the admin kubeconfig: KEDA's least-privilege RBAC is its chart's business,
not what these tests prove. The HPA controller reads external metrics with its bootstrap role
(``system:controller:horizontal-pod-autoscaler``), as in any cluster.

:meth:`Keda.stop` removes the APIService first (an APIService without a server breaks API discovery, and
with it namespace deletion, for everyone), then the processes, the ``keda`` namespace and the CRDs.
"""

from __future__ import annotations

import base64
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import binaries
from .cluster import ControlPlane
from .node import detect_node_ip
from .pki import sign_serving_cert
from .processes import ManagedProcess, find_free_port, start_process, wait_until

#: What provides the binaries and CRDs below.
KEDA_BUILD_COMMAND = "KVFLEET_BUILD_STEPS=keda hack/build-cluster.sh"
KEDA_BINARIES = ("keda-operator", "keda-adapter")
#: The namespace of KEDA's objects (its charts' default): the metrics API server's Service lives here.
KEDA_NAMESPACE = "keda"
METRICS_SERVICE = "keda-metrics-apiserver"
OPERATOR_SERVICE = "keda-operator"
EXTERNAL_METRICS_GROUP = "external.metrics.k8s.io"
APISERVICE_NAME = f"v1beta1.{EXTERNAL_METRICS_GROUP}"
APISERVICE_PATH = f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE_NAME}"
#: KEDA's objects that carry its finalizer (deleted while the operator runs, :meth:`Keda.stop`).
SCALED_PLURALS = ("scaledobjects", "scaledjobs")
FIELD_MANAGER = "kvfleet-devcluster"
#: The label an EndpointSlice carries for the aggregator (and kube-proxy) to find it for its Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def keda_crd_dir() -> Path:
    return binaries.cache_dir() / "keda-crds"


def keda_crd_files() -> list[Path]:
    """KEDA's CRD manifests as ``hack/build-cluster.sh`` copied them (empty when not provisioned)."""
    return sorted(keda_crd_dir().glob("*.yaml"))


def missing_keda() -> list[str]:
    """What :func:`start_keda` needs and the cache lacks (binaries by name, ``keda CRDs``)."""
    missing = binaries.missing_binaries(KEDA_BINARIES)
    if not keda_crd_files():
        missing.append(f"KEDA CRDs in {keda_crd_dir()}")
    return missing


def keda_certificate_sans(address: str) -> tuple[str, ...]:
    """Where the one certificate is checked: the adapter's Service name (the aggregator's TLS server
    name), the operator's (KEDA's default gRPC address) and the addresses the processes listen on."""
    names = [
        f"{service}.{KEDA_NAMESPACE}.svc{suffix}"
        for service in (METRICS_SERVICE, OPERATOR_SERVICE)
        for suffix in ("", ".cluster.local")
    ]
    return ("IP:127.0.0.1", f"IP:{address}", "DNS:localhost", *(f"DNS:{n}" for n in names))


def build_keda_env(kubeconfig: Path) -> dict[str, str]:
    """The environment KEDA reads from its pod (namespace, watched namespaces) plus the kubeconfig that
    controller-runtime finds through ``KUBECONFIG`` outside a pod."""
    return {
        "KUBECONFIG": str(kubeconfig),
        "WATCH_NAMESPACE": "",  # all
        "POD_NAMESPACE": KEDA_NAMESPACE,
        "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
    }


def build_operator_args(
    operator: Path, *, cert_dir: Path, grpc_port: int, metrics_port: int, probe_port: int
) -> list[str]:
    """KEDA's operator on loopback ports; its gRPC metrics service speaks mutual TLS with ``cert_dir``'s
    ``tls.crt``/``tls.key``/``ca.crt`` (KEDA's file names)."""
    return [
        str(operator),
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        f"--health-probe-bind-address=127.0.0.1:{probe_port}",
        f"--metrics-service-bind-address=127.0.0.1:{grpc_port}",
        f"--cert-dir={cert_dir}",
        f"--ca-dir={cert_dir}",
        "--leader-elect=false",
        "--enable-cert-rotation=false",
        "--zap-log-level=info",
        "--zap-encoder=console",
    ]


def build_adapter_args(
    adapter: Path,
    *,
    kubeconfig: Path,
    cert_dir: Path,
    address: str,
    secure_port: int,
    grpc_port: int,
    metrics_port: int,
) -> list[str]:
    """KEDA's metrics API server on ``address:secure_port`` (what the EndpointSlice names), delegating
    authentication and authorization to the API server, reading trigger values from the operator."""
    return [
        str(adapter),
        f"--bind-address={address}",
        f"--secure-port={secure_port}",
        f"--cert-dir={cert_dir}",  # also where its gRPC client reads tls.crt, tls.key and ca.crt
        f"--tls-cert-file={cert_dir / 'tls.crt'}",
        f"--tls-private-key-file={cert_dir / 'tls.key'}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--metrics-service-address=127.0.0.1:{grpc_port}",
        f"--port={metrics_port}",  # its own /metrics (all interfaces; KEDA has no flag for the address)
        "--zap-log-level=info",
        "--zap-encoder=console",
    ]


def build_metrics_api_objects(address: str, port: int, ca_bundle: bytes) -> list[dict[str, Any]]:
    """The objects that register KEDA's metrics API server with the aggregator: a Service without
    selector (port 443 as KEDA's charts), an EndpointSlice pointing at ``address:port`` and the
    APIService for ``external.metrics.k8s.io`` whose ``caBundle`` is ``ca_bundle`` (PEM)."""
    labels = {"app.kubernetes.io/name": METRICS_SERVICE, "app.kubernetes.io/part-of": "keda"}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": METRICS_SERVICE, "namespace": KEDA_NAMESPACE, "labels": labels},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": METRICS_SERVICE,
                "namespace": KEDA_NAMESPACE,
                "labels": {
                    **labels,
                    SERVICE_NAME_LABEL: METRICS_SERVICE,
                    # Not the EndpointSlice controller's (that one manages only Services with selectors).
                    "endpointslice.kubernetes.io/managed-by": FIELD_MANAGER,
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": APISERVICE_NAME, "labels": labels},
            "spec": {
                "group": EXTERNAL_METRICS_GROUP,
                "version": "v1beta1",
                "service": {"name": METRICS_SERVICE, "namespace": KEDA_NAMESPACE, "port": 443},
                "caBundle": base64.b64encode(ca_bundle).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]


def _object_path(doc: dict[str, Any]) -> str:
    kind, name = doc["kind"], doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace")
    return {
        "Namespace": f"/api/v1/namespaces/{name}",
        "Service": f"/api/v1/namespaces/{namespace}/services/{name}",
        "EndpointSlice": f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}",
        "APIService": f"/apis/apiregistration.k8s.io/v1/apiservices/{name}",
        "CustomResourceDefinition": f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
    }[kind]


def _apply(plane: ControlPlane, doc: dict[str, Any]) -> None:
    status, body = plane.request(
        "PATCH",
        f"{_object_path(doc)}?fieldManager={FIELD_MANAGER}&force=true",
        doc,
        content_type="application/apply-patch+yaml",
    )
    if status not in (200, 201):
        raise RuntimeError(f"applying {doc['kind']} {doc['metadata']['name']} failed ({status}): {body}")


def _condition_true(plane: ControlPlane, path: str, kind: str) -> bool:
    try:
        status, body = plane.request("GET", path, timeout=5)
    except OSError:
        return False
    if status != 200:
        return False
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Keda:
    """KEDA running against ``plane``: its processes, the address the aggregator reaches the metrics API
    server on, and its folder (certificates, logs)."""

    plane: ControlPlane
    workdir: Path
    address: str
    adapter_port: int
    processes: list[ManagedProcess]
    crds: list[str]
    started_in: float = 0.0

    @property
    def operator_log(self) -> Path:
        return self.workdir / "logs" / "keda-operator.log"

    def alive(self) -> bool:
        return all(p.alive() for p in self.processes)

    def apiservice_available(self) -> bool:
        """The aggregator's own verdict: it reached the metrics API server and discovery works."""
        return _condition_true(self.plane, APISERVICE_PATH, "Available")

    def stop(self, *, remove_crds: bool = True) -> None:
        """Scaled objects first, while the operator still runs to remove its finalizers (else they, their
        namespaces and KEDA's CRDs would never finish deleting); then the APIService (an unavailable one
        breaks discovery, and with it namespace deletion, for everyone), the processes, the ``keda``
        namespace and (``remove_crds``) the CRDs."""
        plane = self.plane
        if self.processes:
            self._delete_scaled_objects()
        plane.request("DELETE", APISERVICE_PATH)
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        plane.request("DELETE", f"/api/v1/namespaces/{KEDA_NAMESPACE}")
        if remove_crds:
            for name in self.crds:
                plane.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _delete_scaled_objects(self, timeout: float = 30.0) -> None:
        plane = self.plane
        for plural in SCALED_PLURALS:
            for item in _items(plane, plural):
                plane.request("DELETE", _item_path(plural, item))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [item for plural in SCALED_PLURALS for item in _items(plane, plural)]
            if not left:
                return
            time.sleep(0.5)
        # The operator did not get to them: drop the finalizers so nothing stays stuck.
        for plural in SCALED_PLURALS:
            for item in _items(plane, plural):
                plane.request(
                    "PATCH",
                    _item_path(plural, item),
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                )


def _items(plane: ControlPlane, plural: str) -> list[dict[str, Any]]:
    """Every namespace's ``plural`` (none when KEDA's CRDs are gone)."""
    status, body = plane.request("GET", f"/apis/keda.sh/v1alpha1/{plural}")
    return list(body.get("items") or []) if status == 200 else []


def _item_path(plural: str, item: dict[str, Any]) -> str:
    meta = item["metadata"]
    return f"/apis/keda.sh/v1alpha1/namespaces/{meta['namespace']}/{plural}/{meta['name']}"


def _namespace_usable(plane: ControlPlane) -> bool:
    """No ``keda`` namespace, or an Active one: one a previous stop left terminating must go first."""
    status, body = plane.request("GET", f"/api/v1/namespaces/{KEDA_NAMESPACE}")
    return status == 404 or (status == 200 and (body.get("status") or {}).get("phase") == "Active")


def _established(plane: ControlPlane, crd: str) -> Callable[[], bool]:
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
    return lambda: _condition_true(plane, path, "Established")


def apply_keda_crds(plane: ControlPlane, timeout: float = 60.0) -> list[str]:
    """Server-side apply KEDA's CRDs; their names once Established."""
    names: list[str] = []
    for path in keda_crd_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                _apply(plane, doc)
                names.append(doc["metadata"]["name"])
    if not names:
        raise FileNotFoundError(f"no KEDA CRDs in {keda_crd_dir()}; run {KEDA_BUILD_COMMAND}")
    for name in names:
        wait_until(_established(plane, name), timeout=timeout, what=f"CRD {name} Established")
    return names


def start_keda(plane: ControlPlane, *, timeout: float = 120.0, workdir: Path | None = None) -> Keda:
    """Start KEDA against ``plane`` and wait until the aggregator reports its metrics API Available.

    Raises ``FileNotFoundError`` when a binary or the CRDs are missing (:data:`KEDA_BUILD_COMMAND`),
    ``ValueError`` on the ``api`` tier (no HPA controller), ``RuntimeError``/``TimeoutError`` when a
    process exits or a readiness wait fails; whatever started is stopped then."""
    if plane.tier == "api":
        raise ValueError("KEDA needs the full or node tier: the api tier runs no HPA controller")
    paths = {name: binaries.require_binary(name) for name in KEDA_BINARIES}
    started = time.monotonic()
    root = workdir or Path(tempfile.mkdtemp(prefix="kvfleet-keda-"))
    certs, logs = root / "certs", root / "logs"
    certs.mkdir(parents=True, exist_ok=True)
    address = plane.node.node_ip if plane.node is not None else detect_node_ip()
    keda = Keda(
        plane=plane, workdir=root, address=address, adapter_port=find_free_port(), processes=[], crds=[]
    )
    try:
        keda.crds = apply_keda_crds(plane, timeout=timeout)
        wait_until(lambda: _namespace_usable(plane), timeout=timeout, what=f"namespace {KEDA_NAMESPACE} gone")
        _apply(plane, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NAMESPACE}})
        crt, key = sign_serving_cert(plane.pki, "keda", "/O=KEDAORG/CN=keda", keda_certificate_sans(address))
        shutil.copyfile(crt, certs / "tls.crt")
        shutil.copyfile(key, certs / "tls.key")
        shutil.copyfile(plane.pki.ca_cert, certs / "ca.crt")
        env = build_keda_env(plane.kubeconfig)
        grpc_port, probe_port = find_free_port(), find_free_port()
        operator = start_process(
            "keda-operator",
            build_operator_args(
                paths["keda-operator"],
                cert_dir=certs,
                grpc_port=grpc_port,
                metrics_port=find_free_port(),
                probe_port=probe_port,
            ),
            logs,
            env=env,
        )
        keda.processes.append(operator)
        wait_until(
            lambda: _http_ok(f"http://127.0.0.1:{probe_port}/readyz"),
            timeout=timeout,
            what="keda-operator /readyz",
            watch=keda.processes,
        )
        adapter = start_process(
            "keda-adapter",
            build_adapter_args(
                paths["keda-adapter"],
                kubeconfig=plane.kubeconfig,
                cert_dir=certs,
                address=address,
                secure_port=keda.adapter_port,
                grpc_port=grpc_port,
                metrics_port=find_free_port(),
            ),
            logs,
            env=env,
        )
        keda.processes.append(adapter)
        tls = ssl.create_default_context(cafile=str(plane.pki.ca_cert))
        wait_until(
            lambda: _http_ok(f"https://{address}:{keda.adapter_port}/readyz", tls),
            timeout=timeout,
            what="keda-adapter /readyz",
            watch=keda.processes,
        )
        for doc in build_metrics_api_objects(address, keda.adapter_port, plane.pki.ca_cert.read_bytes()):
            _apply(plane, doc)
        wait_until(
            keda.apiservice_available,
            timeout=timeout,
            what=f"APIService {APISERVICE_NAME} Available",
            watch=keda.processes,
        )
    except BaseException:
        keda.stop()
        raise
    keda.started_in = time.monotonic() - started
    return keda
