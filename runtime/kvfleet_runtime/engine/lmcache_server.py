"""LMCache's server with kvfleet's per-tenant L1 governance (the thin shell over ``l1_governance``).

``python -m kvfleet_runtime.engine.lmcache_server server --host ... --l1-size-gb ...`` takes exactly
``lmcache server``'s arguments. With the engine plugin's environment set (``KVFLEET_TENANT_TABLE``,
``KVFLEET_KEY_FILE``, ``KVFLEET_POOL``; see ``plugin_config``) it first replaces LMCache's
``L1EvictionController`` with :class:`GovernedL1EvictionController`, which keeps LMCache's L1 (the CPU
tier) within each cache salt's quota, burst cap and TTL from the tenant table (re-read when the mounted
files change) and exports per-salt series on LMCache's own Prometheus endpoint:

* ``kvfleet_lmcache_l1_bytes{cache_salt}``: bytes of each salt resident in L1 (exact);
* ``kvfleet_lmcache_l1_quota_bytes{cache_salt}``, ``kvfleet_lmcache_l1_burst_bytes{cache_salt}``;
* ``kvfleet_lmcache_l1_evictions_total{cache_salt,reason}``: evictions by kvfleet (``ttl``,
  ``over_quota``, ``lru``);
* ``kvfleet_lmcache_l1_tenant_table_reloads_total{result}``.

``lmcache_sync`` maps salts to tenants. LMCache's endpoint binds the pod's loopback only; the pod's metrics
port re-exports these series with ``salt_hash`` in place of ``cache_salt`` (``salt_labels``: a salt is never
published). Without that environment this is stock ``lmcache server``.
Supports exactly LMCache 0.5.6 (the L1 listener and controller interfaces are internal) and refuses to
start on another version rather than run ungoverned.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import lmcache
from lmcache.cli.main import main as lmcache_main
from lmcache.v1.distributed import storage_manager
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.eviction import EvictionPolicy, L1EvictionPolicy
from lmcache.v1.distributed.storage_controllers.eviction_controller import EvictionController
from lmcache.v1.mp_observability.event_bus import get_event_bus

from kvfleet_runtime.config_watch import RuntimeConfig, RuntimeConfigWatcher
from kvfleet_runtime.engine.governor_metrics import GovernorMetrics
from kvfleet_runtime.engine.l1_governance import L1Governor, L1Limits, compute_l1_limits
from kvfleet_runtime.engine.plugin_config import PluginSettings, load_plugin_settings

SUPPORTED_LMCACHE_VERSION = "0.5.6"
log = logging.getLogger("kvfleet.lmcache_l1")


def check_lmcache_version(version: str) -> None:
    if version != SUPPORTED_LMCACHE_VERSION:
        raise RuntimeError(
            f"kvfleet's L1 governance supports LMCache {SUPPORTED_LMCACHE_VERSION} only, found {version}; "
            f"install lmcache=={SUPPORTED_LMCACHE_VERSION} (hack/install-engine.sh) or run without "
            "KVFLEET_TENANT_TABLE/KVFLEET_KEY_FILE/KVFLEET_POOL"
        )


def l1_metrics() -> GovernorMetrics:
    """The per-salt L1 series (default registry: LMCache's ``--prometheus-port`` serves it)."""
    return GovernorMetrics("kvfleet_lmcache_l1", "L1", "L1 objects")


class GovernedL1Policy(EvictionPolicy):  # type: ignore[misc]
    """LMCache's eviction-policy interface, forwarding L1 events to the governor."""

    def __init__(self, governor: L1Governor, l1_manager: Any) -> None:
        self.governor = governor
        self._l1 = l1_manager

    def _size(self, key: Any) -> int:
        # Called from L1Manager's listener hooks, which run under its (non-reentrant) lock: read the
        # object table directly instead of through the locked accessor.
        state = self._l1._objects.get(key)
        return int(state.memory_obj.get_size()) if state is not None else 0

    def register_eviction_destination(self, destination: Any) -> None:
        pass

    def on_keys_reserved(self, keys: list[Any]) -> None:
        pass  # tracked once the write finishes (on_keys_created)

    def on_keys_created(self, keys: list[Any]) -> None:
        self.governor.on_stored([(k, k.cache_salt, self._size(k)) for k in keys])

    def on_keys_touched(self, keys: list[Any]) -> None:
        self.governor.on_used(keys)

    def on_keys_removed(self, keys: list[Any]) -> None:
        self.governor.on_removed(keys)

    def get_eviction_actions(
        self, expected_ratio: float, key_eligible_filter: Any = None, cache_salt: str | None = None
    ) -> list[Any]:
        return []  # the governed controller selects victims itself


class GovernedL1EvictionController(EvictionController):  # type: ignore[misc]
    """LMCache's L1 eviction loop, with victims chosen per salt by the governor (see ``install``)."""

    settings: PluginSettings
    metrics: GovernorMetrics
    interval_s = 1.0

    def __init__(self, l1_manager: Any, eviction_config: Any) -> None:
        super().__init__()
        self._l1_manager = l1_manager
        self._eviction_config = eviction_config
        _, total = l1_manager.get_memory_usage()
        self._capacity = total
        self._watcher = RuntimeConfigWatcher(self.settings.tenant_table, self.settings.key_file, logger=log)
        # A misconfigured LMCache fails at start-up, with the reason.
        self.governor = L1Governor(total, self._limits(self._watcher.load()))
        self._eviction_policy = GovernedL1Policy(self.governor, l1_manager)
        self._listener = L1EvictionPolicy(self._eviction_policy)
        l1_manager.register_listener(self._listener)
        self._event_bus = get_event_bus()
        log.info(
            "kvfleet L1 governance on: %d salts from pool %r, L1 %d bytes",
            len(self.governor.limits.per_salt),
            self.settings.pool,
            total,
        )

    def report_status(self) -> dict[str, Any]:
        alive = self._thread.is_alive()
        return {"is_healthy": alive, "thread_alive": alive, "eviction_policy": "kvfleet"}

    def eviction_loop(self) -> None:
        while not self._stop_flag.wait(self.interval_s):
            try:
                self.run_cycle()
            except Exception:  # the loop must outlive one bad cycle; LMCache keeps serving
                log.exception("kvfleet L1 eviction cycle failed")

    def _limits(self, config: RuntimeConfig) -> L1Limits:
        return compute_l1_limits(config.table, config.keys, self.settings.pool, self._capacity)

    def run_cycle(self) -> None:
        failures = self._watcher.failures
        if (config := self._watcher.poll()) is not None:
            try:
                self.governor.set_limits(self._limits(config))
                self.metrics.reloads.labels("ok").inc()
            except ValueError as exc:  # e.g. this pool is no longer in the table
                self.metrics.reloads.labels("error").inc()
                log.warning("tenant table reload failed, keeping the previous limits: %s", exc)
        elif self._watcher.failures > failures:
            self.metrics.reloads.labels("error").inc()
        gone = self.governor.take_removed()
        if gone:
            result = self._l1_manager.delete([key for key, _, _ in gone])
            self.governor.on_stored([g for g in gone if result.get(g[0]) == L1Error.KEY_IS_LOCKED])
            log.info("deleted %d L1 objects of tenants removed from the table", len(gone))
        used, total = self._l1_manager.get_memory_usage()
        config = self._eviction_config
        victims = self.governor.select(used, total, config.trigger_watermark, config.eviction_ratio)
        if victims:
            result = self._l1_manager.delete([v.key for v in victims])
            refused = [v for v in victims if result.get(v.key) == L1Error.KEY_IS_LOCKED]
            self.governor.restore(refused)
        self.metrics.publish(self.governor)

    def execute_eviction_action(self, action: Any) -> None:
        self._l1_manager.delete(action.keys)


def install(settings: PluginSettings) -> None:
    """Swap LMCache's L1 eviction controller for the governed one (before the server is built)."""
    check_lmcache_version(lmcache.__version__)
    GovernedL1EvictionController.settings = settings
    GovernedL1EvictionController.metrics = l1_metrics()
    storage_manager.L1EvictionController = GovernedL1EvictionController


def main(argv: Sequence[str] | None = None) -> None:
    tokens = list(sys.argv[1:] if argv is None else argv)
    settings = load_plugin_settings(os.environ)
    if settings is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        install(settings)
    lmcache_main(tokens)


if __name__ == "__main__":
    main()
