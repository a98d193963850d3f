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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.config import TenantTable
from kvfleet_runtime.config_watch import RuntimeConfig, RuntimeConfigWatcher
from kvfleet_runtime.engine.attribution import UNATTRIBUTED, Attribution, build_attribution

__all__ = [
    "ENGINE_LOGGER",
    "ENV_KEY_FILE",
    "ENV_METRICS_HOST",
    "ENV_METRICS_PORT",
    "ENV_POOL",
    "ENV_TENANT_TABLE",
    "PluginSettings",
    "TenantSource",
    "describe_installed_pool",
    "load_plugin_settings",
]

#: The logger of everything kvfleet does inside vLLM's processes. It is a child of vLLM's ``vllm`` logger,
#: the only one vLLM gives a handler (its own are ``propagate=False`` and the root logger has none), so
#: these lines appear in the engine's log, formatted like vLLM's, at vLLM's ``VLLM_LOGGING_LEVEL``.
ENGINE_LOGGER = "vllm.kvfleet"

logger = logging.getLogger(ENGINE_LOGGER)

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


@dataclass
class TenantSource:
    """The tenant table and key file of one pool (``RuntimeConfigWatcher``), as an attribution.

    ``poll`` is meant for the scheduler's hot path: it stats the files at most once per
    ``check_interval`` seconds and otherwise returns at once. A file that fails to load (half written,
    invalid), or a table without this pool, keeps the previous attribution in force; the files are read
    again when they next change.
    """

    settings: PluginSettings
    capacity: int
    check_interval: float = 1.0
    reloads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    table: TenantTable | None = None
    _watcher: RuntimeConfigWatcher = field(init=False)
    _next_check: float = 0.0

    def __post_init__(self) -> None:
        self._watcher = RuntimeConfigWatcher(
            self.settings.tenant_table, self.settings.key_file, logger=logger
        )

    def load(self) -> Attribution:
        """First load; raises (``OSError``, ``ValueError``) so a misconfigured engine fails at start-up."""
        return self._attribution(self._watcher.load())

    def poll(self, now: float) -> Attribution | None:
        """A new attribution if the files changed since the last load (checked once per interval)."""
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval
        failures = self._watcher.failures
        config = self._watcher.poll()  # logs a rejected file itself
        if config is None:
            if self._watcher.failures > failures:
                self.reloads["error"] += 1
            return None
        try:
            attribution = self._attribution(config)
        except ValueError as exc:  # the table no longer has this pool
            self.reloads["error"] += 1
            logger.error("kvfleet: tenant table rejected, keeping the previous one: %s", exc)
            return None
        self.reloads["ok"] += 1
        logger.info("kvfleet: tenant table reloaded (%d accounting tenants)", len(attribution.limits))
        return attribution

    def _attribution(self, config: RuntimeConfig) -> Attribution:
        attribution = build_attribution(config.table, config.keys, self.settings.pool, self.capacity)
        self.table = config.table
        return attribution


def describe_installed_pool(pool: str, attribution: Attribution, metrics_port: int) -> str:
    """The line the engine logs once its tenant-aware block pool is built (vLLM's engine-core process)."""
    tenants = sum(len(m) for name, m in attribution.members.items() if name != UNATTRIBUTED)
    accounting = len(attribution.limits) - (1 if UNATTRIBUTED in attribution.limits else 0)
    metrics = f"metrics on port {metrics_port}" if metrics_port else "no metrics server"
    return (
        f"kvfleet: tenant-aware block pool installed: pool {pool!r}, {tenants} tenants "
        f"({accounting} accounting tenants), {attribution.capacity} KV blocks, {metrics}"
    )
