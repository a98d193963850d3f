"""kvfleet's vLLM general plugin: installs the tenant-aware block pool when the operator enabled it.

Entry point (pyproject.toml): ``[project.entry-points."vllm.general_plugins"] kvfleet =
"kvfleet_runtime.engine.vllm_plugin:register"``. vLLM calls ``register()`` in every process it starts
(API server, engine core, workers), possibly more than once per process, and before the engine core
builds its KV cache manager; ``register()`` is therefore idempotent and cheap, and a no-op unless the
plugin environment is set (``KVFLEET_TENANT_TABLE``, ``KVFLEET_KEY_FILE``, ``KVFLEET_POOL``; see
``engine.plugin_config``).

When enabled it:

1. pins vLLM: any version but :data:`SUPPORTED_VLLM` raises ``RuntimeError`` naming both, and vLLM
   refuses to start (general plugins run unguarded). The pool overrides private ``BlockPool`` methods
   whose contract changes between vLLM releases, so running on an unchecked version is worse than not
   starting;
2. checks the configuration (tables parse, the pool exists) so a bad one fails at start-up;
3. swaps ``BlockPool`` in ``vllm.v1.core.kv_cache_coordinator`` (which constructs it by that name) for
   ``TenantAwareBlockPool``, and ``KVCacheManager`` in ``vllm.v1.core.sched.scheduler`` for
   ``TenantAwareKVCacheManager`` (per-tenant hit counts and the allocating tenant).

The pool starts the metrics server (``engine.metrics_server``) when vLLM constructs it, so only the
engine-core process serves metrics, and it logs there, in vLLM's log, that it is installed, with the pool
name and the tenant count (``plugin_config.describe_installed_pool``).
"""

from __future__ import annotations

import logging
import os

from kvfleet_runtime.config import KeyFile, TenantTable
from kvfleet_runtime.engine.plugin_config import ENGINE_LOGGER, load_plugin_settings

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "is_installed", "register"]

logger = logging.getLogger(ENGINE_LOGGER)

#: The vLLM release line whose BlockPool internals the plugin was written against and tested with.
SUPPORTED_VLLM = "0.32"

#: Set once this process swapped the classes (``register`` may run several times per process).
_STATE = {"installed": False}


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` is a ``SUPPORTED_VLLM`` release (``0.32.x``, local
    suffixes such as ``+cpu`` allowed)."""
    release = version.split("+", 1)[0]
    if release != SUPPORTED_VLLM and not release.startswith(SUPPORTED_VLLM + "."):
        raise RuntimeError(
            f"kvfleet's tenant-aware block pool supports vLLM {SUPPORTED_VLLM}.x only, but vLLM {version} "
            "is installed: install a supported vLLM or unset KVFLEET_TENANT_TABLE/KVFLEET_KEY_FILE/"
            "KVFLEET_POOL to run without per-tenant KV governance"
        )


def is_installed() -> bool:
    """Whether ``register()`` swapped the block pool in this process."""
    return _STATE["installed"]


def register() -> None:
    """vLLM general-plugin hook; see the module docstring."""
    if _STATE["installed"]:
        return
    settings = load_plugin_settings(os.environ)
    if settings is None:
        return
    # Imported here, not at the top: this module is imported in every vLLM process, enabled or not.
    import vllm  # noqa: PLC0415

    check_vllm_version(vllm.__version__)
    table = TenantTable.load(settings.tenant_table)
    KeyFile.load(settings.key_file)
    if settings.pool not in table.pools:
        raise RuntimeError(
            f"kvfleet engine plugin: pool {settings.pool!r} is not in {settings.tenant_table} "
            f"(pools: {sorted(table.pools)})"
        )

    import vllm.v1.core.kv_cache_coordinator as coordinator_module  # noqa: PLC0415
    import vllm.v1.core.sched.scheduler as scheduler_module  # noqa: PLC0415

    from kvfleet_runtime.engine.block_pool import (  # noqa: PLC0415
        TenantAwareBlockPool,
        TenantAwareKVCacheManager,
    )

    # Both modules construct the class by the name they imported, so the swap is the whole hook.
    coordinator_module.BlockPool = TenantAwareBlockPool  # type: ignore[attr-defined]
    scheduler_module.KVCacheManager = TenantAwareKVCacheManager  # type: ignore[attr-defined]
    _STATE["installed"] = True
    # Debug only: every vLLM process runs this; the pool itself says it is installed, in the engine core.
    logger.debug(
        "kvfleet: block pool classes swapped in this process (pool %s, tenant table %s)",
        settings.pool,
        settings.tenant_table,
    )
