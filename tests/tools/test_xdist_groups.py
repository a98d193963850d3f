"""`make test`'s two pytest-xdist workers keep each heavy setup on one of them (tests/parallel_plugin.py).

Runs pytest itself, with two workers, on a module of a grouped tier that starts nothing heavy
(tests/security/test_engine_reachability.py evaluates rendered NetworkPolicies): every test must carry the
module's group and run on one worker. This fails when xdist's ``--dist loadgroup`` stops grouping, as it
silently does with pytest 9.2 (https://github.com/pytest-dev/pytest-xdist/issues/1386).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests/security/test_engine_reachability.py"
XDIST = ("-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder")


def test_a_grouped_module_runs_whole_on_one_worker() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *XDIST, "-p", "no:cacheprovider", "-v", MODULE],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    passed = re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (.+?) *$", done.stdout, re.MULTILINE)
    assert len(passed) > 10
    assert {worker for worker, _ in passed} in ({"gw0"}, {"gw1"}), "the module was split between workers"
    assert all(nodeid.endswith(f"@{MODULE}") for _, nodeid in passed)
