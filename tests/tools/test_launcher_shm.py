"""The launcher removes the LMCache shared-memory files of dead workers and keeps those of live ones and
every other file; a dead worker is a process started and waited for here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvfleet_runtime.engine.launcher import remove_stale_lmcache_shm


def test_stale_lmcache_shm_files_of_dead_workers_are_removed(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()
    (tmp_path / f"lmcache_kv_{finished.pid}_0").write_bytes(b"x")
    (tmp_path / f"lmcache_kv_{os.getpid()}_0").write_bytes(b"x")
    (tmp_path / "psm_abc").write_bytes(b"x")
    assert remove_stale_lmcache_shm(tmp_path) == [f"lmcache_kv_{finished.pid}_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"lmcache_kv_{os.getpid()}_0", "psm_abc"])
