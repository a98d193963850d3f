"""Planned vs reported KV capacity: which figure quotas are admitted against, and what to tell a human. Pure.

The planner (``build/tenant_table.compute_pool_capacity``) estimates each replica's KV blocks from the spec
before any engine runs. vLLM then sizes its own cache (from ``--gpu-memory-utilization`` on GPUs, from
``VLLM_CPU_KVCACHE_SPACE`` on its CPU build) and reports the blocks it allocated as a label of
``vllm:cache_config_info`` (``kvfleet_runtime.kv.reported_capacity``). Once an engine has reported, quotas
are admitted against the reported figure; before, against the estimate.

How the figure travels (the shell: ``handlers/reconcile.read_engine_capacity`` and
``k8s/engine_metrics.py``): the operator reads ``GET /metrics`` on each ready engine pod's metrics port,
where the engine plugin re-exports vLLM's series, and only on pods the ModelDeployment's StatefulSets
own (``owned_engine_pods``: by controller reference UID, not by label). Engine pods carry no
ServiceAccount token, so they cannot write the figure anywhere in the API themselves; the metrics port
serves no inference API and the engine NetworkPolicy admits the operator's pods there and on no other port
(``build/network.OperatorPeer``). A
pod's figure never changes while it lives (vLLM allocates once, at start), so the shell reads each pod once
(by UID) and a converged resync neither reads an engine again nor writes anything.

Level-triggered: the figure is recomputed every reconcile from the ready pods' figures; when none can be
read (all replicas restarting, an operator that just started and cannot reach them yet), the reported
figure recorded in ``status.kvCapacity`` is kept, as long as the planner's estimate it was recorded with is
still the current one (a spec change that moves the estimate may also change what vLLM allocates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import KvCapacityStatus
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.common import PLUGIN_METRICS_PORT
from kvfleet_operator.build.tenant_table import PoolCapacity

Obj = dict[str, Any]

_MIB = 1 << 20
_Pod = TypeVar("_Pod", bound=Mapping[str, Any])


@dataclass(frozen=True)
class MetricsTarget:
    """One ready engine pod whose metrics port the shell reads."""

    uid: str
    pod: str
    url: str


@dataclass(frozen=True)
class EngineCapacity:
    """Per replica: the planner's estimate and the engines' own figure (``None`` until one reports)."""

    planned_blocks: int
    reported_blocks: int | None

    @property
    def below_plan(self) -> bool:
        return self.reported_blocks is not None and self.reported_blocks < self.planned_blocks


def _is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _controller_uid(obj: Mapping[str, Any], kind: str) -> str | None:
    """The UID of ``obj``'s controller (the owner reference marked ``controller``) when it is a ``kind``.
    (``reconcile/ownership.py`` reads the same reference; it imports ``status``, which imports this.)"""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref["uid"]) if ref.get("kind") == kind and ref.get("uid") else None
    return None


def owned_engine_pods(
    pods: Sequence[_Pod], statefulsets: Sequence[Mapping[str, Any]], model_deployment_uid: str
) -> list[_Pod]:
    """The pods whose controller is one of the ModelDeployment's StatefulSets (each controlled by the
    ModelDeployment), matched by UID, never by name or label.

    Labels select the candidates (one LIST), but anyone who may create a pod in the namespace can wear
    them: a Ready pod with the engine labels that reported one KV block would otherwise shrink the pool's
    capacity and withdraw its tenants' admission (issue 23, hole 5). A pod's controller reference is set
    by the StatefulSet controller; the chart's reserved-labels policy keeps any other creator from wearing
    the labels in the first place."""
    if not model_deployment_uid:
        return []
    owners = {
        str(s["metadata"]["uid"])
        for s in statefulsets
        if (s.get("metadata") or {}).get("uid")
        and _controller_uid(s, "ModelDeployment") == model_deployment_uid
    }
    return [p for p in pods if _controller_uid(p, "StatefulSet") in owners]


def engine_metrics_targets(
    pods: Sequence[Mapping[str, Any]],
    statefulsets: Sequence[Mapping[str, Any]],
    model_deployment_uid: str,
    port: int = PLUGIN_METRICS_PORT,
) -> list[MetricsTarget]:
    """The metrics URL of every engine pod of the ModelDeployment's StatefulSets (``owned_engine_pods``)
    that is Ready, has an IP and is not being deleted, by name.

    Only ready pods: vLLM serves ``/metrics`` before its profiling run is done (the figure is empty then),
    and a pod on its way out says nothing about the pool that stays."""
    targets: list[MetricsTarget] = []
    for pod in owned_engine_pods(pods, statefulsets, model_deployment_uid):
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or meta.get("deletionTimestamp") or not _is_ready(pod):
            continue
        host = f"[{ip}]" if ":" in str(ip) else str(ip)
        targets.append(
            MetricsTarget(
                str(meta.get("uid", "")), str(meta.get("name", "")), f"http://{host}:{port}/metrics"
            )
        )
    return sorted(targets, key=lambda t: t.pod)


def decide_engine_capacity(
    planned_blocks: int, reported: Sequence[int], previous: KvCapacityStatus | None
) -> EngineCapacity:
    """The figures for this reconcile. ``reported``: what the ready engine pods report now (one figure per
    pod read). The fewest blocks any replica has is what a per-replica quota can count on; without a
    figure now, the one recorded before (``previous``) stands if it was recorded against the same estimate.
    """
    if reported:
        return EngineCapacity(planned_blocks, min(reported))
    if (
        previous is not None
        and previous.reported_blocks is not None
        and previous.planned_blocks == planned_blocks
    ):
        return EngineCapacity(planned_blocks, previous.reported_blocks)
    return EngineCapacity(planned_blocks, None)


def effective_capacity(planned: PoolCapacity, engine: EngineCapacity) -> PoolCapacity:
    """``planned`` with its HBM figures replaced by the reported blocks, when there are any (tokens follow
    the block size, bytes the planner's bytes per block). CPU and NVMe tiers are LMCache's, sized by the
    spec, and stay as planned."""
    blocks = engine.reported_blocks
    if blocks is None or blocks == planned.hbm_blocks:
        return planned
    per_block = planned.hbm_bytes // planned.hbm_blocks if planned.hbm_blocks else 0
    return dataclasses.replace(
        planned, hbm_blocks=blocks, hbm_tokens=blocks * planned.block_size, hbm_bytes=blocks * per_block
    )


def explain_capacity_below_plan(
    md: ModelDeployment, planned: PoolCapacity, engine: EngineCapacity, guaranteed_blocks: int, rejected: int
) -> str | None:
    """The ``CapacityBelowPlan`` message when the engines allocated fewer blocks than planned, else ``None``.

    ``guaranteed_blocks``: the shared pool's HBM guarantees as admitted against the reported figure;
    ``rejected``: tenants that admission turned away for want of room. The fix it names: for GPU pools,
    ``spec.pool.reservePerGpu`` raised by what the missing blocks take on each GPU (so the estimate, used
    again whenever no engine has reported, matches what vLLM does), or lower quotas; for CPU engines the
    estimate is exact, so only the quotas or ``cpuKvCacheSpace``."""
    reported = engine.reported_blocks
    if reported is None or not engine.below_plan:
        return None
    missing = engine.planned_blocks - reported
    text = (
        f"vLLM allocated {reported} KV blocks per replica, {missing} fewer than the planner's "
        f"{engine.planned_blocks}; quotas are admitted against {reported}: {guaranteed_blocks} guaranteed."
    )
    if rejected:
        text += f" {rejected} tenant(s) do not fit it (QuotaExceedsCapacity on each)."
    pool = md.spec.pool
    if pool.gpus_per_replica == 0:
        return text + " Lower the quotas that no longer fit, or raise spec.pool.cpuKvCacheSpace."
    per_block = planned.hbm_bytes // planned.hbm_blocks if planned.hbm_blocks else 0
    gpus = max(1, md.spec.engine.tensor_parallel_size * md.spec.engine.pipeline_parallel_size)
    extra_mib = -(-missing * per_block // gpus // _MIB)  # rounded up
    target_mib = -(-(parse_quantity(pool.reserve_per_gpu) + extra_mib * _MIB) // _MIB)
    return (
        text + f" Raise spec.pool.reservePerGpu from {pool.reserve_per_gpu} to about {target_mib}Mi so the "
        "estimate matches what vLLM allocates, or lower the quotas that no longer fit."
    )
