"""The kinds the operator reads or writes, and their REST paths."""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "kvfleet.io"
VERSION = "v1alpha1"


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        prefix = f"/apis/{self.api_version}" if "/" in self.api_version else f"/api/{self.api_version}"
        if self.namespaced and namespace:
            prefix += f"/namespaces/{namespace}"
        prefix += f"/{self.plural}"
        return f"{prefix}/{name}" if name else prefix


MODEL_DEPLOYMENT = Kind(f"{GROUP}/{VERSION}", "ModelDeployment", "modeldeployments")
TENANT = Kind(f"{GROUP}/{VERSION}", "Tenant", "tenants")

CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SECRET = Kind("v1", "Secret", "secrets")
SERVICE = Kind("v1", "Service", "services")
POD = Kind("v1", "Pod", "pods")
EVENT = Kind("v1", "Event", "events")
NODE = Kind("v1", "Node", "nodes", namespaced=False)
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
STATEFUL_SET = Kind("apps/v1", "StatefulSet", "statefulsets")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
INGRESS = Kind("networking.k8s.io/v1", "Ingress", "ingresses")
HTTP_ROUTE = Kind("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes")
#: Gateway API Inference Extension: one per engine pool (``spec.gateway.inferencePool``).
INFERENCE_POOL = Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools")
SERVICE_MONITOR = Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
POD_MONITOR = Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors")
#: KEDA's autoscaler of the shared pool (``spec.pool.autoscaling``): it scales the ModelDeployment itself.
SCALED_OBJECT = Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects")
#: The operator's leader-election Lease (``k8s/leader.py``), in its own namespace: never a child.
LEASE = Kind("coordination.k8s.io/v1", "Lease", "leases")

#: Every child kind the operator owns, in the order they are applied (config before workloads, so a
#: pod never starts against a missing ConfigMap) and deleted in reverse.
CHILD_KINDS: tuple[Kind, ...] = (
    CONFIG_MAP,
    SECRET,
    SERVICE,
    NETWORK_POLICY,
    PDB,
    DEPLOYMENT,
    STATEFUL_SET,
    INGRESS,
    HTTP_ROUTE,
    INFERENCE_POOL,
    SERVICE_MONITOR,
    POD_MONITOR,
    SCALED_OBJECT,
)
#: Children of optional APIs: listed only where the cluster serves them (checked at start-up), never
#: watched (the periodic reconcile covers them).
MONITORING_KINDS: tuple[Kind, ...] = (SERVICE_MONITOR, POD_MONITOR)
#: Children that expose the gateway or the pools outside the ModelDeployment (``spec.gateway.exposure``,
#: ``spec.gateway.inferencePool``), or hand its scale to KEDA (``spec.pool.autoscaling``): managed only
#: where the chart grants their rights (``rbac.ingress``, ``rbac.httpRoute``, ``rbac.inferencePool``,
#: ``rbac.keda``; ``KVFLEET_EXPOSURE_KINDS``), left out with a condition where the cluster does not serve
#: their API, never watched (the periodic reconcile covers them; the Services they route to are watched).
EXPOSURE_KINDS: tuple[Kind, ...] = (INGRESS, HTTP_ROUTE, INFERENCE_POOL, SCALED_OBJECT)

BY_API_KIND: dict[tuple[str, str], Kind] = {(k.api_version, k.kind): k for k in CHILD_KINDS}
#: The kinds the operator keeps watch-fed copies of (``k8s/informer.py``): Tenants, and Secrets labelled as
#: a tenant's key (never any other Secret).
INFORMED_KINDS: tuple[Kind, ...] = (TENANT, SECRET)


def kind_of(obj: dict[str, object]) -> Kind:
    key = (str(obj["apiVersion"]), str(obj["kind"]))
    if key not in BY_API_KIND:
        raise KeyError(f"kvfleet does not manage {key[1]} ({key[0]})")
    return BY_API_KIND[key]


def parse_exposure_kinds(text: str | None) -> tuple[Kind, ...]:
    """The exposure kinds named in ``KVFLEET_EXPOSURE_KINDS`` (comma-separated ``Ingress``, ``HTTPRoute``,
    ``InferencePool``, ``ScaledObject``; empty or ``None``: none). Raises ``ValueError`` naming an unknown
    kind: never a right nobody asked for nor a silently ignored one."""
    by_name = {k.kind: k for k in EXPOSURE_KINDS}
    out: list[Kind] = []
    for name in (n.strip() for n in (text or "").split(",")):
        if not name:
            continue
        if name not in by_name:
            raise ValueError(f"unknown exposure kind {name!r}: expected some of {', '.join(by_name)}")
        if by_name[name] not in out:
            out.append(by_name[name])
    return tuple(out)
