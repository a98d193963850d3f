"""The builders tests share (no tests here): a free loopback port, tenant-table rows and tables, Tenant
resources, a vLLM-like metrics registry, every PromQL expression kvfleet ships, and the reader of an
exposition page.

One definition of each; where tests need another value they pass it (every default here is what most
tests used). ``tests/`` is on ``sys.path`` (pyproject's pytest ``pythonpath``): ``from factories import``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_operator.api import Tenant
from kvfleet_runtime.config import (
    Isolation,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    TierTTLs,
)

LOOPBACK = "127.0.0.1"


# --- ports -------------------------------------------------------------------------------------------------


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel's choice); nothing listens on it once
    this returns, so it also serves as a port whose connects are refused."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- the tenant table (kvfleet_runtime.config) -------------------------------------------------------------


def tenant_entry(
    name: str,
    *,
    tier: SlaTier = SlaTier.STANDARD,
    priority: int = 10,
    isolation: Isolation = Isolation.SALTED,
    salt_id: str | None = None,
    pool: str = "shared",
    models: Iterable[str] = ("m",),
    quota: KVQuota | None = None,
    hbm: int = 10,
    hbm_burst: int | None = None,
    cpu: int = 0,
    nvme: int = 0,
    ttl: TierTTLs | None = None,
    **fields: Any,
) -> TenantEntry:
    """One row of the tenant table. ``salt_id`` defaults to the pool's salt (``"pool"``) for a shared
    tenant and ``salt-<name>`` otherwise; ``quota`` wins over ``hbm``/``hbm_burst``/``cpu``/``nvme`` (the
    burst defaults to ``hbm``); ``ttl`` and any other field (``rate_limits``, ``fair_share_weight``) are
    set only when given, so an entry compares equal to one written out by hand."""
    if salt_id is None:
        salt_id = "pool" if isolation is Isolation.SHARED else f"salt-{name}"
    if quota is None:
        quota = KVQuota(
            hbm_blocks=hbm,
            hbm_burst_blocks=hbm if hbm_burst is None else hbm_burst,
            cpu_bytes=cpu,
            nvme_bytes=nvme,
        )
    if ttl is not None:
        fields["ttl"] = ttl
    return TenantEntry(
        name=name,
        tier=tier,
        priority=priority,
        isolation=isolation,
        salt_id=salt_id,
        pool=pool,
        models=list(models),
        quota=quota,
        **fields,
    )


def pool_entry(
    name: str = "shared", *, block_size: int = 16, hbm_blocks: int = 1000, **fields: Any
) -> PoolEntry:
    """One pool of the tenant table; ``fields`` are PoolEntry's other fields (``burst_cap``, ``endpoints``,
    ``engine``, ...)."""
    return PoolEntry(name=name, block_size=block_size, hbm_blocks_per_replica=hbm_blocks, **fields)


def tenant_table(
    *tenants: TenantEntry,
    pools: Iterable[PoolEntry] = (),
    model_deployment: str = "ns/m",
    served_model_name: str = "m",
    pool_salt_id: str = "pool",
) -> TenantTable:
    """A tenant table of ``tenants`` (keyed by name) and ``pools`` (keyed by name; one default
    ``pool_entry()`` when none is given)."""
    pool_list = list(pools) or [pool_entry()]
    return TenantTable(
        model_deployment=model_deployment,
        served_model_name=served_model_name,
        pool_salt_id=pool_salt_id,
        pools={p.name: p for p in pool_list},
        tenants={t.name: t for t in tenants},
    )


# --- the Tenant resource (kvfleet_operator.api) ------------------------------------------------------------


def tenant_document(
    name: str = "t",
    *,
    namespace: str | None = "ns",
    model_deployment: str = "m",
    metadata: Mapping[str, Any] | None = None,
    status: Mapping[str, Any] | None = None,
    typed: bool = False,
    **spec: Any,
) -> dict[str, Any]:
    """A Tenant as the API server holds it: ``spec`` (camelCase keys, as in a manifest) on top of the
    reference to ``model_deployment``; ``metadata`` adds fields (``uid``, ``creationTimestamp``...);
    ``typed`` adds ``apiVersion`` and ``kind``; ``namespace=None`` leaves it out."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta.update(metadata or {})
    doc: dict[str, Any] = {}
    if typed:
        doc |= {"apiVersion": "kvfleet.io/v1alpha1", "kind": "Tenant"}
    doc |= {"metadata": meta, "spec": {"modelDeploymentRef": {"name": model_deployment}, **spec}}
    if status is not None:
        doc["status"] = dict(status)
    return doc


def tenant_resource(name: str = "t", **kwargs: Any) -> Tenant:
    """:func:`tenant_document`, parsed into the operator's ``Tenant`` model."""
    return Tenant.model_validate(tenant_document(name, **kwargs))


# --- metrics -----------------------------------------------------------------------------------------------


def vllm_like_registry() -> CollectorRegistry:
    """A registry with a few of vLLM's families and a process family, as vLLM's API server exposes them."""
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry).labels("tiny").inc(42)
    Gauge("vllm:num_requests_running", "Running.", registry=registry).set(1)
    Histogram("vllm:time_to_first_token_seconds", "TTFT.", registry=registry).observe(0.2)
    Gauge("process_open_fds", "fds of vLLM's API server.", registry=registry).set(11)
    return registry


def metric_families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """An exposition page as family name -> samples (name, labels, value); a family served twice fails."""
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"{family.name} served twice"
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of every sample called ``name`` on an exposition page."""
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def all_promql() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel query, variable query and alert expression kvfleet ships."""
    # Imported here: the dashboards are on pytest's path (pyproject pythonpath), not on that of the helper
    # processes that import this module (gateway_support's flood from another process).
    from kvfleet_dashboards.alerts import ALERTS  # noqa: PLC0415
    from kvfleet_dashboards.dashboards import (  # noqa: PLC0415
        ALL_DASHBOARDS,
        dashboard_queries,
        variable_queries,
    )

    out = []
    for spec in ALL_DASHBOARDS:
        out += [(f"{spec.uid}: {title}", expr) for title, expr in dashboard_queries(spec)]
        out += [(f"{spec.uid}: variable", expr) for expr in variable_queries(spec)]
    out += [(f"alert {a.name}", a.expr) for a in ALERTS]
    return out
