"""Everything a ModelDeployment owns (build/model_deployment.py), built from the example manifests."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.common import ENGINE_PORT, GATEWAY_PORT
from kvfleet_operator.build.engine import build_node_loss_tolerations
from kvfleet_operator.build.model_deployment import (
    OperatorImages,
    build_config_map,
    build_desired_children,
    build_keys_secret,
    compute_endpoint,
)
from kvfleet_operator.build.tenant_table import (
    PoolEndpoints,
    admit_tenants,
    build_tenant_table,
    compute_pool_capacity,
)
from kvfleet_runtime.config import KeyFile, TenantTable
from object_fields import MISSING, field_at

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={"saas": ["0" * 64]})
POD = "spec.template.spec"
#: The example's toleration as the model dumps it (``value`` defaults to ""; the server omits it, and the
#: planner treats the two as equal).
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "value": "", "effect": "NoSchedule"}
#: Every engine pod's short NoExecute tolerations of a node that stopped reporting (build/engine.py).
NODE_LOSS = build_node_loss_tolerations(())
NODE_TERMS = f"{POD}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def _qwen(engine_image: str | None = None) -> ModelDeployment:
    doc = _doc("modeldeployment-qwen72b.yaml", uid="md-uid")
    if engine_image is not None:
        doc["spec"]["engine"]["image"] = engine_image
    return ModelDeployment.model_validate(doc)


def _qwen_tolerating(*tolerations: dict[str, Any]) -> ModelDeployment:
    doc = _doc("modeldeployment-qwen72b.yaml", uid="md-uid")
    doc["spec"]["pool"]["tolerations"] = list(tolerations)
    return ModelDeployment.model_validate(doc)


def _tiny() -> ModelDeployment:
    return ModelDeployment.model_validate(_doc("local/modeldeployment-tiny.yaml", uid="md-uid"))


def _tenant(name: str, i: int, **spec: Any) -> Tenant:
    doc = _doc(f"tenant-{name}.yaml", uid=f"uid-{name}", creationTimestamp=f"2026-01-01T00:00:0{i}Z")
    doc["spec"].update(spec)
    return Tenant.model_validate(doc)


def _qwen_tenants() -> list[Tenant]:
    return [_tenant(n, i) for i, n in enumerate(("bank", "saas", "startup-a", "startup-b"))]


def _children(md: ModelDeployment, tenants: list[Tenant], monitoring: bool = False) -> list[dict[str, Any]]:
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    return build_desired_children(md, capacity, tenants, decisions, KEYS, IMAGES, monitoring)


def _by_kind_name(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


SHARED = {
    ("ConfigMap", "qwen72b-tenants"),
    ("Secret", "qwen72b-keys"),
    ("Deployment", "qwen72b-gateway"),
    ("Service", "qwen72b-gateway"),
    ("Service", "qwen72b-gateway-metrics"),
    ("PodDisruptionBudget", "qwen72b-gateway"),
    ("NetworkPolicy", "qwen72b-gateway"),
    ("StatefulSet", "qwen72b-engine"),
    ("Service", "qwen72b-engine"),
    ("PodDisruptionBudget", "qwen72b-engine"),
    ("NetworkPolicy", "qwen72b-engine"),
}
BANK_POOL = {
    (kind, "qwen72b-dedicated-bank-engine")
    for kind in ("StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy")
}
MONITORS = {("ServiceMonitor", "qwen72b-gateway"), ("PodMonitor", "qwen72b-engines")}


@pytest.mark.parametrize(
    ("tenants", "monitoring", "expected"),
    [
        pytest.param([], False, SHARED, id="no-tenants-still-serves-the-shared-pool"),
        pytest.param(_qwen_tenants(), False, SHARED | BANK_POOL, id="dedicated-tenant-gets-its-own-pool"),
        pytest.param(_qwen_tenants(), True, SHARED | BANK_POOL | MONITORS, id="monitors-when-served"),
        pytest.param(
            [_tenant("bank", 0, kvQuota={"hbm": 10**12})],  # more tokens than a replica holds
            False,
            SHARED,
            id="rejected-dedicated-tenant-leaves-no-pool",
        ),
    ],
)
def test_children(tenants: list[Tenant], monitoring: bool, expected: set[tuple[str, str]]) -> None:
    children = _children(_qwen(), tenants, monitoring)
    assert set(_by_kind_name(children)) == expected
    assert len(children) == len(expected)  # no duplicates
    for child in children:
        assert child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["labels"]["kvfleet.io/model-deployment"] == "qwen72b"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param(
            ("StatefulSet", "qwen72b-engine"),
            {
                "metadata.ownerReferences[0].kind": "ModelDeployment",
                "metadata.ownerReferences[0].uid": "md-uid",
                "spec.replicas": 2,
                f"{POD}.nodeSelector": {
                    "kvfleet.io/gpu-pool": "shared",
                    "nvidia.com/gpu.product": "NVIDIA-H200",
                },
                f"{POD}.tolerations": [GPU_TOLERATION, *NODE_LOSS],
                f"{POD}.affinity": MISSING,
                f"{POD}.containers[0].image": "engine:default",
                "spec.volumeClaimTemplates[0].spec.storageClassName": "local-nvme",
            },
            id="shared-pool-on-the-shared-gpu-nodes",
        ),
        pytest.param(
            ("StatefulSet", "qwen72b-dedicated-bank-engine"),
            {
                "metadata.ownerReferences[0].kind": "Tenant",
                "metadata.ownerReferences[0].uid": "uid-bank",
                "spec.replicas": 1,
                # The shared pool's label is dropped: a dedicated group is not the shared pool.
                f"{POD}.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                f"{POD}.tolerations": [
                    GPU_TOLERATION,
                    # No effect: the group's NoSchedule and NoExecute taints alike.
                    {"key": "kvfleet.io/gpu-group", "operator": "Equal", "value": "bank-h200"},
                    *NODE_LOSS,
                ],
                NODE_TERMS: [
                    {
                        "matchExpressions": [
                            {"key": "kvfleet.io/gpu-group", "operator": "In", "values": ["bank-h200"]}
                        ]
                    }
                ],
            },
            id="dedicated-pool-pinned-to-its-gpu-group",
        ),
        pytest.param(
            ("Deployment", "qwen72b-gateway"),
            {
                "spec.replicas": 2,
                f"{POD}.containers[0].image": "gateway:default",
                f"{POD}.containers[0].resources": {
                    "requests": {"cpu": "500m", "memory": "512Mi"},
                    "limits": {"memory": "1Gi"},
                },
            },
            id="gateway-resources-from-the-spec",
        ),
    ],
)
def test_child_fields(key: tuple[str, str], expected: dict[str, Any]) -> None:
    child = _by_kind_name(_children(_qwen(), _qwen_tenants()))[key]
    assert {path: field_at(child, path) for path in expected} == expected


@pytest.mark.parametrize(
    ("md", "expected"),
    [
        pytest.param(
            _tiny(),
            {
                f"{POD}.nodeSelector": MISSING,  # a CPU pool goes anywhere
                f"{POD}.tolerations": NODE_LOSS,
                f"{POD}.volumes[4].persistentVolumeClaim": {"claimName": "tiny-llama", "readOnly": True},
                "spec.volumeClaimTemplates": MISSING,
            },
            id="cpu-pool-no-gpu-placement",
        ),
        pytest.param(
            _qwen(engine_image="engine:pinned"),
            {f"{POD}.containers[0].image": "engine:pinned"},
            id="engine-image-override",
        ),
        pytest.param(
            _qwen_tolerating({"operator": "Exists"}),
            {
                f"{POD}.tolerations": [{"key": "", "operator": "Exists", "value": ""}],
                NODE_TERMS: [
                    {"matchExpressions": [{"key": "kvfleet.io/gpu-group", "operator": "DoesNotExist"}]}
                ],
            },
            id="wildcard-toleration-never-reaches-a-dedicated-gpu-group",
        ),
        pytest.param(
            _qwen_tolerating({"operator": "Exists", "effect": "NoSchedule"}),
            {
                NODE_TERMS: [
                    {"matchExpressions": [{"key": "kvfleet.io/gpu-group", "operator": "DoesNotExist"}]}
                ]
            },
            id="wildcard-of-one-effect-too",
        ),
    ],
)
def test_shared_pool_placement(md: ModelDeployment, expected: dict[str, Any]) -> None:
    name = str(md.metadata["name"])
    sts = _by_kind_name(_children(md, []))[("StatefulSet", f"{name}-engine")]
    assert {path: field_at(sts, path) for path in expected} == expected


def test_config_map_carries_the_tenant_table_of_admitted_tenants_and_their_pools() -> None:
    md, tenants = _qwen(), _qwen_tenants()
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    cm = _by_kind_name(_children(md, tenants))[("ConfigMap", "qwen72b-tenants")]
    table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
    assert set(table.tenants) == {"bank", "saas", "startup-a", "startup-b"}
    assert set(table.pools) == {"shared", "dedicated-bank"}
    assert table.pools["shared"].endpoints == [
        f"http://qwen72b-engine-{i}.qwen72b-engine.llm.svc:{ENGINE_PORT}" for i in range(2)
    ]
    assert table.pools["dedicated-bank"].dedicated_to == "bank"
    # The same table the tenant-table builder renders, byte for byte.
    rebuilt = build_config_map(md, build_tenant_table(md, capacity, tenants, decisions, _endpoints(table)))
    assert rebuilt == cm


def _endpoints(table: TenantTable) -> dict[str, PoolEndpoints]:
    return {name: PoolEndpoints(tuple(pool.endpoints)) for name, pool in table.pools.items()}


def test_keys_secret_holds_the_key_file_encoded_as_the_server_stores_it() -> None:
    secret = build_keys_secret(_qwen(), KEYS)
    assert secret["type"] == "Opaque"
    assert "stringData" not in secret  # the server stores data: stringData would show as drift forever
    assert KeyFile.model_validate_json(base64.b64decode(secret["data"]["keys.json"])) == KEYS
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "md-uid"


@pytest.mark.parametrize(
    ("md", "expected"),
    [
        pytest.param(_qwen(), f"http://qwen72b-gateway.llm.svc:{GATEWAY_PORT}/v1", id="qwen"),
        pytest.param(_tiny(), f"http://tiny-gateway.kvfleet-demo.svc:{GATEWAY_PORT}/v1", id="tiny"),
    ],
)
def test_endpoint(md: ModelDeployment, expected: str) -> None:
    assert compute_endpoint(md, IMAGES) == expected


def test_building_twice_gives_equal_objects_and_leaves_the_inputs_alone() -> None:
    md, tenants = _qwen(), _qwen_tenants()
    before = (copy.deepcopy(md.model_dump()), [copy.deepcopy(t.model_dump()) for t in tenants])
    assert _children(md, tenants, True) == _children(md, tenants, True)
    assert (md.model_dump(), [t.model_dump() for t in tenants]) == before
