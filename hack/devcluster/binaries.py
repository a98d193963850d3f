"""Where the control plane's binaries live: the cache ``hack/build-cluster.sh`` fills.

``KVFLEET_CACHE`` (default ``~/.cache/kvfleet``) holds ``bin/`` (Go binaries) and ``kwok-stages/``
(kwok's stage configs); Prometheus and promtool come from ``PATH`` (Debian's ``prometheus`` package).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: The command that provides every binary below.
BUILD_COMMAND = "hack/build-cluster.sh"
PROMETHEUS_COMMAND = "hack/build-cluster.sh (apt-get install prometheus)"

API_TIER_BINARIES = ("etcd", "kube-apiserver")
FULL_TIER_BINARIES = (*API_TIER_BINARIES, "kube-controller-manager", "kube-scheduler", "kwok")
TOOL_BINARIES = ("kubectl", "helm")

#: kwok stage configs (relative to the stage folder) that make nodes Ready and pods Running fast.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", str(Path.home() / ".cache" / "kvfleet")))


def bin_dir() -> Path:
    return cache_dir() / "bin"


def kwok_stage_dir() -> Path:
    return cache_dir() / "kwok-stages"


def find_binary(name: str) -> Path | None:
    """The cached binary ``name``, else one on ``PATH``, else ``None``."""
    cached = bin_dir() / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    found = shutil.which(name)
    return Path(found) if found else None


def missing_binaries(names: tuple[str, ...]) -> list[str]:
    """The names among ``names`` that :func:`find_binary` cannot find."""
    return [name for name in names if find_binary(name) is None]


def require_binary(name: str) -> Path:
    path = find_binary(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found in {bin_dir()} or PATH; build it with {BUILD_COMMAND}")
    return path


def kwok_stage_files() -> list[Path]:
    """The stage configs kwok is started with; those absent from the cache are left out."""
    return [kwok_stage_dir() / rel for rel in KWOK_STAGES if (kwok_stage_dir() / rel).is_file()]
