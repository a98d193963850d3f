"""Where the suite's time goes, and how two workers share it.

``tests/durations_plugin.py`` turns pytest's reports into a results file that benchmarks/results_format
reads and benchmarks/report.py renders (time per tier, slowest tests, slowest fixtures);
``tests/parallel_plugin.py`` decides which tests must stay on one pytest-xdist worker and which groups
start first; ``tests/provisioning_plugin.py`` makes the tests that need the late provisioning steps wait for
them when pytest starts beside provisioning.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

from durations_plugin import Durations, tier_of
from parallel_plugin import (
    REAL_NODE_GROUP,
    SHARED_ENGINE_GROUPS,
    group_of,
    recorded_seconds,
    start_order,
    strip_group,
)
from provisioning_plugin import step_log_tail, step_outcome, steps_needed, wait_for_steps

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import report  # noqa: E402
from results_format import Results  # noqa: E402

TODAY = datetime.date(2026, 12, 1)


def _session() -> Durations:
    d = Durations()
    d.add_report("tests/unit/test_a.py::test_fast", "setup", 0.01, "passed")
    d.add_report("tests/unit/test_a.py::test_fast", "call", 0.2, "passed")
    d.add_report("tests/unit/test_a.py::test_fast", "teardown", 0.01, "passed")
    d.add_report("tests/engine/test_e.py::test_slow[x]", "setup", 70.0, "passed")
    d.add_report("tests/engine/test_e.py::test_slow[x]", "call", 5.0, "failed")
    d.add_report("tests/engine/test_e.py::test_slow[x]", "teardown", 2.0, "passed")
    d.add_report("tests/cluster/test_c.py::test_mid", "call", 3.0, "passed")
    d.add_fixture_setups([("vllm_factory", "module", 69.0), ("tmp_path", "function", 0.001)])
    d.add_fixture_setups([("vllm_factory", "module", 71.0)])
    return d


def test_tiers_come_from_the_folder_under_tests() -> None:
    assert tier_of("tests/engine/test_x.py::test_y[a/b]") == "engine"
    assert tier_of("tests/unit/test_x.py::test_y") == "unit"
    assert tier_of("tests/test_top.py::test_y") == "other"


def test_a_session_becomes_a_results_file_the_report_renders() -> None:
    summary = _session().summary(wall_s=50.0, workers=2, command="make test", today=TODAY)
    results = Results.model_validate_json(json.dumps(summary))
    assert results.figure("tests").median == 3
    assert results.figure("engine_s").median == 77.0
    assert results.figure("unit_tests").median == 1
    assert results.figure("test_time_s").median == 80.2  # rounded to 0.1 s
    # Summed time exceeds the wall time when two workers ran side by side.
    assert results.figure("wall_s").median == 50.0
    details = results.details
    assert details["failed"] == ["tests/engine/test_e.py::test_slow[x]"]
    tests = details["tests_s"]
    assert isinstance(tests, dict)
    assert list(tests) == ["tests/engine/test_e.py::test_slow[x]", "tests/cluster/test_c.py::test_mid"]
    assert details["fixtures"] == {"vllm_factory (module)": {"setups": 2, "seconds": 140.0, "longest": 71.0}}
    page = report.render_test_durations({"test_durations": results})
    assert "| engine | 1 | 1 min 17 s |" in page
    assert "| `tests/engine/test_e.py::test_slow[x]` | 70.0 | 5.0 | 2.0 | 77.0 |" in page
    assert "| `vllm_factory (module)` | 2 | 140.0 | 71.0 |" in page


def test_xdist_group_suffixes_are_stripped_but_parameters_kept() -> None:
    assert strip_group("tests/e2e/test_x.py::test_y@real-node") == "tests/e2e/test_x.py::test_y"
    assert strip_group("tests/unit/test_x.py::test_y[a@b]") == "tests/unit/test_x.py::test_y[a@b]"
    assert strip_group("tests/unit/test_x.py::test_y[a@b]@g") == "tests/unit/test_x.py::test_y[a@b]"


def test_heavy_setups_stay_on_one_worker_and_unit_tests_run_anywhere() -> None:
    assert group_of("tests/unit/test_x.py::test_y", ["tmp_path"]) is None
    assert group_of("tests/e2e/test_real_node.py::test_y", []) == REAL_NODE_GROUP
    assert group_of("tests/e2e/test_demo.py::test_y", []) == REAL_NODE_GROUP
    # Every test that waits for the late provisioning steps is in that one group: one worker waits.
    assert group_of("tests/e2e/test_images.py::test_y", []) == REAL_NODE_GROUP
    assert group_of("tests/engine/test_a.py::test_y", ["vllm_server"]) == SHARED_ENGINE_GROUPS["vllm_server"]
    assert group_of("tests/engine/test_b.py::test_y", ["launched_engine"]) == "launched-engine"
    assert group_of("tests/engine/test_a.py::test_y", ["vllm_factory"]) == "tests/engine/test_a.py"
    assert group_of("tests/cluster/test_b.py::test_z", ["full_cluster"]) == "tests/cluster/test_b.py"


def test_the_longest_recorded_unit_of_work_starts_first_and_short_unit_tests_last() -> None:
    groups = {
        "tests/cluster/a.py::t1": "tests/cluster/a.py",
        "tests/cluster/a.py::t2": "tests/cluster/a.py",
        "tests/engine/b.py::t1": "tests/engine/b.py",
        "tests/unit/u.py::t1": None,
        "tests/unit/u.py::slow": None,
        "tests/e2e/c.py::t1": "tests/e2e/c.py",
    }
    seconds = {
        "tests/cluster/a.py::t1": 10.0,
        "tests/cluster/a.py::t2": 10.0,
        "tests/engine/b.py::t1": 90.0,
        "tests/unit/u.py::slow": 15.0,
    }
    rank = start_order(groups, seconds)
    order = sorted(groups, key=lambda n: rank[n])
    assert order == [
        "tests/engine/b.py::t1",
        "tests/cluster/a.py::t1",  # a group's tests stay together, in collection order
        "tests/cluster/a.py::t2",
        "tests/unit/u.py::slow",  # an ungrouped test is a unit of its own
        "tests/unit/u.py::t1",  # no record: after the recorded ones, in collection order
        "tests/e2e/c.py::t1",
    ]
    # Without a recorded run the collection order stands.
    rank = start_order(groups, {})
    assert sorted(groups, key=lambda n: rank[n]) == list(groups)


def test_the_keda_tests_start_after_everything_else_even_when_recorded_as_the_longest() -> None:
    groups = {
        "tests/cluster/test_keda_autoscaling.py::t1": "tests/cluster/test_keda_autoscaling.py",
        "tests/engine/b.py::t1": "tests/engine/b.py",
        "tests/unit/u.py::t1": None,
    }
    seconds = {"tests/cluster/test_keda_autoscaling.py::t1": 500.0, "tests/engine/b.py::t1": 90.0}
    rank = start_order(groups, seconds)
    assert sorted(groups, key=lambda n: rank[n]) == [
        "tests/engine/b.py::t1",
        "tests/unit/u.py::t1",  # unrecorded, still before the step the build lane ends with
        "tests/cluster/test_keda_autoscaling.py::t1",
    ]


def test_recorded_seconds_read_a_results_file_and_tolerate_none(tmp_path: Path) -> None:
    assert recorded_seconds(tmp_path / "absent.json") == {}
    summary = _session().summary(wall_s=1.0, workers=0, command="pytest", today=TODAY)
    path = tmp_path / "test_durations.json"
    path.write_text(json.dumps(summary))
    assert recorded_seconds(path)["tests/engine/test_e.py::test_slow[x]"] == pytest.approx(77.0)


def test_only_the_real_node_images_and_demo_tests_wait_for_the_late_steps(tmp_path: Path) -> None:
    assert steps_needed("tests/e2e/test_real_node.py::test_x") == ("30-node", "40-images")
    assert steps_needed("tests/e2e/test_images.py::test_x[a]") == ("30-node", "40-images")
    assert steps_needed("tests/e2e/test_dashboards_e2e.py::test_x") == ()
    assert steps_needed("tests/cluster/test_a.py::test_x") == ()
    assert steps_needed("tests/cluster/test_keda_autoscaling.py::test_x") == ("35-keda",)
    (tmp_path / "30-node.done").touch()
    (tmp_path / "40-images.failed").touch()
    assert step_outcome(tmp_path, "30-node") == "done"
    assert step_outcome(tmp_path, "10-cluster") is None
    outcomes = wait_for_steps(tmp_path, ("30-node", "40-images", "10-cluster"), timeout_s=0.3, poll_s=0.05)
    assert outcomes == {"30-node": "done", "40-images": "failed", "10-cluster": "timeout"}


def test_a_step_that_did_not_end_well_is_reported_with_the_last_lines_of_its_log(tmp_path: Path) -> None:
    (tmp_path / "35-keda.log").write_text("".join(f"line {i}\n" for i in range(40)))
    tail = step_log_tail("35-keda", lines=3, logs=tmp_path)
    assert tail == "  | line 37\n  | line 38\n  | line 39"
    assert step_log_tail("25-keda-modules", logs=tmp_path).startswith("(no log at ")
    (tmp_path / "empty.log").write_text("")
    assert step_log_tail("empty", logs=tmp_path) == "(its log is empty)"
