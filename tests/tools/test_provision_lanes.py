"""hack/provision.sh, the one provisioning driver of `make test` (hack/test.sh) and `make demo`
(hack/demo.sh): the steps run in lanes side by side (`# lane: build` / `# lane: fetch`), each lane in order;
a failed step stops its lane and fails the run unless the caller opted out (KVFLEET_ALLOW_MISSING=1), and
the demo's option lets the node and images steps fail outside CI. What it prints is one line per step start
(what the step does, how long it usually takes) and end, a progress line, and on failure the step's log
path and last lines, never the steps' own output; hack/test.sh runs the static checks as a third lane.

Run for real on copies of the scripts with stand-in steps (each records when it ran and prints noise) and
stand-in tools (they only print), so what is checked is the scripts' own scheduling, output and exit status.
benchmarks/ci_cold.py reads the figures back from a time-stamped log of such a run.
"""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from ci_cold import figures_of, go_builds_in_step_logs, parse_log  # noqa: E402

#: name -> (lane header, seconds it sleeps)
STEPS = {
    "10-cluster": ("# lane: build", 1.0),
    "20-engine": ("# lane: fetch", 0.3),
    "30-node": ("", 0.3),  # no lane line: build
    "40-images": ("# lane: fetch", 0.3),
}
NOISE_LINES = 50  # more than the tail printed on failure


def _tree(
    tmp_path: Path,
    fail: str = "",
    lint_fails: bool = False,
    late_s: float | None = None,
    last_words: str = "",
) -> Path:
    """A copy of the scripts under test with stand-in steps and tools; `fail` names a step that exits 7,
    after printing `last_words`; `late_s` makes the late steps (30-node, 40-images) take that long."""
    hack = tmp_path / "hack"
    (hack / "provision.d").mkdir(parents=True)
    for script in ("test.sh", "demo.sh", "provision.sh", "lint.sh"):
        shutil.copy(REPO / "hack" / script, hack / script)
    (hack / "bootstrap.sh").write_text("#!/bin/sh\nexit 0\n")
    for name, (header, usual_s) in STEPS.items():
        status = 7 if name == fail else 0
        seconds = late_s if late_s is not None and name in ("30-node", "40-images") else usual_s
        (hack / "provision.d" / f"{name}.sh").write_text(
            f"#!/usr/bin/env bash\n{header}\n# what: makes {name}\n# takes: ~{seconds} s here\n"
            f"echo '{name} start' $(date +%s.%N) >>'{tmp_path}/order'\n"
            f"for i in $(seq {NOISE_LINES}); do echo '{name} noise' $i; done\n"
            f"echo '[build-cluster 10:00:00] {name}-group: done in 3 s'\n"
            f"sleep {seconds}\necho '{name} end' $(date +%s.%N) >>'{tmp_path}/order'\n"
            + (f"echo '{last_words}'\n" if status and last_words else "")
            + f"exit {status}\n"
        )
    venv = tmp_path / ".venv/bin"
    venv.mkdir(parents=True)
    for tool in ("ruff", "mypy", "lint-imports", "pytest", "kvfleet"):
        (venv / tool).write_text(f'#!/bin/sh\necho "{tool} ran" >>\'{tmp_path}/tools\'\necho "{tool} ran"\n')
    (venv / "pytest").write_text(
        f"#!/bin/sh\necho \"pytest start $(date +%s.%N)\" >>'{tmp_path}/order'\necho 'pytest ran'\n"
    )
    (venv / "mypy").write_text(
        f"#!/bin/sh\necho \"lint start $(date +%s.%N)\" >>'{tmp_path}/order'\n"
        + ("echo 'runtime/x.py:1: error: bad'; exit 1\n" if lint_fails else "echo 'mypy ran'\n")
    )
    (venv / "kvfleet").write_text(
        "#!/bin/sh\nprintf 'model  x\\ntokens per replica          5,808,672\\n"
        "sessions of 131,072 tokens  44 per replica, 88 in pool\\n'\n"
    )
    (venv / "python").write_text('#!/bin/sh\necho "demo.py ran: $*"\n')
    for script in (*hack.rglob("*.sh"), *venv.iterdir()):
        script.chmod(0o755)
    return tmp_path


