"""The engine pool's StatefulSet and headless Service (build/engine.py), one table of pools each."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfleet_operator.build.common import (
    ENGINE_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    NVME_MOUNT,
    PLUGIN_METRICS_PORT,
    Owner,
    selector_labels,
)
from kvfleet_operator.build.engine import (
    NODE_LOSS_TOLERATION_SECONDS,
    ModelVolume,
    NvmeVolume,
    PoolWorkload,
    build_engine_service,
    build_engine_statefulset,
    build_node_loss_tolerations,
    replica_endpoints,
)
from object_fields import MISSING, field_at

MD_OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
TENANT_OWNER = Owner("kvfleet.io/v1alpha1", "Tenant", "bank", "t-uid")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GROUP_TOLERATION = {"key": "kvfleet.io/gpu-group", "operator": "Equal", "value": "g1", "effect": "NoSchedule"}
#: What every engine pod tolerates of a node that stopped reporting (instead of the API server's 300 s).
NODE_LOSS = [
    {"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
    for k in ("not-ready", "unreachable")
]

CPU_POOL = PoolWorkload(
    namespace="ns",
    model_deployment="m",
    pool="shared",
    owner=MD_OWNER,
    replicas=1,
    image="engine:1",
    model="/models/tiny",
    gpus_per_replica=0,
    model_volume=ModelVolume("weights"),
)
GPU_POOL = PoolWorkload(
    namespace="ns",
    model_deployment="m",
    pool="shared",
    owner=MD_OWNER,
    replicas=2,
    image="engine:1",
    model="Qwen/Qwen2.5-72B-Instruct",
    gpus_per_replica=8,
    node_selector={"z": "1", "kvfleet.io/gpu-pool": "shared"},
    tolerations=(GPU_TOLERATION,),
    nvme=NvmeVolume(size="2Ti", storage_class="local-nvme"),
)
DEDICATED_POOL = dataclasses.replace(
    GPU_POOL,
    pool="dedicated-bank",
    owner=TENANT_OWNER,
    replicas=1,
    node_selector={},
    tolerations=(GPU_TOLERATION, GROUP_TOLERATION),
    required_node_labels={"kvfleet.io/gpu-group": "g1"},
    nvme=NvmeVolume(size="1Ti", host_path="/mnt/nvme"),
)
POD = "spec.template.spec"
ENGINE = f"{POD}.containers[0]"
NODE_TERMS = f"{POD}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"


def _volume(sts: dict[str, Any], name: str) -> Any:
    return next((v for v in field_at(sts, f"{POD}.volumes") if v["name"] == name), MISSING)


def _mount(sts: dict[str, Any], name: str) -> Any:
    return next((m for m in field_at(sts, f"{ENGINE}.volumeMounts") if m["name"] == name), MISSING)


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        pytest.param(
            CPU_POOL,
            {
                "metadata.name": "m-engine",
                "metadata.ownerReferences[0].uid": "md-uid",
                "spec.replicas": 1,
                "spec.serviceName": "m-engine",
                "spec.podManagementPolicy": "Parallel",
                f"{POD}.nodeSelector": MISSING,
                f"{POD}.tolerations": NODE_LOSS,
                f"{POD}.affinity": MISSING,
                "spec.volumeClaimTemplates": MISSING,
            },
            id="cpu-pool-no-placement-no-nvme",
        ),
        pytest.param(
            GPU_POOL,
            {
                "metadata.name": "m-engine",
                "spec.replicas": 2,
                f"{POD}.tolerations": [GPU_TOLERATION, *NODE_LOSS],
                f"{POD}.affinity": MISSING,
                "spec.volumeClaimTemplates[0].metadata.name": "nvme",
                "spec.volumeClaimTemplates[0].spec.storageClassName": "local-nvme",
                "spec.volumeClaimTemplates[0].spec.resources.requests.storage": "2Ti",
                "spec.volumeClaimTemplates[0].spec.accessModes": ["ReadWriteOnce"],
                "spec.persistentVolumeClaimRetentionPolicy": {
                    "whenDeleted": "Delete",
                    "whenScaled": "Retain",
                },
            },
            id="gpu-pool-nvme-from-a-storage-class-deleted-with-the-pool",
        ),
        pytest.param(
            dataclasses.replace(GPU_POOL, excluded_node_labels=("kvfleet.io/gpu-group",)),
            {
                f"{POD}.tolerations": [GPU_TOLERATION, *NODE_LOSS],
                NODE_TERMS: [
                    {"matchExpressions": [{"key": "kvfleet.io/gpu-group", "operator": "DoesNotExist"}]}
                ],
            },
            id="excluded-label-is-a-required-does-not-exist",
        ),
        pytest.param(
            dataclasses.replace(GPU_POOL, nvme=NvmeVolume(size="2Ti")),
            {"spec.volumeClaimTemplates[0].spec.storageClassName": MISSING},
            id="nvme-without-storage-class-takes-the-default-class",
        ),
        pytest.param(
            DEDICATED_POOL,
            {
                "metadata.name": "m-dedicated-bank-engine",
                "metadata.ownerReferences[0].kind": "Tenant",
                "metadata.ownerReferences[0].uid": "t-uid",
                f"{POD}.nodeSelector": MISSING,
                f"{POD}.tolerations": [GPU_TOLERATION, GROUP_TOLERATION, *NODE_LOSS],
                NODE_TERMS: [
                    {
                        "matchExpressions": [
                            {"key": "kvfleet.io/gpu-group", "operator": "In", "values": ["g1"]}
                        ]
                    }
                ],
                "spec.volumeClaimTemplates": MISSING,
                "spec.persistentVolumeClaimRetentionPolicy": MISSING,
            },
            id="dedicated-pool-owned-by-its-tenant-and-pinned-to-its-group",
        ),
    ],
)
def test_statefulset_fields(pool: PoolWorkload, expected: dict[str, Any]) -> None:
    sts = build_engine_statefulset(pool)
    assert {path: field_at(sts, path) for path in expected} == expected


@pytest.mark.parametrize("pool", [CPU_POOL, GPU_POOL, DEDICATED_POOL], ids=["cpu", "gpu", "dedicated"])
def test_selector_matches_the_pod_labels_and_only_its_pool(pool: PoolWorkload) -> None:
    sts = build_engine_statefulset(pool)
    selector = sts["spec"]["selector"]["matchLabels"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selector == selector_labels("m", "engine", pool.pool)
    assert selector.items() <= pod_labels.items()
    assert pod_labels["kvfleet.io/pool"] == pool.pool
    assert pod_labels == sts["metadata"]["labels"]


@pytest.mark.parametrize("pool", [CPU_POOL, GPU_POOL, DEDICATED_POOL], ids=["cpu", "gpu", "dedicated"])
def test_pod_runs_restricted_without_api_credentials(pool: PoolWorkload) -> None:
    sts = build_engine_statefulset(pool)
    pod = sts["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # A read-only root needs a writable /tmp, and vLLM's shared memory a memory-backed /dev/shm.
    assert _mount(sts, "tmp")["mountPath"] == "/tmp"
    assert _volume(sts, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


@pytest.mark.parametrize(
    ("pool", "gpus"),
    [(CPU_POOL, "0"), (GPU_POOL, "8")],
    ids=["cpu-requests-zero-gpus", "gpu-requests-and-limits-its-gpus"],
)
def test_gpu_resources(pool: PoolWorkload, gpus: str) -> None:
    resources = build_engine_statefulset(pool)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == gpus
    assert resources["limits"] == {"nvidia.com/gpu": gpus}


def test_node_selector_is_sorted_so_the_object_is_byte_stable() -> None:
    selector = build_engine_statefulset(GPU_POOL)["spec"]["template"]["spec"]["nodeSelector"]
    assert list(selector) == ["kvfleet.io/gpu-pool", "z"]


@pytest.mark.parametrize(
    ("pool", "flags"),
    [
        pytest.param(
            CPU_POOL,
            {
                "--pool": "shared",
                "--model": "/models/tiny",
                "--port": str(ENGINE_PORT),
                "--lmcache-port": str(LMCACHE_PORT),
                "--lmcache-http-port": str(LMCACHE_HTTP_PORT),
                "--metrics-port": str(LMCACHE_SYNC_METRICS_PORT),
                "--plugin-metrics-port": str(PLUGIN_METRICS_PORT),
                "--config": "/etc/kvfleet/config/tenants.json",
                "--keys": "/etc/kvfleet/keys/keys.json",
                "--nvme-dir": MISSING,
            },
            id="cpu-pool-no-nvme-dir",
        ),
        pytest.param(
            DEDICATED_POOL,
            {
                "--pool": "dedicated-bank",
                "--nvme-dir": f"{NVME_MOUNT}/$(KVFLEET_POD_NAME)",
                "--model": "Qwen/Qwen2.5-72B-Instruct",
            },
            id="dedicated-pool-on-a-host-path-writes-in-its-own-per-replica-folder",
        ),
        pytest.param(
            GPU_POOL,
            {"--pool": "shared", "--nvme-dir": NVME_MOUNT},
            id="a-replica-volume-is-its-own-nvme-folder",
        ),
    ],
)
def test_launch_command(pool: PoolWorkload, flags: dict[str, Any]) -> None:
    command = build_engine_statefulset(pool)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["kvfleet", "engine", "launch"]
    found = {flag: command[command.index(flag) + 1] if flag in command else MISSING for flag in flags}
    assert found == flags


@pytest.mark.parametrize(
    ("pool", "volume", "mount"),
    [
        pytest.param(
            CPU_POOL,
            {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
            {"name": "model", "mountPath": "/models", "readOnly": True},
            id="model-pvc-mounted-read-only",
        ),
        pytest.param(
            DEDICATED_POOL,
            {
                "name": "nvme",
                "hostPath": {"path": "/mnt/nvme/ns/m/dedicated-bank", "type": "DirectoryOrCreate"},
            },
            {"name": "nvme", "mountPath": NVME_MOUNT},
            id="nvme-host-path-mounts-only-the-pools-own-folder-never-the-root",
        ),
        pytest.param(
            GPU_POOL, MISSING, {"name": "nvme", "mountPath": NVME_MOUNT}, id="nvme-pvc-is-a-claim-template"
        ),
    ],
)
def test_volumes(pool: PoolWorkload, volume: Any, mount: dict[str, Any]) -> None:
    sts = build_engine_statefulset(pool)
    assert _volume(sts, mount["name"]) == volume
    assert _mount(sts, mount["name"]) == mount
    assert _volume(sts, "config")["configMap"] == {"name": "m-tenants"}
    assert _volume(sts, "keys")["secret"] == {"secretName": "m-keys"}


def test_no_model_volume_for_a_hugging_face_model() -> None:
    sts = build_engine_statefulset(GPU_POOL)
    assert _volume(sts, "model") is MISSING
    assert _mount(sts, "model") is MISSING


@pytest.mark.parametrize(
    "pool", [CPU_POOL, DEDICATED_POOL], ids=["shared-pool-service", "dedicated-pool-service"]
)
def test_headless_service_exposes_inference_and_metrics_but_not_lmcache(pool: PoolWorkload) -> None:
    svc = build_engine_service(pool)
    assert svc["metadata"]["name"] == build_engine_statefulset(pool)["spec"]["serviceName"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"] == selector_labels("m", "engine", pool.pool)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert ports == {
        "http": (ENGINE_PORT, "http"),
        "metrics": (PLUGIN_METRICS_PORT, "metrics"),  # the pod's one metrics port (sync's re-exported)
    }
    # Every named target port exists on the container.
    container_ports = build_engine_statefulset(pool)["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {p["name"]: p["containerPort"] for p in container_ports} == {k: v[0] for k, v in ports.items()}
    assert LMCACHE_PORT not in {p["port"] for p in svc["spec"]["ports"]}
    assert LMCACHE_HTTP_PORT not in {p["port"] for p in svc["spec"]["ports"]}
    assert LMCACHE_SYNC_METRICS_PORT not in {p["port"] for p in svc["spec"]["ports"]}  # pod loopback


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        pytest.param(CPU_POOL, [f"http://m-engine-0.m-engine.ns.svc:{ENGINE_PORT}"], id="one-replica"),
        pytest.param(
            DEDICATED_POOL,
            [f"http://m-dedicated-bank-engine-0.m-dedicated-bank-engine.ns.svc:{ENGINE_PORT}"],
            id="dedicated",
        ),
        pytest.param(
            GPU_POOL,
            [
                f"http://m-engine-0.m-engine.ns.svc:{ENGINE_PORT}",
                f"http://m-engine-1.m-engine.ns.svc:{ENGINE_PORT}",
            ],
            id="one-url-per-replica-in-order",
        ),
    ],
)
def test_replica_endpoints(pool: PoolWorkload, expected: list[str]) -> None:
    assert replica_endpoints(pool, ENGINE_PORT) == expected


@pytest.mark.parametrize(
    ("user", "expected_keys_added"),
    [
        pytest.param((), ["not-ready", "unreachable"], id="none-of-the-users-both-added"),
        pytest.param(
            (GPU_TOLERATION,), ["not-ready", "unreachable"], id="noschedule-gpu-toleration-unrelated"
        ),
        pytest.param(
            (
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 600,
                },
            ),
            ["not-ready"],
            id="users-own-seconds-for-one-key-kept",
        ),
        pytest.param(
            ({"key": "node.kubernetes.io/not-ready", "operator": "Exists"},),
            ["unreachable"],
            id="users-any-effect-forever-kept",
        ),
        pytest.param(
            ({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"},),
            ["not-ready", "unreachable"],
            id="users-noschedule-only-does-not-decide-eviction",
        ),
        pytest.param(({"operator": "Exists"},), [], id="users-wildcard-tolerates-everything-forever"),
    ],
)
def test_node_loss_tolerations_short_unless_the_user_decides(
    user: tuple[dict[str, Any], ...], expected_keys_added: list[str]
) -> None:
    """A pod on a node that stopped reporting is evicted after 30 s, not the API server's default 300 s;
    the shortest matching ``tolerationSeconds`` wins in the taint manager, so a user's own toleration of
    that taint is never undercut by ours."""
    assert NODE_LOSS_TOLERATION_SECONDS == 30
    tolerations = build_node_loss_tolerations(user)
    assert tolerations[: len(user)] == list(user)
    added = tolerations[len(user) :]
    assert [t["key"] for t in added] == [f"node.kubernetes.io/{k}" for k in expected_keys_added]
    assert all(t["effect"] == "NoExecute" and t["tolerationSeconds"] == 30 for t in added)
