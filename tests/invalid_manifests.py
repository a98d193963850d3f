"""The table of invalid manifests every admission path must reject, naming the offending field.

One row per mistake a user can make. The unit tests replay every row through the pydantic models (and
the schema-only rows through the CRD's OpenAPI schema); the cluster tests replay the same rows against a
real kube-apiserver with the generated CRDs installed. A row:

* ``kind``: ``ModelDeployment`` or ``Tenant``; the row patches :func:`build_base_manifest` of that kind.
* ``patch``: dotted wire path -> new value (:data:`REMOVE` deletes the key).
* ``field``: the Kubernetes-style field path (``spec.pool.tolerations[0].operator``) the error must name.
* ``rule``: :attr:`RuleKind.SCHEMA` (type, enum, bound, pattern, required: the OpenAPI schema catches it)
  or :attr:`RuleKind.CEL` (an ``x-kubernetes-validations`` rule catches it).
* ``old_patch``: for transition rules (``oldSelf``), the object is first created from the base with
  ``old_patch`` applied, then updated to the base with ``patch`` applied; the update must fail.
* ``strict_only``: the API server rejects the row only under strict field validation
  (``fieldValidation=Strict``, kubectl's default); otherwise it prunes the unknown field silently.

What a real kube-apiserver (v1.37) answers, for the cluster tests: 422 Invalid for every schema and CEL
row (transition rows on the update, a PUT of the new version), 400 BadRequest ``strict decoding error:
unknown field "spec.quota"`` for strict-only rows; in each case the message contains ``field``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


#: Patch value that deletes a key.
REMOVE: Final = _Remove()


class RuleKind(StrEnum):
    """Which part of the CRD rejects a row."""

    SCHEMA = "schema"
    CEL = "cel"


@dataclass(frozen=True)
class InvalidManifestCase:
    """One invalid manifest (see the module docstring)."""

    id: str
    description: str
    kind: str
    patch: Mapping[str, Any]
    field: str
    rule: RuleKind
    old_patch: Mapping[str, Any] | None = None
    strict_only: bool = False

    @property
    def is_transition(self) -> bool:
        return self.old_patch is not None


_BASE_MODEL_DEPLOYMENT: Final[Mapping[str, Any]] = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "base", "namespace": "default"},
    "spec": {
        "model": {
            "servedName": "llama-3.1-8b",
            "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"},
            "architecture": {"preset": "llama-3.1-8b"},
        },
        "engine": {"tensorParallelSize": 1, "kvCacheDtype": "fp8_e5m2", "blockSize": 16},
        "kvCache": {
            "cpuSize": "64Gi",
            "nvme": {"size": "1Ti", "storageClassName": "local-nvme"},
            "ttl": {"hbm": "30s", "cpu": "10m", "nvme": "24h"},
        },
        "pool": {"replicas": 2, "gpusPerReplica": 1, "gpuType": "NVIDIA-H200", "gpuMemory": "141Gi"},
        "gateway": {"replicas": 2},
    },
}

_BASE_TENANT: Final[Mapping[str, Any]] = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "Tenant",
    "metadata": {"name": "base", "namespace": "default"},
    "spec": {
        "modelDeploymentRef": {"name": "base"},
        "tier": "standard",
        "isolation": "salted",
        "kvQuota": {"hbm": "20%", "cpu": "16Gi", "nvme": "100Gi"},
        "burstLimit": "50%",
    },
}

_EXPLICIT_ARCH: Final[Mapping[str, Any]] = {
    "numLayers": 32,
    "numAttentionHeads": 32,
    "numKvHeads": 8,
    "headDim": 128,
    "hiddenSize": 4096,
    "numParameters": 8_030_000_000,
    "weightDtype": "bfloat16",
}


def build_base_manifest(kind: str) -> dict[str, Any]:
    """A valid manifest of ``kind`` that every row of that kind patches (a fresh deep copy)."""
    base = {"ModelDeployment": _BASE_MODEL_DEPLOYMENT, "Tenant": _BASE_TENANT}[kind]
    return copy.deepcopy(dict(base))


def apply_patch(manifest: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """Apply a dotted-path patch to ``manifest`` in place and return it."""
    for dotted, value in patch.items():
        *parents, leaf = dotted.split(".")
        node = manifest
        for key in parents:
            node = node.setdefault(key, {})
        if value is REMOVE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return manifest


def build_invalid_manifest(case: InvalidManifestCase) -> dict[str, Any]:
    """The invalid manifest of ``case`` (for a transition row: the rejected new version)."""
    return apply_patch(build_base_manifest(case.kind), case.patch)


def build_old_manifest(case: InvalidManifestCase) -> dict[str, Any] | None:
    """For a transition row, the valid previous version; ``None`` for every other row."""
    if case.old_patch is None:
        return None
    return apply_patch(build_base_manifest(case.kind), case.old_patch)


def _md(
    id_: str, description: str, patch: Mapping[str, Any], field: str, rule: RuleKind, **extra: Any
) -> InvalidManifestCase:
    return InvalidManifestCase(id_, description, "ModelDeployment", patch, field, rule, **extra)


def _tn(
    id_: str, description: str, patch: Mapping[str, Any], field: str, rule: RuleKind, **extra: Any
) -> InvalidManifestCase:
    return InvalidManifestCase(id_, description, "Tenant", patch, field, rule, **extra)


S, C = RuleKind.SCHEMA, RuleKind.CEL
_ARCH = "spec.model.architecture"

INVALID_MANIFESTS: Final[tuple[InvalidManifestCase, ...]] = (
    # --- ModelDeployment: model -------------------------------------------------------------------
    _md("md-missing-model", "spec.model is missing", {"spec.model": REMOVE}, "spec.model", S),
    _md(
        "md-served-name-space",
        "served name with a space",
        {"spec.model.servedName": "llama 8b"},
        "spec.model.servedName",
        S,
    ),
    _md(
        "md-two-sources",
        "two model sources",
        {"spec.model.source": {"huggingFace": "meta-llama/Llama-3.1-8B", "uri": "s3://models/llama"}},
        "spec.model.source",
        C,
    ),
    _md("md-no-source", "no model source", {"spec.model.source": {}}, "spec.model.source", C),
    _md(
        "md-bad-hf-id",
        "malformed Hugging Face id",
        {"spec.model.source": {"huggingFace": "not a/valid/id"}},
        "spec.model.source.huggingFace",
        S,
    ),
    _md(
        "md-bad-uri-scheme",
        "URI scheme not supported",
        {"spec.model.source": {"uri": "ftp://models/llama"}},
        "spec.model.source.uri",
        C,
    ),
    _md(
        "md-uri-https",
        "https:// model URI (vLLM streams only s3:// and gs://)",
        {"spec.model.source": {"uri": "https://example.com/llama"}},
        "spec.model.source.uri",
        C,
    ),
    _md(
        "md-cache-claim-without-hf",
        "a model cache claim for a source that is read in place",
        {"spec.model.source": {"uri": "s3://models/llama", "cacheClaimName": "cache"}},
        "spec.model.source.cacheClaimName",
        C,
    ),
    _md(
        "md-bad-pvc-name",
        "PVC claim name not a DNS name",
        {"spec.model.source": {"pvc": {"claimName": "Bad_Name"}}},
        "spec.model.source.pvc.claimName",
        S,
    ),
    _md(
        "md-arch-from-config-removed",
        "fromConfig (removed from the API) next to a preset: an unknown field",
        {f"{_ARCH}.fromConfig": True},
        f"{_ARCH}.fromConfig",
        S,
        strict_only=True,
    ),
    _md(
        "md-arch-from-config-alone",
        "fromConfig alone: pruned without strict validation, which leaves no architecture (the message "
        "says fromConfig is gone and what replaces it)",
        {_ARCH: {"fromConfig": True}},
        _ARCH,
        C,
    ),
    _md("md-arch-none", "no architecture at all", {_ARCH: {}}, _ARCH, C),
    _md("md-arch-incomplete", "explicit architecture without heads", {_ARCH: {"numLayers": 32}}, _ARCH, C),
    _md("md-arch-unknown-preset", "unknown preset", {f"{_ARCH}.preset": "gpt-5"}, f"{_ARCH}.preset", S),
    _md(
        "md-arch-zero-layers",
        "zero layers",
        {_ARCH: {**_EXPLICIT_ARCH, "numLayers": 0}},
        f"{_ARCH}.numLayers",
        S,
    ),
    _md(
        "md-arch-kv-heads-not-divisor",
        "KV heads do not divide attention heads",
        {_ARCH: {**_EXPLICIT_ARCH, "numKvHeads": 6}},
        f"{_ARCH}.numKvHeads",
        C,
    ),
    _md(
        "md-arch-mla-half",
        "kvLoraRank without qkRopeHeadDim",
        {_ARCH: {**_EXPLICIT_ARCH, "kvLoraRank": 512}},
        f"{_ARCH}.kvLoraRank",
        C,
    ),
    _md(
        "md-arch-experts-per-token",
        "more experts per token than experts",
        {_ARCH: {**_EXPLICIT_ARCH, "numExperts": 8, "numExpertsPerToken": 16}},
        f"{_ARCH}.numExpertsPerToken",
        C,
    ),
    _md(
        "md-arch-weight-dtype",
        "weight dtype shorthand bf16 (the API spells it bfloat16)",
        {_ARCH: {**_EXPLICIT_ARCH, "weightDtype": "bf16"}},
        f"{_ARCH}.weightDtype",
        S,
    ),
    # --- ModelDeployment: engine ------------------------------------------------------------------
    _md(
        "md-kv-dtype-enum",
        "kvCacheDtype not a vLLM KV dtype",
        {"spec.engine.kvCacheDtype": "fp8"},
        "spec.engine.kvCacheDtype",
        S,
    ),
    _md(
        "md-kv-dtype-int8",
        "int8 KV cache is not offered",
        {"spec.engine.kvCacheDtype": "int8"},
        "spec.engine.kvCacheDtype",
        S,
    ),
    _md(
        "md-block-size-not-power-of-two",
        "block size 24",
        {"spec.engine.blockSize": 24},
        "spec.engine.blockSize",
        S,
    ),
    _md(
        "md-block-size-not-allowed",
        "block size 256 (power of two, not allowed)",
        {"spec.engine.blockSize": 256},
        "spec.engine.blockSize",
        S,
    ),
    _md(
        "md-tp-zero",
        "tensor parallel size 0",
        {"spec.engine.tensorParallelSize": 0},
        "spec.engine.tensorParallelSize",
        S,
    ),
    _md(
        "md-gpus-mismatch",
        "8-way tensor parallel on 1 GPU per replica",
        {"spec.engine.tensorParallelSize": 8},
        "spec.pool.gpusPerReplica",
        C,
    ),
    _md(
        "md-gpu-util-above-one",
        "GPU memory utilisation above 1",
        {"spec.engine.gpuMemoryUtilization": 1.5},
        "spec.engine.gpuMemoryUtilization",
        S,
    ),
    _md(
        "md-gpu-util-zero",
        "GPU memory utilisation 0",
        {"spec.engine.gpuMemoryUtilization": 0},
        "spec.engine.gpuMemoryUtilization",
        S,
    ),
    _md(
        "md-scheduling-policy-enum",
        "unknown scheduling policy",
        {"spec.engine.schedulingPolicy": "lifo"},
        "spec.engine.schedulingPolicy",
        S,
    ),
    _md(
        "md-max-model-len-tiny",
        "max model length 8",
        {"spec.engine.maxModelLen": 8},
        "spec.engine.maxModelLen",
        S,
    ),
    _md(
        "md-unchunked-small-batch",
        "no chunked prefill and a batch smaller than the context",
        {
            "spec.engine.enableChunkedPrefill": False,
            "spec.engine.maxModelLen": 32768,
            "spec.engine.maxNumBatchedTokens": 8192,
        },
        "spec.engine.maxNumBatchedTokens",
        C,
    ),
    _md(
        "md-extra-args-short-flag",
        "short option in extraArgs",
        {"spec.engine.extraArgs": ["-tp", "8"]},
        "spec.engine.extraArgs",
        C,
    ),
    _md(
        "md-unknown-engine-field",
        "typo in an engine field",
        {"spec.engine.tensorParalelSize": 2},
        "spec.engine.tensorParalelSize",
        S,
        strict_only=True,
    ),
    # --- ModelDeployment: KV cache ----------------------------------------------------------------
    _md(
        "md-bad-cpu-size",
        "CPU tier size in GB instead of a quantity",
        {"spec.kvCache.cpuSize": "256GB"},
        "spec.kvCache.cpuSize",
        S,
    ),
    _md(
        "md-negative-cpu-size",
        "negative CPU tier size",
        {"spec.kvCache.cpuSize": "-1Gi"},
        "spec.kvCache.cpuSize",
        S,
    ),
    _md(
        "md-nvme-no-storage",
        "NVMe tier without storage class or host path",
        {"spec.kvCache.nvme": {"size": "2Ti"}},
        "spec.kvCache.nvme",
        C,
    ),
    _md(
        "md-nvme-both-storage",
        "NVMe tier with both storage class and host path",
        {"spec.kvCache.nvme.hostPath": "/mnt/nvme"},
        "spec.kvCache.nvme",
        C,
    ),
    _md(
        "md-nvme-relative-path",
        "relative NVMe host path",
        {"spec.kvCache.nvme": {"size": "2Ti", "hostPath": "mnt/nvme"}},
        "spec.kvCache.nvme.hostPath",
        S,
    ),
    _md("md-negative-ttl", "negative HBM TTL", {"spec.kvCache.ttl.hbm": "-30s"}, "spec.kvCache.ttl.hbm", S),
    _md("md-zero-ttl", "zero HBM TTL", {"spec.kvCache.ttl.hbm": "0s"}, "spec.kvCache.ttl.hbm", C),
    _md(
        "md-ttl-days",
        "TTL in days (not a Go duration unit)",
        {"spec.kvCache.ttl.nvme": "1d"},
        "spec.kvCache.ttl.nvme",
        S,
    ),
    _md("md-ttl-order", "HBM TTL longer than CPU TTL", {"spec.kvCache.ttl.hbm": "1h"}, "spec.kvCache.ttl", C),
    _md(
        "md-chunk-size-zero",
        "LMCache chunk size 0",
        {"spec.kvCache.chunkSize": 0},
        "spec.kvCache.chunkSize",
        S,
    ),
    # --- ModelDeployment: pool and gateway --------------------------------------------------------
    _md("md-negative-replicas", "negative replicas", {"spec.pool.replicas": -1}, "spec.pool.replicas", S),
    _md(
        "md-gateway-zero-replicas",
        "gateway with zero replicas",
        {"spec.gateway.replicas": 0},
        "spec.gateway.replicas",
        S,
    ),
    _md(
        "md-cpu-kv-space-on-gpu",
        "cpuKvCacheSpace on a GPU pool",
        {"spec.pool.cpuKvCacheSpace": "1Gi"},
        "spec.pool.cpuKvCacheSpace",
        C,
    ),
    _md(
        "md-bad-gpu-memory",
        "GPU memory not a quantity",
        {"spec.pool.gpuMemory": "141 GB"},
        "spec.pool.gpuMemory",
        S,
    ),
    _md(
        "md-toleration-operator",
        "toleration operator In",
        {"spec.pool.tolerations": [{"key": "nvidia.com/gpu", "operator": "In"}]},
        "spec.pool.tolerations[0].operator",
        S,
    ),
    _md(
        "md-pool-selects-a-gpu-group",
        "a shared pool selecting a dedicated GPU group's nodes",
        {"spec.pool.nodeSelector": {"kvfleet.io/gpu-group": "bank-h200"}},
        "spec.pool.nodeSelector",
        C,
    ),
    _md(
        "md-pool-tolerates-a-gpu-group",
        "a shared pool tolerating a dedicated GPU group's taint",
        {"spec.pool.tolerations": [{"key": "kvfleet.io/gpu-group", "operator": "Exists"}]},
        "spec.pool.tolerations",
        C,
    ),
    _md(
        "md-shared-tier-without-size",
        "an enabled shared KV tier of size 0 (a tier that holds nothing)",
        {"spec.kvCache.shared": {"enabled": True, "size": "0Gi"}},
        "spec.kvCache.shared.size",
        C,
    ),
    _md(
        "md-autoscaling-min-above-max",
        "autoscaling whose floor is above its ceiling",
        {"spec.pool.autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "spec.pool.autoscaling",
        C,
    ),
    _md(
        "md-autoscaling-cap-above-max",
        "a best-effort cap above the most replicas",
        {"spec.pool.autoscaling": {"maxReplicas": 2, "bestEffortMaxReplicas": 3}},
        "spec.pool.autoscaling",
        C,
    ),
    _md(
        "md-autoscaling-without-prometheus",
        "autoscaling enabled with no Prometheus for KEDA to read",
        {"spec.pool.autoscaling": {"enabled": True}},
        "spec.pool.autoscaling.prometheusAddress",
        C,
    ),
    _md(
        "md-autoscaling-prometheus-not-http",
        "a Prometheus address that is not an http(s) URL",
        {"spec.pool.autoscaling": {"enabled": True, "prometheusAddress": "prometheus:9090"}},
        "spec.pool.autoscaling.prometheusAddress",
        S,
    ),
    _md(
        "md-cpu-kv-space-not-whole-gib",
        "cpuKvCacheSpace that is not a whole number of GiB (vLLM reads an integer)",
        {
            "spec.pool.gpusPerReplica": 0,
            "spec.engine.tensorParallelSize": 1,
            "spec.pool.cpuKvCacheSpace": "1536Mi",
        },
        "spec.pool.cpuKvCacheSpace",
        S,
    ),
    _md(
        "md-bad-gpu-resource",
        "GPU resource that is not an extended resource name",
        {"spec.pool.gpuResource": "gpu"},
        "spec.pool.gpuResource",
        S,
    ),
    _md(
        "md-exposure-service-type",
        "gateway Service type that Kubernetes does not have",
        {"spec.gateway.exposure": {"service": {"type": "External"}}},
        "spec.gateway.exposure.service.type",
        S,
    ),
    _md(
        "md-exposure-ingress-and-route",
        "both an Ingress and an HTTPRoute to the gateway",
        {
            "spec.gateway.exposure": {
                "ingress": {"host": "llm.example.com"},
                "httpRoute": {"parentRefs": [{"name": "edge"}], "hostnames": ["llm.example.com"]},
            }
        },
        "spec.gateway.exposure.httpRoute",
        C,
    ),
    _md(
        "md-exposure-tls-without-secret",
        "Ingress TLS that names no Secret",
        {"spec.gateway.exposure": {"ingress": {"host": "llm.example.com", "tls": {}}}},
        "spec.gateway.exposure.ingress.tls.secretName",
        C,
    ),
    _md(
        "md-exposure-host-with-scheme",
        "Ingress host written as a URL",
        {"spec.gateway.exposure": {"ingress": {"host": "https://llm.example.com"}}},
        "spec.gateway.exposure.ingress.host",
        C,
    ),
    _md(
        "md-exposure-host-ip",
        "Ingress host that is an IP address",
        {"spec.gateway.exposure": {"ingress": {"host": "10.0.0.7"}}},
        "spec.gateway.exposure.ingress.host",
        C,
    ),
    _md(
        "md-exposure-wildcard-hostname",
        "HTTPRoute wildcard hostname (status.endpoint needs a name clients can call)",
        {
            "spec.gateway.exposure": {
                "httpRoute": {"parentRefs": [{"name": "edge"}], "hostnames": ["*.example.com"]}
            }
        },
        "spec.gateway.exposure.httpRoute.hostnames",
        C,
    ),
    _md(
        "md-exposure-route-without-parent",
        "HTTPRoute attached to no Gateway",
        {"spec.gateway.exposure": {"httpRoute": {"parentRefs": [], "hostnames": ["llm.example.com"]}}},
        "spec.gateway.exposure.httpRoute.parentRefs",
        S,
    ),
    _md(
        "md-data-plane-unknown",
        "a gateway data plane kvfleet does not run",
        {"spec.gateway.dataPlane": "nginx"},
        "spec.gateway.dataPlane",
        S,
    ),
    _md(
        "md-inference-pool-no-gateway-pods",
        "an InferencePool without the platform gateway's pods (the NetworkPolicies need them)",
        {"spec.gateway.inferencePool": {}},
        "spec.gateway.inferencePool.gatewayPods",
        S,
    ),
    _md(
        "md-inference-pool-empty-labels",
        "platform gateway pods selected by no label (every pod of the namespace)",
        {"spec.gateway.inferencePool": {"gatewayPods": {"namespace": "gateways", "matchLabels": {}}}},
        "spec.gateway.inferencePool.gatewayPods.matchLabels",
        S,
    ),
    _md(
        "md-inference-pool-bad-label-key",
        "a platform gateway pod label key Kubernetes does not allow",
        {"spec.gateway.inferencePool": {"gatewayPods": {"matchLabels": {"gateway name!": "edge"}}}},
        "spec.gateway.inferencePool.gatewayPods.matchLabels",
        C,
    ),
    _md(
        "md-inference-pool-bad-namespace",
        "a platform gateway namespace that is not a namespace name",
        {"spec.gateway.inferencePool": {"gatewayPods": {"namespace": "Gateways", "matchLabels": {"a": "b"}}}},
        "spec.gateway.inferencePool.gatewayPods.namespace",
        S,
    ),
    _md(
        "md-fair-queuing-order",
        "a fair-queuing order the gateway does not have",
        {"spec.gateway.fairQueuing": "wfq"},
        "spec.gateway.fairQueuing",
        S,
    ),
    _md(
        "md-routing",
        "a routing the gateway does not have",
        {"spec.gateway.routing": "random"},
        "spec.gateway.routing",
        S,
    ),
    _md(
        "md-engine-in-flight-negative",
        "a negative number of requests in flight per engine replica",
        {"spec.gateway.engineInFlightPerReplica": -1},
        "spec.gateway.engineInFlightPerReplica",
        S,
    ),
    _md(
        "md-engine-in-flight-below-gateways",
        "fewer requests in flight per engine replica than gateway replicas (one would get none)",
        {"spec.gateway.replicas": 3, "spec.gateway.engineInFlightPerReplica": 2},
        "spec.gateway.engineInFlightPerReplica",
        C,
    ),
    _md(
        "md-queue-timeout-zero",
        "a queue timeout of zero (every held request refused at once)",
        {"spec.gateway.queueTimeout": "0s"},
        "spec.gateway.queueTimeout",
        C,
    ),
    _md(
        "md-queue-timeout-too-long",
        "a queue timeout above 10m",
        {"spec.gateway.queueTimeout": "1h"},
        "spec.gateway.queueTimeout",
        C,
    ),
    _md(
        "md-queue-timeout-not-a-duration",
        "a queue timeout without a unit",
        {"spec.gateway.queueTimeout": "10"},
        "spec.gateway.queueTimeout",
        S,
    ),
    _md(
        "md-template-gpu-resource",
        "pod template resources naming the GPU resource",
        {"spec.pool.podTemplate": {"resources": {"limits": {"nvidia.com/gpu": "4"}}}},
        "spec.pool.podTemplate.resources",
        C,
    ),
    _md(
        "md-template-security-context",
        "pod template securityContext",
        {"spec.pool.podTemplate": {"securityContext": {"runAsUser": 0}}},
        "spec.pool.podTemplate.securityContext",
        C,
    ),
    _md(
        "md-template-host-network",
        "pod template hostNetwork",
        {"spec.pool.podTemplate": {"hostNetwork": True}},
        "spec.pool.podTemplate.hostNetwork",
        C,
    ),
    _md(
        "md-template-host-pid",
        "pod template hostPID",
        {"spec.pool.podTemplate": {"hostPID": True}},
        "spec.pool.podTemplate.hostPID",
        C,
    ),
    _md(
        "md-template-service-account",
        "pod template serviceAccountName",
        {"spec.pool.podTemplate": {"serviceAccountName": "admin"}},
        "spec.pool.podTemplate.serviceAccountName",
        C,
    ),
    _md(
        "md-template-automount-token",
        "pod template automountServiceAccountToken",
        {"spec.pool.podTemplate": {"automountServiceAccountToken": True}},
        "spec.pool.podTemplate.automountServiceAccountToken",
        C,
    ),
    _md(
        "md-template-volumes",
        "pod template volumes (could mount another tenant's keys)",
        {"spec.pool.podTemplate": {"volumes": [{"name": "k", "secret": {"secretName": "other-keys"}}]}},
        "spec.pool.podTemplate.volumes",
        C,
    ),
    _md(
        "md-template-node-name",
        "pod template nodeName (skips the scheduler and the groups' taints)",
        {"spec.pool.podTemplate": {"nodeName": "gpu-node-1"}},
        "spec.pool.podTemplate.nodeName",
        C,
    ),
    _md(
        "md-template-kvfleet-label",
        "pod template label the NetworkPolicies select on",
        {"spec.pool.podTemplate": {"labels": {"kvfleet.io/pool": "other"}}},
        "spec.pool.podTemplate.labels",
        C,
    ),
    _md(
        "md-template-app-label",
        "pod template app.kubernetes.io label (Services select on it)",
        {"spec.pool.podTemplate": {"labels": {"app.kubernetes.io/component": "gateway"}}},
        "spec.pool.podTemplate.labels",
        C,
    ),
    _md(
        "md-template-apparmor-annotation",
        "pod template AppArmor annotation",
        {
            "spec.pool.podTemplate": {
                "annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}
            }
        },
        "spec.pool.podTemplate.annotations",
        C,
    ),
    _md(
        "md-template-plugin-env",
        "pod template env turning off the tenant-aware block pool",
        {"spec.pool.podTemplate": {"env": [{"name": "VLLM_PLUGINS", "value": ""}]}},
        "spec.pool.podTemplate.env",
        C,
    ),
    _md(
        "md-template-kvfleet-env",
        "pod template env replacing the tenant table",
        {"spec.pool.podTemplate": {"env": [{"name": "KVFLEET_TENANT_TABLE", "value": "/tmp/t.json"}]}},
        "spec.pool.podTemplate.env",
        C,
    ),
    _md(
        "md-template-ld-preload-env",
        "pod template env preloading a library into the engine",
        {"spec.pool.podTemplate": {"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}},
        "spec.pool.podTemplate.env",
        C,
    ),
    _md(
        "md-template-env-from-without-prefix",
        "pod template envFrom without a prefix (its keys could be reserved names)",
        {"spec.pool.podTemplate": {"envFrom": [{"configMapRef": {"name": "a"}}]}},
        "spec.pool.podTemplate.envFrom",
        C,
    ),
    _md(
        "md-template-env-from-reserved-prefix",
        "pod template envFrom under a prefix that spells a reserved name",
        {"spec.pool.podTemplate": {"envFrom": [{"prefix": "VLLM_", "configMapRef": {"name": "a"}}]}},
        "spec.pool.podTemplate.envFrom",
        C,
    ),
    _md(
        "md-template-env-value-and-from",
        "pod template env with both value and valueFrom",
        {
            "spec.pool.podTemplate": {
                "env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            }
        },
        "spec.pool.podTemplate.env",
        C,
    ),
    _md(
        "md-template-env-from-two-sources",
        "pod template envFrom naming a ConfigMap and a Secret in one entry",
        {"spec.pool.podTemplate": {"envFrom": [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]}},
        "spec.pool.podTemplate.envFrom",
        C,
    ),
    _md(
        "md-template-affinity-gpu-group",
        "pod template node affinity onto a dedicated GPU group",
        {
            "spec.pool.podTemplate": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "kvfleet.io/gpu-group", "operator": "In", "values": ["bank"]}
                                    ]
                                }
                            ]
                        }
                    }
                }
            }
        },
        "spec.pool.podTemplate.affinity.nodeAffinity",
        C,
    ),
    _md(
        "md-gateway-bad-cpu",
        "gateway CPU request not a quantity",
        {"spec.gateway.resources": {"requests": {"cpu": "two"}}},
        "spec.gateway.resources.requests.cpu",
        S,
    ),
    # --- Tenant -----------------------------------------------------------------------------------
    _tn(
        "tn-missing-ref",
        "no modelDeploymentRef",
        {"spec.modelDeploymentRef": REMOVE},
        "spec.modelDeploymentRef",
        S,
    ),
    _tn(
        "tn-bad-ref-name",
        "ModelDeployment name not a DNS name",
        {"spec.modelDeploymentRef.name": "Qwen72B"},
        "spec.modelDeploymentRef.name",
        S,
    ),
    _tn("tn-tier-enum", "unknown tier", {"spec.tier": "gold"}, "spec.tier", S),
    _tn("tn-isolation-enum", "unknown isolation", {"spec.isolation": "private"}, "spec.isolation", S),
    _tn(
        "tn-dedicated-missing",
        "dedicated isolation without dedicated settings",
        {"spec.isolation": "dedicated"},
        "spec.dedicated",
        C,
    ),
    _tn(
        "tn-dedicated-on-salted",
        "dedicated settings on a salted tenant",
        {"spec.dedicated": {"gpuGroup": "bank-h200", "replicas": 1}},
        "spec.dedicated",
        C,
    ),
    _tn(
        "tn-dedicated-on-shared",
        "dedicated settings on a shared tenant",
        {"spec.isolation": "shared", "spec.dedicated": {"gpuGroup": "bank-h200"}},
        "spec.dedicated",
        C,
    ),
    _tn(
        "tn-dedicated-zero-replicas",
        "dedicated pool with zero replicas",
        {"spec.isolation": "dedicated", "spec.dedicated": {"gpuGroup": "bank-h200", "replicas": 0}},
        "spec.dedicated.replicas",
        S,
    ),
    _tn(
        "tn-dedicated-autoscaling-bounds",
        "dedicated autoscaling with minReplicas above maxReplicas",
        {
            "spec.isolation": "dedicated",
            "spec.dedicated": {
                "gpuGroup": "bank-h200",
                "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2},
            },
        },
        "spec.dedicated.autoscaling",
        C,
    ),
    _tn(
        "tn-dedicated-bad-group",
        "GPU group not a DNS label",
        {"spec.isolation": "dedicated", "spec.dedicated": {"gpuGroup": "Bank_H200"}},
        "spec.dedicated.gpuGroup",
        S,
    ),
    _tn(
        "tn-quota-above-100",
        "HBM quota above 100%",
        {"spec.kvQuota.hbm": "120%", "spec.burstLimit": "100%"},
        "spec.kvQuota.hbm",
        C,
    ),
    _tn(
        "tn-quota-negative-tokens",
        "negative HBM token quota",
        {"spec.kvQuota.hbm": -5},
        "spec.kvQuota.hbm",
        C,
    ),
    _tn(
        "tn-quota-not-a-share",
        "HBM quota neither share nor tokens",
        {"spec.kvQuota.hbm": "lots"},
        "spec.kvQuota.hbm",
        S,
    ),
    _tn(
        "tn-burst-below-quota",
        "burst limit below the HBM quota",
        {"spec.kvQuota.hbm": "40%", "spec.burstLimit": "30%"},
        "spec.burstLimit",
        C,
    ),
    _tn("tn-burst-above-100", "burst limit above 100%", {"spec.burstLimit": "150%"}, "spec.burstLimit", C),
    _tn(
        "tn-burst-fraction",
        "burst limit as a fraction instead of a percentage",
        {"spec.burstLimit": "0.5"},
        "spec.burstLimit",
        S,
    ),
    _tn("tn-bad-cpu-quota", "CPU quota in GB", {"spec.kvQuota.cpu": "16GB"}, "spec.kvQuota.cpu", S),
    _tn(
        "tn-negative-nvme-quota", "negative NVMe quota", {"spec.kvQuota.nvme": "-1Gi"}, "spec.kvQuota.nvme", S
    ),
    _tn("tn-negative-ttl", "negative CPU TTL", {"spec.ttl": {"cpu": "-10m"}}, "spec.ttl.cpu", S),
    _tn("tn-zero-ttl", "zero HBM TTL", {"spec.ttl": {"hbm": "0s"}}, "spec.ttl.hbm", C),
    _tn("tn-ttl-no-unit", "TTL without a unit", {"spec.ttl": {"hbm": "30"}}, "spec.ttl.hbm", S),
    _tn(
        "tn-rate-zero",
        "zero requests per minute",
        {"spec.rateLimits": {"requestsPerMinute": 0}},
        "spec.rateLimits.requestsPerMinute",
        S,
    ),
    _tn(
        "tn-concurrency-negative",
        "negative max concurrency",
        {"spec.rateLimits": {"maxConcurrent": -1}},
        "spec.rateLimits.maxConcurrent",
        S,
    ),
    _tn(
        "tn-secret-ref-no-name",
        "API key Secret reference without a name",
        {"spec.apiKeySecretRef": {"key": "token"}},
        "spec.apiKeySecretRef.name",
        S,
    ),
    _tn(
        "tn-unknown-field",
        "typo: quota instead of kvQuota",
        {"spec.quota": {"hbm": "20%"}},
        "spec.quota",
        S,
        strict_only=True,
    ),
    _tn(
        "tn-isolation-salted-to-shared",
        "changing isolation from salted to shared",
        {"spec.isolation": "shared"},
        "spec.isolation",
        C,
        old_patch={},
    ),
    _tn(
        "tn-isolation-dedicated-to-salted",
        "changing isolation from dedicated to salted",
        {},
        "spec.isolation",
        C,
        old_patch={"spec.isolation": "dedicated", "spec.dedicated": {"gpuGroup": "bank-h200"}},
    ),
    _tn(
        "tn-gpu-group-changed",
        "moving a dedicated tenant to another GPU group (it would take another tenant's group)",
        {"spec.isolation": "dedicated", "spec.dedicated": {"gpuGroup": "other-h200"}},
        "spec.dedicated.gpuGroup",
        C,
        old_patch={"spec.isolation": "dedicated", "spec.dedicated": {"gpuGroup": "bank-h200"}},
    ),
)
