"""What the GIE tests share (``spec.gateway.inferencePool``, ``spec.gateway.dataPlane``): the operator's
real builders on the qwen72b example with its dedicated ``bank`` tenant (a shared and a dedicated pool),
for the builders' tests (tests/unit/test_build_endpoint_picker.py) and the reachability attacks
(tests/security/test_inference_pool_reachability.py); and the CRDs a GIE gateway's cluster has (GIE's
InferencePool and the Gateway API's HTTPRoute, releases pinned in hack/build-cluster.sh), for the tests
on an API server (tests/cluster/test_inference_pool.py, tests/e2e/test_real_node.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from devcluster import BUILD_COMMAND, cache_dir

from components import missing_component
from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import KeyFile

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
#: The CRDs by name: (folder under the cluster cache, file) as hack/build-cluster.sh copies them.
CRDS = {
    "inferencepools.inference.networking.k8s.io": (
        "gateway-api-inference-extension",
        "inference.networking.k8s.io_inferencepools.yaml",
    ),
    "httproutes.gateway.networking.k8s.io": ("gateway-api", "gateway.networking.k8s.io_httproutes.yaml"),
}
INFERENCE_POOL_CRD, HTTP_ROUTE_CRD = CRDS
CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def crd(name: str) -> dict[str, Any]:
    """The CRD ``name`` (a key of :data:`CRDS`) as its project ships it; a missing file fails the test (or
    skips it outside CI) naming the command that provides it."""
    folder, file = CRDS[name]
    path = cache_dir() / folder / file
    if not path.is_file():
        missing_component(f"{folder} CRDs", BUILD_COMMAND)
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def apply_crd(plane: Any, name: str) -> None:
    """Install (or update) the CRD ``name`` on ``plane`` (a ``ControlPlane``) as the admin would, with a
    server-side apply."""
    status, body = plane.request(
        "PATCH",
        f"{CRD_API}/{name}?fieldManager=kvfleet-tests",
        crd(name),
        content_type="application/apply-patch+yaml",
    )
    assert status in (200, 201), body


#: The examples' namespace.
NS = "llm"
#: The platform gateway's pods, as an Istio- or kgateway-managed Gateway named edge labels them.
GATEWAY_PODS: dict[str, Any] = {
    "namespace": "gateways",
    "matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"},
}
#: The engine pools' names (their StatefulSets, Services, NetworkPolicies and InferencePools).
SHARED, BANK = "qwen72b-engine", "qwen72b-dedicated-bank-engine"


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"]["uid"] = f"uid-{doc['metadata']['name']}"
    return doc


def model_deployment(**gateway: Any) -> ModelDeployment:
    """The qwen72b example with ``gateway`` merged into ``spec.gateway``."""
    doc = example("modeldeployment-qwen72b.yaml")
    doc["spec"].setdefault("gateway", {}).update(copy.deepcopy(gateway))
    return ModelDeployment.model_validate(doc)


def render(*, served: bool = True, monitoring: bool = True, **gateway: Any) -> list[dict[str, Any]]:
    """Everything the operator builds for :func:`model_deployment` and the ``bank`` tenant; ``served``:
    the operator may create InferencePools and the cluster serves them."""
    md = model_deployment(**gateway)
    tenants = [Tenant.model_validate(example("tenant-bank.yaml"))]
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    return build_desired_children(
        md, capacity, tenants, decisions, KEYS, IMAGES, monitoring, inference_pool_served=served
    )
