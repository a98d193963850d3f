"""The KV blocks an engine really allocated reach the operator from the live engine.

The same real pod as ``test_engine_ports.py`` (the session's ``launched_engine``: the tiny example
ModelDeployment rendered by the operator's builders, its engine container's own ``kvfleet engine launch``
command: LMCache, vLLM-CPU with kvfleet's plugin, the quota sync), reached on this machine's non-loopback
address as the operator reaches a pod IP.
The operator's own reader (``k8s/engine_metrics.py``) reads the pod's metrics port, where the plugin
re-exports vLLM's series; the figure must be the one vLLM serves on its own port, and, since vLLM now
sizes its own cache (no ``--num-gpu-blocks-override``), the planner's figure for the pool's KV space.
"""

from __future__ import annotations

import asyncio
import time

from test_engine_ports import get

from engine_fixtures import LOOPBACK, TINY_MODEL_DEPLOYMENT, LaunchedEngine, load_manifest
from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.build.tenant_table import compute_pool_capacity
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from kvfleet_operator.reconcile.capacity import decide_engine_capacity, engine_metrics_targets
from kvfleet_runtime.kv.reported_capacity import parse_reported_blocks


def test_the_operator_reads_the_blocks_vllm_allocated_on_the_pods_metrics_port(
    launched_engine: LaunchedEngine,
) -> None:
    pod = launched_engine
    md = ModelDeployment.model_validate(load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid"))
    planned = compute_pool_capacity(md)
    # The engine pod as the API server lists it: Ready, with its IP, controlled by the pool's StatefulSet.
    owner = [{"kind": "StatefulSet", "name": "tiny-engine-shared", "uid": "sts-uid", "controller": True}]
    listed = {
        "metadata": {"name": "tiny-engine-shared-0", "uid": "pod-uid-0", "ownerReferences": owner},
        "status": {"podIP": pod.address, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    md_ref = [{"kind": "ModelDeployment", "name": "tiny", "uid": "md-uid", "controller": True}]
    pool = {"metadata": {"name": "tiny-engine-shared", "uid": "sts-uid", "ownerReferences": md_ref}}
    targets = engine_metrics_targets([listed], [pool], "md-uid", port=pod.ports["--plugin-metrics-port"])
    assert [t.url for t in targets] == [pod.url("--plugin-metrics-port") + "/metrics"]

    # The pod's metrics port reads vLLM's /metrics over loopback at scrape time and gives up on it after
    # UPSTREAM_TIMEOUT_S (3 s): on a machine busy with a build beside the tests that read can miss, and the
    # scrape then carries no figure (the operator reads again after retry_s). A fresh reader every 2 s, for
    # up to a minute, as the operator's next reconciles would.
    read: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while not read and time.monotonic() < deadline:
        read = asyncio.run(EngineCapacityReader(timeout_s=20).read(targets))
        if not read:
            time.sleep(2)

    status, body = get(pod.url("--port", LOOPBACK) + "/metrics")
    assert status == 200
    own = parse_reported_blocks(body.decode())
    assert own is not None and own > 0
    assert read == {"tiny-engine-shared-0": own}  # the pod's metrics port carries vLLM's own figure
    # vLLM sized the cache itself from VLLM_CPU_KVCACHE_SPACE (1 GiB here, as cpuKvCacheSpace says): the
    # planner's figure for that space is exact on the CPU build.
    assert own == planned.hbm_blocks, (own, planned.hbm_blocks)
    engine = decide_engine_capacity(planned.hbm_blocks, list(read.values()), None)
    assert engine.reported_blocks == own and not engine.below_plan
