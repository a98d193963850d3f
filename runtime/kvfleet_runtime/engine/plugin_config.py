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
* ``KVFLEET_PLUGIN_METRICS_UPSTREAMS``: ``name=url,name=url``: other in-pod ``/metrics`` the server
  re-exports with its own (the launcher sets vLLM's, LMCache's and the quota sync's), so Prometheus
  scrapes one port that serves no inference API. Loopback URLs only.
* ``KVFLEET_PLUGIN_DEBUG_PORT``: port of ``/debug/kv`` on ``127.0.0.1`` when the metrics bind another
  address (default ``config.PLUGIN_DEBUG_PORT``; ``0``: no debug endpoint). Debug routes are served on
  loopback-bound sockets only, never on a port another pod can reach.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.config import PLUGIN_DEBUG_PORT, PLUGIN_METRICS_PORT, TenantTable
from kvfleet_runtime.config_watch import RuntimeConfig, RuntimeConfigWatcher
from kvfleet_runtime.engine.attribution import UNATTRIBUTED, Attribution, build_attribution

__all__ = [
    "ENGINE_LOGGER",
    "ENV_DEBUG_PORT",
    "ENV_KEY_FILE",
    "ENV_METRICS_HOST",
    "ENV_METRICS_PORT",
    "ENV_METRICS_UPSTREAMS",
    "ENV_POOL",
    "ENV_TENANT_TABLE",
    "MetricsUpstream",
    "PluginSettings",
    "TenantSource",
    "describe_installed_pool",
    "format_metrics_upstreams",
    "is_loopback_host",
    "load_plugin_settings",
    "parse_metrics_upstreams",
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
ENV_METRICS_UPSTREAMS = "KVFLEET_PLUGIN_METRICS_UPSTREAMS"
ENV_DEBUG_PORT = "KVFLEET_PLUGIN_DEBUG_PORT"
#: Where the plugin serves metrics when the table names no engine settings (the pod's metrics port).
DEFAULT_METRICS_PORT = PLUGIN_METRICS_PORT

_UPSTREAM_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is the machine's (the pod's) loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class MetricsUpstream:
    """A ``/metrics`` inside the pod that the plugin's metrics server re-exports."""

    name: str
    url: str


def parse_metrics_upstreams(text: str) -> tuple[MetricsUpstream, ...]:
    """``name=url,name=url`` (``KVFLEET_PLUGIN_METRICS_UPSTREAMS``) as upstreams, in order.

    Raises ``ValueError`` for a malformed entry, a repeated name, or a URL that is not ``http://`` on a
    loopback address: the server re-exports what is inside the pod, and must not become a way to reach
    anything else."""
    upstreams: list[MetricsUpstream] = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, url = entry.partition("=")
        if not sep or not _UPSTREAM_NAME.match(name):
            raise ValueError(f"{ENV_METRICS_UPSTREAMS}: {entry!r} is not name=url")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not is_loopback_host(parsed.hostname or ""):
            raise ValueError(f"{ENV_METRICS_UPSTREAMS}: {name}: {url!r} is not an http:// loopback URL")
        if any(u.name == name for u in upstreams):
            raise ValueError(f"{ENV_METRICS_UPSTREAMS}: {name!r} is listed twice")
        upstreams.append(MetricsUpstream(name, url))
    return tuple(upstreams)


def format_metrics_upstreams(upstreams: Mapping[str, str]) -> str:
    """The ``KVFLEET_PLUGIN_METRICS_UPSTREAMS`` value for ``name -> url`` (checked by the parser)."""
    text = ",".join(f"{name}={url}" for name, url in upstreams.items())
    parse_metrics_upstreams(text)
    return text


@dataclass(frozen=True)
class PluginSettings:
    """Where the plugin reads its tenants and serves its metrics."""

    tenant_table: Path
    key_file: Path
    pool: str
    #: ``None``: take the pool's ``engine.plugin_metrics_port``; 0: no metrics server.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"  # noqa: S104 - scraped from outside the pod
    #: Other in-pod ``/metrics`` the server re-exports (``KVFLEET_PLUGIN_METRICS_UPSTREAMS``).
    metrics_upstreams: tuple[MetricsUpstream, ...] = ()
    #: ``/debug/kv`` on 127.0.0.1 when ``metrics_host`` is not loopback; 0: none.
    debug_port: int = PLUGIN_DEBUG_PORT

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
    try:
        upstreams = parse_metrics_upstreams(env.get(ENV_METRICS_UPSTREAMS, ""))
    except ValueError as exc:
        raise RuntimeError(f"kvfleet engine plugin: {exc}") from None
    debug_port = _port(env, ENV_DEBUG_PORT)
    return PluginSettings(
        tenant_table=Path(env[ENV_TENANT_TABLE]),
        key_file=Path(env[ENV_KEY_FILE]),
        pool=env[ENV_POOL],
        metrics_port=_port(env, ENV_METRICS_PORT),
        metrics_host=env.get(ENV_METRICS_HOST) or "0.0.0.0",  # noqa: S104
        metrics_upstreams=upstreams,
        debug_port=PLUGIN_DEBUG_PORT if debug_port is None else debug_port,
    )


def _port(env: Mapping[str, str], name: str) -> int | None:
    """The port in ``env[name]`` (``None`` when unset); ``RuntimeError`` when it is not one."""
    raw = env.get(name)
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise RuntimeError(f"kvfleet engine plugin: {name}={raw!r} is not a port") from None
    if not 0 <= port < 65536:
        raise RuntimeError(f"kvfleet engine plugin: {name}={port} is out of range")
    return port


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
