"""The README's first command, end to end: ``hack/demo.py`` (what ``make demo`` runs after provisioning).

Runs the real thing: control plane, chart, operator, vLLM-CPU + LMCache + plugin, gateway, Prometheus.
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

from conftest import missing_component

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


def _demo(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "hack"), "PYTHONUNBUFFERED": "1"}
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
    "kvfleet-cluster-",  # etcd, kube-*, kwok (their work folder)
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


def _leftovers(before: dict[str, str]) -> list[str]:
    """Such processes that were not there before the demo started (other tests' servers are)."""
    time.sleep(2)  # let the last process groups finish exiting
    return [f"{pid}: {cmd}" for pid, cmd in _our_processes().items() if pid not in before]


def test_demo_runs_the_whole_system_and_reports(tmp_path: Path) -> None:
    _require_components()
    report_path = tmp_path / "report.json"
    before = _our_processes()
    demo = _demo("--report", str(report_path))
    out, _ = demo.communicate(timeout=1500)
    assert demo.returncode == 0, out[-6000:]
    report: dict[str, Any] = json.loads(report_path.read_text())

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


@pytest.mark.parametrize("interrupt_after", ["applying examples/local/", "waiting for vLLM-CPU"])
def test_ctrl_c_at_any_point_leaves_nothing_behind(interrupt_after: str) -> None:
    _require_components()
    before = _our_processes()
    demo = _demo()
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
