"""The fake GPU node layout of the local control plane, as plain data.

Tests and the demo read :data:`DEFAULT_LAYOUT` to know which nodes exist, how they are labelled and
tainted and how many GPUs each offers; :func:`build_node_manifest` turns one entry into the Node object
that kwok then keeps Ready. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Label every node of the shared GPU pool carries (value: the pool name).
GPU_POOL_LABEL = "kvfleet.io/gpu-pool"
#: Label (and taint key) of a dedicated GPU group (value: the group name).
GPU_GROUP_LABEL = "kvfleet.io/gpu-group"
#: The GPU type label NVIDIA's GPU feature discovery sets.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: The extended resource the NVIDIA device plugin advertises.
GPU_RESOURCE = "nvidia.com/gpu"
#: kwok manages exactly the nodes carrying this annotation (``--manage-nodes-with-annotation-selector``).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"


@dataclass(frozen=True)
class Taint:
    """One node taint (``key=value:effect``)."""

    key: str
    value: str
    effect: str = "NoSchedule"

    def to_manifest(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


@dataclass(frozen=True)
class FakeNode:
    """One kwok-managed node: its name, labels, taints and allocatable resources."""

    name: str
    labels: Mapping[str, str]
    gpus: int
    taints: tuple[Taint, ...] = ()
    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"


@dataclass(frozen=True)
class NodeLayout:
    """All fake nodes of the cluster, grouped as the operator sees them."""

    shared_pool: tuple[FakeNode, ...]
    dedicated_groups: Mapping[str, tuple[FakeNode, ...]] = field(default_factory=dict)

    @property
    def nodes(self) -> tuple[FakeNode, ...]:
        """Every node, shared pool first."""
        out = list(self.shared_pool)
        for group in self.dedicated_groups.values():
            out.extend(group)
        return tuple(out)

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.nodes)

    @property
    def total_gpus(self) -> int:
        return sum(node.gpus for node in self.nodes)


def build_layout(
    *,
    shared_nodes: int = 4,
    gpus_per_node: int = 8,
    gpu_product: str = "NVIDIA-H200",
    pool_name: str = "shared",
    dedicated: Mapping[str, int] | None = None,
) -> NodeLayout:
    """A shared pool of ``shared_nodes`` x ``gpus_per_node`` GPUs plus tainted dedicated groups.

    ``dedicated`` maps a group name to its node count (default: ``{"bank-h200": 2}``). Shared nodes carry
    ``kvfleet.io/gpu-pool=<pool_name>``; a dedicated group's nodes carry ``kvfleet.io/gpu-group=<group>``
    and the taint ``kvfleet.io/gpu-group=<group>:NoSchedule``, so only pods tolerating it land there.
    """
    groups = {"bank-h200": 2} if dedicated is None else dict(dedicated)

    def base_labels(name: str) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            GPU_PRODUCT_LABEL: gpu_product,
            "nvidia.com/gpu.count": str(gpus_per_node),
        }

    shared = tuple(
        FakeNode(
            name=f"gpu-{pool_name}-{i}",
            labels={**base_labels(f"gpu-{pool_name}-{i}"), GPU_POOL_LABEL: pool_name},
            gpus=gpus_per_node,
        )
        for i in range(shared_nodes)
    )
    dedicated_groups = {
        group: tuple(
            FakeNode(
                name=f"gpu-{group}-{i}",
                labels={**base_labels(f"gpu-{group}-{i}"), GPU_GROUP_LABEL: group},
                gpus=gpus_per_node,
                taints=(Taint(GPU_GROUP_LABEL, group),),
            )
            for i in range(count)
        )
        for group, count in groups.items()
    }
    return NodeLayout(shared_pool=shared, dedicated_groups=dedicated_groups)


#: 4 shared nodes x 8 H200 (``kvfleet.io/gpu-pool=shared``) + the tainted 2-node group ``bank-h200``.
DEFAULT_LAYOUT = build_layout()


def build_node_manifest(node: FakeNode) -> dict[str, Any]:
    """The Node object for ``node``: annotated for kwok, with capacity = allocatable in its status.

    The API server accepts a Node's status on create (as for a self-registering kubelet); kwok's
    node-initialize stage keeps the given capacity and marks the node Ready.
    """
    resources = {
        "cpu": node.cpu,
        "memory": node.memory,
        "pods": node.pods,
        GPU_RESOURCE: str(node.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": dict(node.labels),
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE},
        },
        "spec": {"taints": [t.to_manifest() for t in node.taints]} if node.taints else {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }
