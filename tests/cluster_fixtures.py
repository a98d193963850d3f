"""pytest plugin: the real local control plane and Prometheus as fixtures.

Registered from ``tests/conftest.py`` (``pytest_plugins``). Binaries come from ``hack/build-cluster.sh``
(see ``hack/devcluster``); when one is missing the fixture calls ``missing_component`` (fails naming it;
skips only with ``KVFLEET_ALLOW_MISSING=1``).

* ``api_cluster`` (session): etcd + kube-apiserver. ``full_cluster`` (session): plus controller manager,
  scheduler and kwok with the fake GPU nodes of ``DEFAULT_LAYOUT``. Both return the same
  :class:`devcluster.ControlPlane` (``kubeconfig``, ``server``, ``api_client()``, ``layout``, ``env()``,
  ``request()``); ``full_cluster`` extends a running ``api_cluster`` instead of starting a second one, so a
  test run starts etcd and the API server at most once.
* ``prometheus`` (function): a factory ``prometheus(config) -> PrometheusServer``; every server it
  started is stopped after the test.
* ``keda`` (module): KEDA's operator and metrics API server on the full plane (:mod:`devcluster.keda`),
  stopped with its CRDs after the module: only the modules that ask for it pay its start (seconds).

``KVFLEET_CLUSTER_TIMEOUT`` (seconds, default 180) bounds each readiness wait.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from devcluster import (
    BUILD_COMMAND,
    ControlPlane,
    PrometheusServer,
    Tier,
    extend_to_full,
    missing_binaries,
    start_control_plane,
    start_prometheus,
)
from devcluster.binaries import API_TIER_BINARIES, FULL_TIER_BINARIES, PROMETHEUS_COMMAND
from devcluster.keda import KEDA_BUILD_COMMAND, Keda, missing_keda, start_keda

from components import missing_component

CLUSTER_TIMEOUT = float(os.environ.get("KVFLEET_CLUSTER_TIMEOUT", "180"))


class _SessionControlPlane:
    """Starts the session's one control plane lazily, extends it to ``full`` on demand, stops it once."""

    def __init__(self) -> None:
        self.plane: ControlPlane | None = None
        self.error: str | None = None

    def get(self, tier: Tier) -> ControlPlane:
        missing = missing_binaries(API_TIER_BINARIES if tier == "api" else FULL_TIER_BINARIES)
        if missing:
            missing_component(f"Kubernetes control plane binaries {', '.join(missing)}", BUILD_COMMAND)
        if self.error is not None:
            # A failed start is reported once per test, not retried (each try costs minutes).
            pytest.fail(self.error, pytrace=False)
        try:
            if self.plane is None:
                self.plane = start_control_plane(tier, timeout=CLUSTER_TIMEOUT)
            elif tier == "full" and self.plane.tier == "api":
                extend_to_full(self.plane, timeout=CLUSTER_TIMEOUT)
        except (OSError, RuntimeError, TimeoutError) as exc:
            self.error = f"the {tier} control plane did not start: {exc}"
            pytest.fail(self.error, pytrace=False)
        return self.plane

    def close(self) -> None:
        if self.plane is not None:
            self.plane.stop()
            self.plane = None


@pytest.fixture(scope="session")
def _session_control_plane() -> Iterator[_SessionControlPlane]:
    holder = _SessionControlPlane()
    yield holder
    holder.close()


@pytest.fixture(scope="session")
def api_cluster(_session_control_plane: _SessionControlPlane) -> ControlPlane:
    """etcd + kube-apiserver (or the full plane when one already runs); admin kubeconfig included."""
    return _session_control_plane.get("api")


@pytest.fixture(scope="session")
def full_cluster(_session_control_plane: _SessionControlPlane) -> ControlPlane:
    """The full control plane with fake GPU nodes (``plane.layout``) Ready."""
    return _session_control_plane.get("full")


@pytest.fixture
def prometheus() -> Iterator[Callable[..., PrometheusServer]]:
    """Factory: ``prometheus(config: dict | str, rule_files=None) -> PrometheusServer`` (stopped after)."""
    missing = missing_binaries(("prometheus", "promtool"))
    if missing:
        missing_component(", ".join(missing), PROMETHEUS_COMMAND)
    started: list[PrometheusServer] = []

    def start(
        config: Mapping[str, Any] | str, rule_files: Mapping[str, str] | None = None
    ) -> PrometheusServer:
        server = start_prometheus(config, rule_files=rule_files)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def keda(full_cluster: ControlPlane) -> Iterator[Keda]:
    """KEDA running against the session's full plane, its metrics API registered and Available."""
    missing = missing_keda()
    if missing:
        missing_component(", ".join(missing), KEDA_BUILD_COMMAND)
    try:
        running = start_keda(full_cluster, timeout=CLUSTER_TIMEOUT)
    except (OSError, RuntimeError, TimeoutError) as exc:
        pytest.fail(f"KEDA did not start: {exc}", pytrace=False)
    yield running
    running.stop()
