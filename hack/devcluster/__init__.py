"""A real local Kubernetes control plane (and Prometheus) for kvfleet's tests and demo.

Binaries come from ``hack/build-cluster.sh`` (cache: ``$KVFLEET_CACHE/bin``, default
``~/.cache/kvfleet/bin``). Use :func:`start_control_plane` / :meth:`ControlPlane.stop` from Python,
the pytest fixtures in ``tests/cluster_fixtures.py``, or the CLI ``python -m devcluster up|down|status|env``
(with ``hack`` on ``PYTHONPATH``; ``up --tier node`` adds a real node, :mod:`devcluster.node`).
"""

from __future__ import annotations

from .binaries import BUILD_COMMAND, bin_dir, cache_dir, find_binary, missing_binaries
from .cluster import ControlPlane, Tier, build_kubeconfig, extend_to_full, start_control_plane
from .layout import (
    DEFAULT_LAYOUT,
    GPU_GROUP_LABEL,
    GPU_POOL_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    FakeNode,
    NodeLayout,
    Taint,
    build_layout,
    build_node_manifest,
)
from .node import NODE_NAME, RealNode, missing_node_components
from .prometheus import PrometheusServer, build_scrape_config, start_prometheus

__all__ = [
    "BUILD_COMMAND",
    "DEFAULT_LAYOUT",
    "GPU_GROUP_LABEL",
    "GPU_POOL_LABEL",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "NODE_NAME",
    "ControlPlane",
    "FakeNode",
    "NodeLayout",
    "PrometheusServer",
    "RealNode",
    "Taint",
    "Tier",
    "bin_dir",
    "build_kubeconfig",
    "build_layout",
    "build_node_manifest",
    "build_scrape_config",
    "cache_dir",
    "extend_to_full",
    "find_binary",
    "missing_binaries",
    "missing_node_components",
    "start_control_plane",
    "start_prometheus",
]
