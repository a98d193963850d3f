"""The one watcher of the runtime configuration files: the tenant table and the key file.

Every process that reads them (the gateway, the vLLM engine plugin, the LMCache quota sync and the
governed LMCache L1) polls them through :class:`RuntimeConfigWatcher`, so all of them agree on when a file
changed and on what happens to a bad one.

When a file changed: its ``(st_dev, st_ino, st_mtime_ns, st_size)``, from ``stat`` following symlinks,
differs from the last poll. Kubernetes updates a mounted ConfigMap or Secret by re-pointing the
``..data`` symlink at a new folder, which changes the inode the path resolves to, so the swap is seen
even when the new files carry the old mtimes; an in-place rewrite changes the mtime or the size. A file
that cannot be stat'ed (missing) has no signature, and its return is a change too.

A bad file (unreadable, not JSON, not a valid table or key file): the last good pair stays in force; the
rejection is logged once per change (without the file's content: pydantic errors are reduced to location
and message, see :func:`describe_error`), counted, and handed to ``on_rejected``. The signature is
remembered even then, so a bad file is reported once, not on every poll, and is read again when it
changes.

Sync core (``poll``, blocking: it stats and reads files) and a thin async wrapper (``poll_async``, in a
thread) for hosts on an event loop.

A reload validates only what changed (:meth:`TenantTable.reload`: the tenants whose JSON differs from the
last good table's; a key file with the same bytes is the last one): at 10,000 tenants one validation of the
whole table holds the GIL for 0.12 s, long enough to stall a gateway's requests. Unchanged tenants keep
their objects, so a host can tell them by identity.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from kvfleet_runtime.config import KeyFile, LoadedTable, TenantTable

__all__ = [
    "ConfigFile",
    "ConfigRejection",
    "FileSignature",
    "RuntimeConfig",
    "RuntimeConfigWatcher",
    "describe_error",
    "file_signature",
]

_log = logging.getLogger("kvfleet.config")

#: ``(st_dev, st_ino, st_mtime_ns, st_size)`` of the file a path resolves to; ``None``: cannot stat.
FileSignature = tuple[int, int, int, int] | None


class ConfigFile(StrEnum):
    """Which of the two files (a metric label value of the gateway's reload failures)."""

    TENANT_TABLE = "tenant_table"
    KEY_FILE = "key_file"


class RuntimeConfig(NamedTuple):
    """A validated tenant table and key file, read together."""

    table: TenantTable
    keys: KeyFile


@dataclass(frozen=True)
class ConfigRejection:
    """A file that was rejected, and a log-safe reason."""

    file: ConfigFile
    path: Path
    reason: str


def file_signature(path: Path) -> FileSignature:
    """The signature of the file ``path`` resolves to (see the module docstring), ``None`` if it has none."""
    try:
        st = os.stat(path)  # follows symlinks: a ConfigMap ..data swap changes the inode
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def describe_error(exc: BaseException) -> str:
    """A log-safe description of a load failure: never the file's content or an input value."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors(include_input=False, include_url=False, include_context=False)[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{loc or '<root>'}: {err.get('msg', '')}")
        return f"{exc.error_count()} validation error(s): " + "; ".join(parts)
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'cannot read'}"
    return type(exc).__name__


class RuntimeConfigWatcher:
    """Polls the tenant table and the key file; see the module docstring for the contract.

    ``current`` is the last good pair (``None`` until one loaded). ``failures`` counts rejections.
    ``logger`` is where rejections are logged (the host's own log, so operators find them there).
    """

    def __init__(
        self,
        table_path: Path,
        keys_path: Path,
        *,
        on_rejected: Callable[[ConfigRejection], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.table_path = table_path
        self.keys_path = keys_path
        self._on_rejected = on_rejected
        self._log = logger or _log
        self._seen: tuple[FileSignature, FileSignature] | None = None
        self.current: RuntimeConfig | None = None
        self.failures = 0
        #: The last good table with its tenants' JSON, and the last good key file's bytes (reuse).
        self._loaded: LoadedTable | None = None
        self._keys_bytes: bytes | None = None

    def _signatures(self) -> tuple[FileSignature, FileSignature]:
        return (file_signature(self.table_path), file_signature(self.keys_path))

    def _read(self) -> RuntimeConfig:
        """Both files, validated, reusing what did not change since the last good pair; raises
        ``_Rejected`` naming the file that failed (then nothing is remembered)."""
        try:
            loaded = TenantTable.reload(self.table_path.read_bytes(), self._loaded)
        except (OSError, ValueError) as exc:
            raise _Rejected(ConfigFile.TENANT_TABLE, self.table_path, exc) from exc
        try:
            data = self.keys_path.read_bytes()
            last = self.current.keys if self.current is not None and data == self._keys_bytes else None
            keys = last or KeyFile.model_validate_json(data)
        except (OSError, ValueError) as exc:
            raise _Rejected(ConfigFile.KEY_FILE, self.keys_path, exc) from exc
        self._loaded, self._keys_bytes = loaded, data
        return RuntimeConfig(loaded.table, keys)

    def load(self) -> RuntimeConfig:
        """The first load: raises ``OSError``/``ValueError`` with the reason, so a process with a bad
        configuration fails at start-up instead of running without one."""
        # Stat before reading: a write between the two is then seen as a change by the next poll.
        seen = self._signatures()
        try:
            config = self._read()
        except _Rejected as rejected:
            raise rejected.cause from None
        self._seen, self.current = seen, config
        return config

    def poll(self) -> RuntimeConfig | None:
        """The new pair when either file changed since the last poll and both are valid; else ``None``."""
        seen = self._signatures()
        if seen == self._seen:
            return None
        # Remember the signatures even when loading fails, so a bad file is reported once, not every poll.
        self._seen = seen
        try:
            config = self._read()
        except _Rejected as rejected:
            self._reject(rejected)
            return None
        self.current = config
        return config

    async def poll_async(self) -> RuntimeConfig | None:
        """``poll`` in a thread (it stats and reads files), for hosts on an event loop."""
        return await asyncio.to_thread(self.poll)

    def _reject(self, rejected: _Rejected) -> None:
        self.failures += 1
        rejection = ConfigRejection(rejected.file, rejected.path, describe_error(rejected.cause))
        what = "tenant table" if rejection.file is ConfigFile.TENANT_TABLE else "key file"
        self._log.error(
            "%s %s rejected, keeping the last good one: %s", what, rejection.path, rejection.reason
        )
        if self._on_rejected is not None:
            self._on_rejected(rejection)


class _Rejected(Exception):
    """Internal: which file failed to load, and why."""

    def __init__(self, file: ConfigFile, path: Path, cause: OSError | ValueError) -> None:
        super().__init__(file.value)
        self.file = file
        self.path = path
        self.cause = cause
