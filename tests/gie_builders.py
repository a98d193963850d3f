"""What the GIE tests share (``spec.gateway.inferencePool``, ``spec.gateway.dataPlane``): the operator's
real builders on the qwen72b example with its dedicated ``bank`` tenant (a shared and a dedicated pool),
for the builders' tests (tests/unit/test_build_endpoint_picker.py) and the reachability attacks
(tests/security/test_inference_pool_reachability.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import KeyFile

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
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
