"""The engine plugin's settings (environment) and its tenant-table source (files, hot reload).

No vLLM import: the launcher, tests and ``vllm_plugin.register`` share it.

Environment (set by the launcher in the engine container; all three or none):

* ``KVFLEET_TENANT_TABLE``: path of the tenant table (``tenants.json``, the ConfigMap).
* ``KVFLEET_KEY_FILE``: path of the key file (``keys.json``, the Secret; the salt key derives salts).
* ``KVFLEET_POOL``: the name of this engine's pool in the tenant table.

Optional:

* ``KVFLEET_PLUGIN_METRICS_PORT``: port of the plugin's metrics server; default: the pool's
  ``engine.plugin_metrics_port`` (8001 when the pool has no engine settings). ``0`` disables it.
* ``KVFLEET_PLUGIN_METRICS_HOST``: address it binds (default ``0.0.0.0`` so Prometheus can scrape the
  pod; tests use ``127.0.0.1``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.config import KeyFile, TenantTable
from kvfleet_runtime.engine.attribution import Attribution, build_attribution

__all__ = [
    "ENV_KEY_FILE",
    "ENV_METRICS_HOST",
    "ENV_METRICS_PORT",
    "ENV_POOL",
    "ENV_TENANT_TABLE",
    "PluginSettings",
    "TenantSource",
    "load_plugin_settings",
]

logger = logging.getLogger(__name__)

ENV_TENANT_TABLE = "KVFLEET_TENANT_TABLE"
ENV_KEY_FILE = "KVFLEET_KEY_FILE"
ENV_POOL = "KVFLEET_POOL"
ENV_METRICS_PORT = "KVFLEET_PLUGIN_METRICS_PORT"
ENV_METRICS_HOST = "KVFLEET_PLUGIN_METRICS_HOST"
DEFAULT_METRICS_PORT = 8001


@dataclass(frozen=True)
class PluginSettings:
    """Where the plugin reads its tenants and serves its metrics."""

    tenant_table: Path
    key_file: Path
    pool: str
    #: ``None``: take the pool's ``engine.plugin_metrics_port``; 0: no metrics server.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"  # noqa: S104 - scraped from outside the pod

    def resolve_metrics_port(self, table: TenantTable) -> int:
        if self.metrics_port is not None:
            return self.metrics_port
        engine = table.pools[self.pool].engine if self.pool in table.pools else None
        return engine.plugin_metrics_port if engine is not None else DEFAULT_METRICS_PORT


def load_plugin_settings(env: Mapping[str, str]) -> PluginSettings | None:
    """The settings in ``env``; ``None`` when the plugin is not enabled (none of the three variables).

    Raises ``RuntimeError`` when only some are set or a value is malformed: a half-configured engine
    must not silently run without governance.
    """
    names = (ENV_TENANT_TABLE, ENV_KEY_FILE, ENV_POOL)
    present = [n for n in names if env.get(n)]
    if not present:
        return None
    if len(present) != len(names):
        missing = [n for n in names if n not in present]
        raise RuntimeError(f"kvfleet engine plugin: {present} set but {missing} missing; set all or none")
    port: int | None = None
    if raw := env.get(ENV_METRICS_PORT):
        try:
            port = int(raw)
        except ValueError:
            raise RuntimeError(f"kvfleet engine plugin: {ENV_METRICS_PORT}={raw!r} is not a port") from None
        if not 0 <= port < 65536:
            raise RuntimeError(f"kvfleet engine plugin: {ENV_METRICS_PORT}={port} is out of range")
    return PluginSettings(
        tenant_table=Path(env[ENV_TENANT_TABLE]),
        key_file=Path(env[ENV_KEY_FILE]),
        pool=env[ENV_POOL],
        metrics_port=port,
        metrics_host=env.get(ENV_METRICS_HOST) or "0.0.0.0",  # noqa: S104
    )


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)  # follows the symlinks Kubernetes swaps on ConfigMap/Secret updates
    return (st.st_mtime_ns, st.st_size)


@dataclass
class TenantSource:
    """The tenant table and key file of one pool, re-read when either file changes.

    ``poll`` is meant for the scheduler's hot path: it stats the files at most once per
    ``check_interval`` seconds and otherwise returns at once. A file that fails to parse (half written,
    invalid) keeps the previous attribution in force and is retried on its next change.
    """

    settings: PluginSettings
    capacity: int
    check_interval: float = 1.0
    reloads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    table: TenantTable | None = None
    _stamps: tuple[tuple[int, int], tuple[int, int]] | None = None
    _next_check: float = 0.0

    def load(self) -> Attribution:
        """First load; raises (``OSError``, ``ValueError``) so a misconfigured engine fails at start-up."""
        stamps = (_stamp(self.settings.tenant_table), _stamp(self.settings.key_file))
        attribution = self._read()
        self._stamps = stamps
        return attribution

    def poll(self, now: float) -> Attribution | None:
        """A new attribution if the files changed since the last load (checked once per interval)."""
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval
        try:
            stamps = (_stamp(self.settings.tenant_table), _stamp(self.settings.key_file))
        except OSError as exc:
            logger.warning("kvfleet: cannot stat the tenant table or key file: %s", exc)
            return None
        if stamps == self._stamps:
            return None
        self._stamps = stamps
        try:
            attribution = self._read()
        except (OSError, ValueError) as exc:
            self.reloads["error"] += 1
            logger.warning("kvfleet: tenant table reload failed, keeping the previous one: %s", exc)
            return None
        self.reloads["ok"] += 1
        logger.info("kvfleet: tenant table reloaded (%d accounting tenants)", len(attribution.limits))
        return attribution

    def _read(self) -> Attribution:
        table = TenantTable.load(self.settings.tenant_table)
        keys = KeyFile.load(self.settings.key_file)
        attribution = build_attribution(table, keys, self.settings.pool, self.capacity)
        self.table = table
        return attribution