#: What the scripts under test must not inherit from the run that runs these tests. Under `make test`,
#: KVFLEET_PROVISION_STATE names the real driver's state folder: a fake provision.sh started with it wipes
#: the real steps' outcomes and writes its fake ones there (stop 30's CI: 35-keda's outcome was gone, and
#: the KEDA test waited for it until its hour ran out).
INHERITED_NOT = ("KVFLEET_ALLOW_MISSING", "CI", "KVFLEET_PROGRESS_INTERVAL", "KVFLEET_PROVISION_STATE")


def _env(root: Path, **env: str) -> dict[str, str]:
    drop = INHERITED_NOT
    return (
        {k: v for k, v in os.environ.items() if k not in drop} | {"KVFLEET_CACHE": str(root / "cache")} | env
    )


def _run(root: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "hack" / script), *args],
        check=False,
        capture_output=True,
        text=True,
        env=_env(root, **env),
        timeout=60,
    )


def _order(root: Path) -> dict[str, float]:
    """'<step> start' / '<step> end' -> when."""
    return {
        " ".join(line.split()[:2]): float(line.split()[2])
        for line in (root / "order").read_text().splitlines()
    }


def test_the_lanes_run_side_by_side_each_in_order_one_line_per_step(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    done = _run(root, "provision.sh", KVFLEET_PROGRESS_INTERVAL="0.4")
    assert done.returncode == 0, done.stderr
    at = _order(root)
    # The fetch lane ran both its steps while the build lane's first still ran; each lane in order.
    assert at["20-engine end"] <= at["40-images start"] < at["10-cluster end"]
    assert at["10-cluster end"] <= at["30-node start"]
    lines = done.stdout.splitlines()
    starts = [line for line in lines if line.startswith("==> ")]
    ends = [line for line in lines if line.startswith("<== ")]
    assert len(starts) == len(ends) == len(STEPS)
    # A start line says what the step does and how long it usually takes; an end line how long it took.
    assert "==> hack/provision.d/20-engine.sh [fetch] makes 20-engine (~0.3 s here)" in starts
    assert "==> hack/provision.d/30-node.sh [build] makes 30-node (~0.3 s here)" in starts
    assert any(line.startswith("<== hack/provision.d/10-cluster.sh: done in ") for line in ends)
    # Not a terminal (a CI log): a progress line while steps run.
    assert any(line.startswith("[0:0") and "running: 10-cluster (" in line for line in lines)
    # Nothing else: the steps' own output, their timing lines too, is in their logs.
    assert "noise" not in done.stdout and "[build-cluster" not in done.stdout
    assert (
        "[build-cluster 10:00:00] 10-cluster-group: done in 3 s"
        in (root / "cache/logs/provision/10-cluster.log").read_text()
    )
    others = [line for line in lines if not line.startswith(("==> ", "<== ", "[0:"))]
    assert len(others) == 3, others  # the first lines (lanes, where the logs are; the disk) and the last
    assert others[0].startswith("provisioning: 4 steps in 2 lanes side by side (build: 10-cluster, 30-node;")
    assert re.fullmatch(
        rf"disk: [0-9.]+[KMGT]? free where kvfleet's caches live \({root / 'cache'}\); a new machine needs "
        r"about \d+ GB while it provisions, \d+ GB once provisioned",
        others[1],
    )
    assert others[2].startswith("provisioning: done in 0:0")
    log = (root / "cache/logs/provision/20-engine.log").read_text()
    assert f"20-engine noise {NOISE_LINES}" in log
    # A second run says how long each step took last time here.
    again = _run(root, "provision.sh")
    assert "; last time here 0 s)" in again.stdout


def test_a_failed_step_stops_its_lane_fails_the_run_and_shows_its_log(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="20-engine")
    state = tmp_path / "state"
    done = _run(root, "provision.sh", "--for", "make test", KVFLEET_PROVISION_STATE=str(state))
    assert done.returncode == 1
    # Each step's outcome as it ended, for whoever waits on one; a step its lane skipped failed too.
    outcomes = ["10-cluster.done", "20-engine.failed", "30-node.done", "40-images.failed"]
    assert sorted(p.name for p in state.iterdir()) == outcomes
    assert re.search(
        r"^<== hack/provision\.d/20-engine\.sh: failed \(exit 7\) after \d s$", done.stdout, re.M
    )
    at = _order(root)
    assert "40-images start" not in at  # the rest of its lane may need what it makes
    assert "    hack/provision.d/40-images.sh: not run (its lane stopped at the failure above)" in done.stdout
    assert "30-node end" in at  # the other lane went on
    log = root / "cache/logs/provision/20-engine.log"
    assert f"    its output: {log}" in done.stdout
    # Once every lane has ended: the log's path, its last 30 lines, and the command that reruns the step.
    assert f"make test: hack/provision.d/20-engine.sh failed; the last 30 lines of its output ({log}):" in (
        done.stderr
    )
    assert f"    | 20-engine noise {NOISE_LINES}\n" in done.stderr
    assert f"    | 20-engine noise {NOISE_LINES - 28}\n" in done.stderr
    assert f"    | 20-engine noise {NOISE_LINES - 29}\n" not in done.stderr
    assert "make test: fix that and rerun, or run 'bash hack/provision.d/20-engine.sh' alone." in done.stderr
    both = subprocess.run(
        ["bash", str(root / "hack/provision.sh")],
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(root),
        timeout=60,
    ).stdout
    assert both.index("    | 20-engine noise") > both.index("<== hack/provision.d/30-node.sh")


def test_a_step_that_filled_the_disk_is_told_so(tmp_path: Path) -> None:
    """pip, go and podman each say it their own way, but every one of them quotes the kernel's words."""
    root = _tree(tmp_path, fail="40-images", last_words="Error: writing blob: No space left on device")
    done = _run(root, "provision.sh", "--for", "make test")
    assert done.returncode == 1
    assert re.search(
        rf"^make test: the disk is full \([0-9.]+[KMGT]? free now where the caches live, {root / 'cache'}\): "
        r"a new machine needs about \d+ GB while it provisions, \d+ GB once provisioned\. Free some room, "
        r"or point KVFLEET_CACHE at a bigger disk\.$",
        done.stderr,
        re.M,
    )
    other = _run(_tree(tmp_path / "other", fail="40-images"), "provision.sh")
    assert other.returncode == 1 and "the disk is full" not in other.stderr


def test_opting_out_continues_past_a_failed_step(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="20-engine")
    failures = tmp_path / "failures"
    done = _run(root, "provision.sh", "--failures", str(failures), KVFLEET_ALLOW_MISSING="1")
    assert done.returncode == 0, done.stderr
    assert "40-images end" in _order(root)
    assert failures.read_text() == "hack/provision.d/20-engine.sh\n"
    assert "continuing without it because KVFLEET_ALLOW_MISSING=1" in done.stderr
    assert (
        "provisioning: done in 0:0" in done.stdout
        and "(without hack/provision.d/20-engine.sh)" in done.stdout
    )


def test_the_demo_goes_on_past_the_node_and_images_steps_outside_ci_only(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="30-node")
    done = _run(root, "demo.sh")
    assert done.returncode == 0, done.stderr
    assert "    30-node failed: the demo runs on local processes instead (its report says why)" in done.stdout
    assert "provisioning: done in 0:0" in done.stdout
    assert "(without hack/provision.d/30-node.sh)" in done.stdout
    assert done.stdout.rstrip().endswith("demo.py ran: hack/demo.py")
    # The whole output before the report: a line per step start and end, the first and last, one for
    # `kvfleet plan` (its table goes to a file) and one for the node's failure.
    assert len(done.stdout.splitlines()) <= 2 * len(STEPS) + 10
    plan = root / "cache/logs/kvfleet-plan.txt"
    assert (
        "==> kvfleet plan of examples/modeldeployment-qwen72b.yaml: KV for 5,808,672 tokens per replica,"
        f" 44 sessions of 131,072 tokens (the whole table: {plan})"
    ) in done.stdout
    assert "tokens per replica          5,808,672" in plan.read_text()
    # Under CI=true the same failure stops it.
    ci = _run(root, "demo.sh", CI="true")
    assert ci.returncode == 1
    assert "demo.py ran" not in ci.stdout
    assert "make demo: hack/provision.d/30-node.sh failed" in ci.stderr
    # And outside CI only the node and images steps may fail.
    engine = _run(_tree(tmp_path / "engine", fail="20-engine"), "demo.sh")
    assert engine.returncode == 1
    assert "demo.py ran" not in engine.stdout


def test_a_skipped_step_is_neither_run_nor_listed_and_the_demo_skips_keda(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    for name in ("25-keda-modules", "35-keda"):
        keda = root / f"hack/provision.d/{name}.sh"
        keda.write_text(
            f"#!/usr/bin/env bash\n# lane: build\necho '{name} start' $(date +%s.%N) >>'{tmp_path}/order'\n"
        )
        keda.chmod(0o755)
    done = _run(root, "provision.sh", "--skip", "30-node")
    assert done.returncode == 0, done.stderr
    assert "30-node start" not in _order(root) and "35-keda start" in _order(root)
    assert "provisioning: 5 steps in 2 lanes side by side (build: 10-cluster, 25-keda-modules, 35-keda;" in (
        done.stdout
    )
    (root / "order").unlink()
    demo = _run(root, "demo.sh")
    assert demo.returncode == 0, demo.stderr
    # KEDA serves only the autoscaling tests: `make demo` never waits for its modules or its build.
    assert "keda" not in demo.stdout and "keda" not in _order(root)
    assert "30-node start" in _order(root)


def test_make_test_lints_beside_provisioning_and_the_tests_and_a_lint_failure_fails_it(
    tmp_path: Path,
) -> None:
    root = _tree(tmp_path)
    done = _run(root, "test.sh")
    assert done.returncode == 0, done.stderr
    at = _order(root)
    # mypy reads what 20-engine installs: the lint lane starts after it, beside the rest.
    assert at["20-engine end"] <= at["lint start"] < at["10-cluster end"]
    assert "==> hack/lint.sh [lint] ruff check, ruff format --check, mypy --strict, import contracts" in (
        done.stdout
    )
    assert "mypy ran" not in done.stdout  # the checks' output is in the lint lane's log

    failing = _tree(tmp_path / "lint", lint_fails=True)
    for env in ({}, {"KVFLEET_ALLOW_MISSING": "1"}):  # opting out covers missing components, not lint
        done = _run(failing, "test.sh", **env)
        assert done.returncode == 1
        assert "<== hack/lint.sh: failed (exit 1) after" in done.stdout
        assert "    | runtime/x.py:1: error: bad" in done.stderr
        assert "pytest ran" in done.stdout  # beside the checks: their failure fails the run all the same
        assert "40-images end" in _order(failing)  # provisioning ran to its end all the same


def test_pytest_starts_beside_the_late_steps_and_their_failure_fails_the_run(tmp_path: Path) -> None:
    """pytest starts once 10-cluster and 20-engine have ended, beside the checks, while 30-node and
    40-images go on; the run waits for them after pytest, and one that failed fails the run although
    pytest passed (its tests fail or skip on their own: tests/provisioning_plugin.py)."""
    root = _tree(tmp_path, late_s=3.0)
    done = _run(root, "test.sh")
    assert done.returncode == 0, done.stderr
    at = _order(root)
    assert max(at["10-cluster end"], at["20-engine end"]) <= at["pytest start"]
    assert at["pytest start"] < min(at["30-node end"], at["40-images end"])
    assert "<== hack/provision.d/40-images.sh: done in" in done.stdout  # reported after pytest started

    failing = _tree(tmp_path / "late", fail="40-images", late_s=1.5)
    done = _run(failing, "test.sh")
    assert done.returncode == 1
    assert "pytest ran" in done.stdout
    assert "make test: hack/provision.d/40-images.sh failed" in done.stderr
    opted_out = _run(failing, "test.sh", KVFLEET_ALLOW_MISSING="1")
    assert opted_out.returncode == 0, opted_out.stderr
    assert "not provisioned (KVFLEET_ALLOW_MISSING=1): hack/provision.d/40-images.sh" in opted_out.stderr


def test_make_test_fails_on_a_failed_step_and_says_how_to_opt_out(tmp_path: Path) -> None:
    root = _tree(tmp_path, fail="20-engine")
    done = _run(root, "test.sh")
    assert done.returncode == 1
    assert "make test: hack/provision.d/20-engine.sh failed" in done.stderr
    assert "KVFLEET_ALLOW_MISSING=1 make test runs without what a failed step provisions" in done.stderr
    assert "pytest ran" not in done.stdout
    opted_out = _run(root, "test.sh", KVFLEET_ALLOW_MISSING="1")
    assert opted_out.returncode == 0, opted_out.stderr
    assert "pytest ran" in opted_out.stdout
    assert "not provisioned (KVFLEET_ALLOW_MISSING=1): hack/provision.d/20-engine.sh" in opted_out.stderr


def test_on_a_terminal_the_clock_is_one_line_rewritten_in_place(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        ["bash", str(root / "hack/provision.sh")],
        stdout=terminal,
        stderr=terminal,
        stdin=subprocess.DEVNULL,
        env=_env(root, TERM="dumb", KVFLEET_PROGRESS_INTERVAL="0.2"),
    )
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's last writer is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    assert proc.wait(timeout=30) == 0
    text = out.decode()
    # The clock: a line without a newline, rewritten in place ("\r" + erase line), every second; the
    # driver's own lines wipe it first. The interval of the log's progress lines does not apply.
    assert re.search(r"\r\x1b\[K\[0:0\d\] running: [^\r\n]*10-cluster \(0:0\d\)", text)
    assert not re.search(r"running: [^\r]*\n", text)  # the clock never ends a line of its own
    assert "\r\x1b[K<== hack/provision.d/10-cluster.sh: done in" in text
    assert "[build-cluster" not in text  # a terminal shows no timing lines


def test_ci_cold_reads_the_figures_back_from_a_log_of_make_test(tmp_path: Path) -> None:
    """benchmarks/ci_cold.py on a time-stamped log of hack/test.sh: a figure per step from its `<==` line,
    the lint lane's own time as lint_s, the Go timings, and the phases adding up to the total."""
    root = _tree(tmp_path)
    proc = subprocess.Popen(
        ["bash", str(root / "hack/test.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(root, KVFLEET_PROGRESS_INTERVAL="0.4"),
    )
    assert proc.stdout is not None
    log = [f"{time.strftime('%H:%M:%S')} {line}" for line in proc.stdout]  # as `ci_cold.py run` writes it
    assert proc.wait(timeout=60) == 0
    run = parse_log(log)
    assert set(run.steps) == {"cluster", "engine", "node", "images"}
    for name, seconds in run.steps.items():
        assert any(f"{name}.sh: done in {seconds} s" in line for line in log)
    assert run.go_builds == {}  # not in the output: in the steps' own logs, where ci_cold.py reads them
    assert go_builds_in_step_logs(root / "cache/logs/provision") == {f"{step}-group": 3 for step in STEPS}
    assert list(run.phases) == ["bootstrap", "provision", "tests"]
    assert sum(run.phases.values()) == run.total_s
    assert run.lint_lane_s is not None
    assert any(f"<== hack/lint.sh: done in {run.lint_lane_s} s" in line for line in log)
    figures = figures_of(run)
    assert figures["lint_s"].median == run.lint_lane_s
    assert figures["provision_cluster_s"].median == run.steps["cluster"]


def test_the_fake_runs_leave_the_real_drivers_state_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `make test` these tests run beside the real provisioning, whose state folder is in the
    environment: nothing a fake run does may touch it."""
    real = tmp_path / "real-state"
    real.mkdir()
    (real / "35-keda.done").touch()
    monkeypatch.setenv("KVFLEET_PROVISION_STATE", str(real))
    root = _tree(tmp_path / "fake")
    for script, args in (("provision.sh", ()), ("demo.sh", ()), ("test.sh", ())):
        _run(root, script, *args)
    assert sorted(p.name for p in real.iterdir()) == ["35-keda.done"]
