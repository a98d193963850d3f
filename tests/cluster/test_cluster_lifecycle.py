"""A control plane stops cleanly: no process, listening port or folder survives ``stop()``."""

from __future__ import annotations

from devcluster import missing_binaries, start_control_plane
from devcluster.binaries import API_TIER_BINARIES, BUILD_COMMAND
from devcluster.processes import port_is_listening

from components import missing_component


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_api_tier_starts_ready_and_stops_without_leftovers() -> None:
    missing = missing_binaries(API_TIER_BINARIES)
    if missing:
        missing_component(", ".join(missing), BUILD_COMMAND)
    plane = start_control_plane("api", timeout=180)
    try:
        assert plane.is_ready()
        assert plane.kubeconfig.is_file() and (plane.kubeconfig.stat().st_mode & 0o077) == 0
        procs = list(plane.processes)
        ports = [_port(plane.server), _port(plane.etcd_url)]
        assert all(port_is_listening(p) for p in ports)
    finally:
        plane.stop()
    assert not any(p.alive() for p in procs)
    assert not any(port_is_listening(p) for p in ports)
    assert not plane.workdir.exists()
