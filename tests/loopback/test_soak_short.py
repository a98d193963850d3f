"""A short run of the soak (benchmarks/soak.py) as a test: the same command and the same checks as the
10-minute run, on the fake upstream, with 50 clients for 12 s.

Real processes on real sockets: the gateway (``python -m kvfleet_runtime gateway``) and the fake
upstream's streaming answers (benchmarks/gateway/fake_upstream.py; the gateway, not the engine, is what
is soaked). Checked: no request failed (nothing in the run provokes a failure), every stream carried
exactly its chunks and ``[DONE]``, the gateway counted no upstream error, and once the clients are gone
the gateway holds no more descriptors than before the run (a leak would keep sockets) and its memory
has not grown by more than a few MiB under steady load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_on_the_fake_upstream(tmp_path: Path) -> None:
    results = tmp_path / "soak_short.json"
    command = [
        sys.executable, str(REPO / "benchmarks" / "soak.py"), "--upstream", "fake", "--clients", "50",
        "--duration", "12", "--warmup", "4", "--ramp-up", "2", "--sample-interval", "2",
        "--stream-chunks", "8", "--chunk-interval", "0.05", "--results", str(results),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    details = json.loads(results.read_text())["details"]
    assert details["errors"] == 0 and details["error_kinds"] == {}
    assert details["ok"] >= 50 and details["gateway_upstream_errors"] == 0
    # Under load every client holds a connection to the gateway and the gateway one to the upstream.
    assert details["fds_end"] >= details["fds_before"] + 50
    assert details["fds_after"] <= details["fds_before"] + 2, details
    assert details["rss_end_mib"] - details["rss_start_mib"] < 8, details
