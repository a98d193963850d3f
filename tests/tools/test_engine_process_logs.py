"""An engine pod's vLLM and LMCache output reaches the pod's log (``kubectl logs``) behind the process's
name, and its log file on the pod's ``/tmp`` stays bounded however much the process writes: the launcher
(``EngineProcess`` with ``echo`` and ``max_log_bytes``, as ``kvfleet engine launch`` starts them) on a
child process that writes a few hundred kilobytes."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from kvfleet_runtime.engine.launcher import EngineProcess

#: 4,000 numbered lines of 100 bytes: 400 kB through a log capped at 64 kB.
_WRITER = "import sys\nfor i in range(4000):\n    sys.stdout.write(f'line {i:05d} ' + 'x' * 88 + '\\n')\n"
_CAP = 64 * 1024


def test_output_is_echoed_with_its_name_and_the_file_is_rotated_at_its_cap(tmp_path: Path) -> None:
    echo = io.StringIO()
    log = tmp_path / "vllm.log"
    proc = EngineProcess("vllm", [sys.executable, "-c", _WRITER], {}, log, echo=echo, max_log_bytes=_CAP)
    assert proc.proc.wait(timeout=30) == 0
    proc.stop()

    echoed = echo.getvalue().splitlines()
    assert len(echoed) == 4000 and all(line.startswith("[vllm] line ") for line in echoed), echoed[:2]
    assert echoed[-1].startswith("[vllm] line 03999 ")
    older = log.with_name("vllm.log.1")
    assert log.stat().st_size <= _CAP and older.stat().st_size <= _CAP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm.log", "vllm.log.1"]  # never a third file
    # The newest lines are in the file and the tail reads across the rotation.
    assert log.read_text().splitlines()[-1].startswith("line 03999 ")
    tail = proc.log_tail(n_bytes=_CAP + 5000)
    assert "line 03999 " in tail and len(tail) == _CAP + 5000


def test_without_echo_or_cap_the_file_takes_the_output_as_before(tmp_path: Path) -> None:
    log = tmp_path / "lmcache.log"
    proc = EngineProcess("lmcache", [sys.executable, "-c", _WRITER], {}, log)
    assert proc.proc.wait(timeout=30) == 0
    proc.stop()
    assert log.stat().st_size == 4000 * 100 and not log.with_name("lmcache.log.1").exists()
