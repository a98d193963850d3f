"""Start a real Redis (Debian's ``redis-server``, installed by hack/provision.d/10-cluster.sh) on a free
loopback port, with a password, as the gateway replicas' shared store in tests and benchmarks.

Nothing is persisted (no RDB, no AOF). :meth:`SharedStoreServer.kill` stops it at once (SIGKILL: the fault
the gateway must survive) and :meth:`SharedStoreServer.restart` starts it again on the same port.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import redis

from . import binaries
from .processes import ManagedProcess, find_free_port, start_process, wait_until

#: What tests and CI install: Debian's package (hack/provision.d/10-cluster.sh).
BINARY = "redis-server"


@dataclass
class SharedStoreServer:
    """A running ``redis-server`` on 127.0.0.1:``port`` requiring ``password``."""

    port: int
    password: str
    workdir: Path
    process: ManagedProcess | None = field(default=None)

    @property
    def url(self) -> str:
        """The URL the gateway is given (the password goes separately, in its environment)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        """True when the server answers an authenticated PING."""
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def start(self, timeout: float = 20.0) -> None:
        self.process = start_process(
            "redis-server",
            [
                str(binaries.require_binary(BINARY)),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
            ],
            self.workdir / "logs",
        )
        wait_until(self.ping, timeout=timeout, what="redis-server PING", watch=[self.process])

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crashed store would."""
        if self.process is not None:
            if self.process.alive():
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.stop(timeout=5)
            self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_shared_store(timeout: float = 20.0) -> SharedStoreServer:
    """A fresh ``redis-server`` on a free port with a random password. Raises ``FileNotFoundError`` when
    it is not installed."""
    if binaries.find_binary(BINARY) is None:
        raise FileNotFoundError(f"{BINARY} not found; install it with hack/provision.d/10-cluster.sh")
    server = SharedStoreServer(
        port=find_free_port(),
        password=secrets.token_hex(16),
        workdir=Path(tempfile.mkdtemp(prefix="kvfleet-redis-")),
    )
    try:
        server.start(timeout)
    except BaseException:
        server.stop()
        raise
    return server
