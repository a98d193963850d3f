"""hack/test.sh runs the provisioning steps in two lanes side by side (`# lane: build` / `# lane: fetch`),
each lane in order; a failed step fails the run unless the caller opted out (KVFLEET_ALLOW_MISSING=1).

Run for real on a copy of hack/test.sh with stand-in steps (each records when it ran) and stand-in lint
and pytest commands (they only print), so what is checked is the script's own scheduling and exit status.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

#: name -> (lane header, seconds it sleeps)
STEPS = {"10-cluster": ("# lane: build", 1.0), "20-engine": ("# lane: fetch", 0.3), "30-node": ("", 0.3)}
STEPS["40-images"] = ("# lane: fetch", 0.3)


def _tree(tmp_path: Path, fail: str = "") -> Path:
    hack = tmp_path / "hack"
    (hack / "provision.d").mkdir(parents=True)
    shutil.copy(REPO / "hack/test.sh", hack / "test.sh")
    (hack / "bootstrap.sh").write_text("#!/bin/sh\nexit 0\n")
    for name, (header, seconds) in STEPS.items():
        status = 7 if name == fail else 0
        (hack / "provision.d" / f"{name}.sh").write_text(
            f"#!/usr/bin/env bash\n{header}\necho {name} >>'{tmp_path}/order'; echo {name} started\n"
            f"sleep {seconds}\necho {name} >>'{tmp_path}/order'\nexit {status}\n"
        )
    venv = tmp_path / ".venv/bin"
    venv.mkdir(parents=True)
    for tool in ("ruff", "mypy", "lint-imports", "pytest"):
        (venv / tool).write_text(f'#!/bin/sh\necho "{tool} ran"\n')
    for script in (*hack.rglob("*.sh"), *venv.iterdir()):
        script.chmod(0o755)
    return tmp_path


def _run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "KVFLEET_ALLOW_MISSING"} | env
    return subprocess.run(
        ["bash", str(root / "hack/test.sh")],
        check=False,
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


def test_the_two_lanes_run_side_by_side_each_in_order(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    done = _run(root)
    assert done.returncode == 0, done.stderr
    order = (root / "order").read_text().split()
    # Each step appears twice (start, end). The fetch lane finished both its steps while the build lane's
    # first step still ran; the build lane's second (no header: build) started only after its first ended.
    assert (
        order.index("20-engine") < order.index("40-images") < len(order) - 1 - order[::-1].index("10-cluster")
    )
    assert len(order) - 1 - order[::-1].index("10-cluster") < order.index("30-node")
    assert "[fetch] 20-engine started" in done.stdout and "[build] 30-node started" in done.stdout
    assert "<== hack/provision.d/10-cluster.sh: done in" in done.stdout
    assert done.stdout.index("==> pytest") > done.stdout.index("<== hack/provision.d/30-node.sh")


def test_a_failed_step_fails_the_run_and_stops_its_lane(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="20-engine")
    done = _run(root)
    assert done.returncode == 1
    assert "<== hack/provision.d/20-engine.sh: failed (exit 7)" in done.stdout
    assert "make test: hack/provision.d/20-engine.sh failed" in done.stderr
    order = (root / "order").read_text().split()
    assert "40-images" not in order  # the rest of its lane may need what it makes
    assert "30-node" in order  # the other lane went on
    assert "pytest ran" not in done.stdout


def test_opting_out_continues_past_a_failed_step(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="20-engine")
    done = _run(root, KVFLEET_ALLOW_MISSING="1")
    assert done.returncode == 0, done.stderr
    assert "40-images" in (root / "order").read_text().split()
    assert "pytest ran" in done.stdout
    assert "not provisioned (KVFLEET_ALLOW_MISSING=1): hack/provision.d/20-engine.sh" in done.stderr
