"""Child processes of the control plane: each in its own process group, logged to a file.

A process is started with ``start_new_session=True`` so stopping it kills its whole group (no strays),
and it keeps running when the starting Python exits (``python -m devcluster up``). Stopping by pid
checks ``/proc/<pid>/cmdline`` first, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class ManagedProcess:
    """A started child: its name, pid (= process group id), command line and log file."""

    name: str
    pid: int
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _pid_runs(self.pid, self.argv[0])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout`` seconds."""
        if not self.alive():
            self._reap()
            return
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if not self.alive() and not _group_exists(self.pid):
                return
            time.sleep(0.05)
        _signal_group(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (self.alive() or _group_exists(self.pid)):
            self._reap()
            time.sleep(0.05)

    def _reap(self) -> None:
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=0)


def _pid_runs(pid: int, exe: str) -> bool:
    """True when ``pid`` is alive and still runs ``exe`` (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie has exited; only its parent's wait is missing.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and cmdline.split(b"\0", 1)[0].decode(errors="replace") == exe


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def start_process(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> ManagedProcess:
    """Start ``argv`` in a new session, stdout+stderr appended to ``log_dir/<name>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return ManagedProcess(name=name, pid=popen.pid, argv=list(argv), log_path=log_path, popen=popen)


def wait_until(
    check: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    watch: Sequence[ManagedProcess] = (),
    interval: float = 0.1,
) -> None:
    """Poll ``check`` until it is true; fail fast if a watched process dies, else after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in watch:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}")
        if check():
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} ---\n{p.log_tail(15)}" for p in watch)
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")
        time.sleep(interval)
