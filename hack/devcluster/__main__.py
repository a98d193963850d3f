"""``python -m devcluster up|down|status|env|bench|preload-images`` (run with ``hack`` on ``PYTHONPATH``).

``up [--tier api|full|node] [--keda]`` starts a control plane whose processes outlive the command (with
``--keda``, KEDA's operator and metrics API server against it: :mod:`devcluster.keda`), records it in
``$KVFLEET_CACHE/devcluster/state.json`` and copies its admin kubeconfig to
``$KVFLEET_CACHE/devcluster/kubeconfig``; ``env`` prints ``export KUBECONFIG=... PATH=...`` for a shell
(``eval "$(python -m devcluster env)"``); ``status`` says what runs; ``down`` kills every process group
and removes the cluster's folder; ``bench`` times repeated starts; ``preload-images`` imports the images
``make images`` built last into the real node's containerd store before the node first starts (as root).
Exit codes: 0 success, 1 failure, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .binaries import BUILD_COMMAND, bin_dir, cache_dir, missing_binaries
from .binaries import FULL_TIER_BINARIES as FULL
from .cluster import ControlPlane, start_control_plane
from .keda import KEDA_BUILD_COMMAND, missing_keda, start_keda
from .node import missing_node_components, preload_images


def _state_file() -> Path:
    return cache_dir() / "devcluster" / "state.json"


def stable_kubeconfig() -> Path:
    """Where ``up`` copies the admin kubeconfig: ``$KVFLEET_CACHE/devcluster/kubeconfig``."""
    return _state_file().parent / "kubeconfig"


def _load() -> ControlPlane | None:
    path = _state_file()
    if not path.is_file():
        return None
    return ControlPlane.from_state(json.loads(path.read_text()))


def _up(args: argparse.Namespace) -> int:
    existing = _load()
    if existing is not None and existing.alive():
        print(f"already running ({existing.tier}): {existing.server}; kubeconfig {existing.kubeconfig}")
        return 0
    if existing is not None:
        existing.stop()
    missing = missing_binaries(FULL if args.tier in ("full", "node") else FULL[:2])
    if args.tier == "node":
        missing += missing_node_components()
    if missing:
        print(f"missing binaries: {', '.join(missing)}; build them with {BUILD_COMMAND}", file=sys.stderr)
        return 1
    if args.keda and args.tier == "api":
        print("--keda needs --tier full or node (the HPA controller)", file=sys.stderr)
        return 2
    if args.keda and missing_keda():
        print(f"missing: {', '.join(missing_keda())}; build them with {KEDA_BUILD_COMMAND}", file=sys.stderr)
        return 1
    state_dir = _state_file().parent
    state_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="cluster-", dir=state_dir))
    plane = start_control_plane(args.tier, workdir=workdir, timeout=args.timeout)
    if args.keda:
        try:
            keda = start_keda(plane, timeout=args.timeout, workdir=workdir / "keda")
        except BaseException:
            plane.stop()
            raise
        # `down` stops them with the rest (the whole cluster goes, so its APIService does not matter).
        plane.processes.extend(keda.processes)
        plane.started_in["keda"] = keda.started_in
    # Processes run in their own sessions; drop the Popen handles so nothing waits on them at exit.
    for proc in plane.processes:
        proc.popen = None
    _state_file().write_text(json.dumps(plane.to_state(), indent=2))
    # A stable path for scripts and the demo; the cluster's own copy moves with every `up`.
    stable_kubeconfig().write_bytes(plane.kubeconfig.read_bytes())
    stable_kubeconfig().chmod(0o600)
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in plane.started_in.items())
    print(f"up ({plane.tier}; {timings}): {plane.server}")
    print(f"kubeconfig: {stable_kubeconfig()}")
    print('eval "$(PYTHONPATH=hack .venv/bin/python -m devcluster env)" to use kubectl and helm')
    return 0


def _preload_images(_: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="preload-") as workdir:
        try:
            seconds = preload_images(Path(workdir))
        except (OSError, RuntimeError, TimeoutError) as exc:
            print(f"preload-images: {exc}", file=sys.stderr)
            return 1
    print("preload-images: " + ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items()))
    return 0


def _down(_: argparse.Namespace) -> int:
    plane = _load()
    if plane is None:
        print("not running")
        return 0
    plane.stop()
    _state_file().unlink(missing_ok=True)
    stable_kubeconfig().unlink(missing_ok=True)
    print("stopped")
    return 0


def _status(_: argparse.Namespace) -> int:
    plane = _load()
    if plane is None:
        print("not running")
        return 1
    for proc in plane.processes:
        print(f"{proc.name:26} pid {proc.pid:7} {'running' if proc.alive() else 'DEAD'}  log {proc.log_path}")
    ready = plane.is_ready()
    print(f"tier {plane.tier}; {plane.server} {'ready' if ready else 'NOT ready'}")
    print(f"kubeconfig {plane.kubeconfig}")
    return 0 if ready and plane.alive() else 1


def _env(_: argparse.Namespace) -> int:
    plane = _load()
    if plane is None:
        print("not running", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={shlex.quote(str(stable_kubeconfig()))}")
    print(f'export PATH={shlex.quote(str(bin_dir()))}:"$PATH"')
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Start and stop a ``--tier`` plane ``--runs`` times; print each time to ready and the median."""
    seconds = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        plane = start_control_plane(args.tier, timeout=args.timeout)
        elapsed = time.monotonic() - started
        plane.stop()
        seconds.append(elapsed)
        print(f"run {run}: {args.tier} tier ready in {elapsed:.2f} s")
    print(
        f"{args.tier} tier start, {args.runs} runs: median {statistics.median(seconds):.2f} s "
        f"(min {min(seconds):.2f}, max {max(seconds):.2f})"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a control plane (detached)")
    up.add_argument("--tier", choices=["api", "full", "node"], default="full")
    up.add_argument("--keda", action="store_true", help="also start KEDA (operator, metrics API server)")
    up.add_argument("--timeout", type=float, default=float(os.environ.get("KVFLEET_CLUSTER_TIMEOUT", "180")))
    up.set_defaults(func=_up)
    sub.add_parser("down", help="stop it and remove its folder").set_defaults(func=_down)
    sub.add_parser("status", help="what runs (exit 1 when not ready)").set_defaults(func=_status)
    sub.add_parser("env", help="shell exports for kubectl/helm").set_defaults(func=_env)
    sub.add_parser(
        "preload-images", help="import the images make images built into the real node's containerd (root)"
    ).set_defaults(func=_preload_images)
    bench = sub.add_parser("bench", help="time --runs starts of a --tier plane (median)")
    bench.add_argument("--tier", choices=["api", "full", "node"], default="api")
    bench.add_argument("--runs", type=int, default=5)
    bench.add_argument("--timeout", type=float, default=180.0)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
