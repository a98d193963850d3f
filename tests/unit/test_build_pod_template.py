"""spec.pool.podTemplate merged over the engine pods (build/engine.py), the GPU resource name, and memory
requests that carry the LMCache CPU tier. Built from the example manifests through the real builders."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.api.modeldeployment import FORBIDDEN_POD_FIELDS, PodTemplate
from kvfleet_operator.build.engine import build_engine_statefulset, format_bytes
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children, shared_workload
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import KeyFile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
GIB = 1 << 30

TEMPLATE: dict[str, Any] = {
    "labels": {"team": "inference", "cost-center": "42"},
    "annotations": {"prometheus.io/scrape": "false"},
    "resources": {
        "requests": {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "50Gi"},
        "limits": {"memory": "96Gi"},
    },
    "env": [
        {"name": "HOME", "value": "/tmp/home"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ],
    "envFrom": [{"prefix": "TUNING_", "configMapRef": {"name": "vllm-tuning"}}],
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-high",
    "imagePullSecrets": [{"name": "registry"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"team": "inference"}},
                    },
                }
            ]
        },
    },
}


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def _qwen(**pool: Any) -> ModelDeployment:
    doc = _doc("modeldeployment-qwen72b.yaml", uid="md-uid")
    doc["spec"]["pool"].update(copy.deepcopy(pool))
    return ModelDeployment.model_validate(doc)


def _bank() -> Tenant:
    return Tenant.model_validate(
        _doc("tenant-bank.yaml", uid="uid-bank", creationTimestamp="2026-01-01T00:00:00Z")
    )


def _statefulsets(md: ModelDeployment, tenants: list[Tenant] | None = None) -> dict[str, dict[str, Any]]:
    tenants = tenants or []
    capacity = compute_pool_capacity(md)
    children = build_desired_children(md, capacity, tenants, admit_tenants(capacity, tenants), KEYS, IMAGES)
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "StatefulSet"}


def _engine(sts: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def test_the_flagship_cpu_tier_is_visible_to_the_scheduler() -> None:
    """256Gi of LMCache CPU tier on top of the engine's own 32Gi: the memory request says 288Gi."""
    resources = _engine(_statefulsets(_qwen())["qwen72b-engine"])["resources"]
    assert resources["requests"]["memory"] == "288Gi"
    assert resources["requests"]["cpu"] == "4"
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert "memory" not in resources["limits"]  # no limit unless the template sets one


def test_a_cpu_engine_requests_its_kv_space_and_tier() -> None:
    md = ModelDeployment.model_validate(_doc("local/modeldeployment-tiny.yaml", uid="md-uid"))
    (sts,) = _statefulsets(md).values()
    engine = _engine(sts)
    # 4Gi of its own + 256Mi CPU tier + 1Gi of VLLM_CPU_KVCACHE_SPACE.
    assert engine["resources"]["requests"]["memory"] == format_bytes(4 * GIB + 256 * (1 << 20) + GIB)
    assert engine["command"][engine["command"].index("--cpu-kv-gib") + 1] == "1"
    assert "--gpu" not in engine["command"]


def test_the_template_is_merged_over_the_pod() -> None:
    sts = _statefulsets(_qwen(podTemplate=TEMPLATE))["qwen72b-engine"]
    pod = sts["spec"]["template"]
    engine = _engine(sts)
    assert pod["metadata"]["labels"]["team"] == "inference"
    assert pod["metadata"]["labels"]["kvfleet.io/pool"] == "shared"  # the operator's labels stay
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "false"}
    assert engine["resources"]["requests"] == {
        "cpu": "16",
        "ephemeral-storage": "50Gi",
        "memory": "320Gi",  # the template's 64Gi + the 256Gi CPU tier
        "nvidia.com/gpu": "8",
    }
    assert engine["resources"]["limits"] == {"memory": "352Gi", "nvidia.com/gpu": "8"}
    env = {e["name"]: e for e in engine["env"]}
    assert env["HOME"] == {"name": "HOME", "value": "/tmp/home"}  # replaces the operator's, once
    assert [e["name"] for e in engine["env"]].count("HOME") == 1
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["VLLM_PLUGINS"]["value"] == "kvfleet"  # the tenant-aware block pool stays on
    assert engine["envFrom"] == [{"prefix": "TUNING_", "configMapRef": {"name": "vllm-tuning"}}]
    spec = pod["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "inference-high"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["affinity"]["podAntiAffinity"] == TEMPLATE["affinity"]["podAntiAffinity"]
    # What the template may never change is still the operator's.
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert engine["securityContext"]["allowPrivilegeEscalation"] is False
    assert "hostNetwork" not in spec and "serviceAccountName" not in spec
    # The example fetches its weights from Hugging Face: the fetch-model init container's cache is the
    # operator's volume too, and the template cannot add one.
    assert {v["name"] for v in spec["volumes"]} == {"config", "keys", "tmp", "dshm", "model-cache"}


def test_every_user_node_term_keeps_the_dedicated_groups_requirement() -> None:
    """Node terms are ORed: the operator's required expressions go into each of the user's terms, so no
    term leads a dedicated pool off its group (or a shared pool onto one)."""
    md = _qwen(podTemplate=TEMPLATE)
    dedicated = next(s for n, s in _statefulsets(md, [_bank()]).items() if n != "qwen72b-engine")
    terms = dedicated["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2
    for zone, term in zip("ab", terms, strict=True):
        assert term["matchExpressions"] == [
            {"key": "zone", "operator": "In", "values": [zone]},
            {"key": "kvfleet.io/gpu-group", "operator": "In", "values": ["bank-h200"]},
        ]
    tolerations = dedicated["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "kvfleet.io/gpu-group", "operator": "Equal", "value": "bank-h200"} in tolerations


def test_a_wildcard_toleration_keeps_the_shared_pool_off_the_groups_in_every_term() -> None:
    md = _qwen(podTemplate=TEMPLATE, tolerations=[{"operator": "Exists"}])
    terms = _statefulsets(md)["qwen72b-engine"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert all(
        {"key": "kvfleet.io/gpu-group", "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms
    )


@pytest.mark.parametrize("resource", ["nvidia.com/mig-1g.10gb", "amd.com/gpu"])
def test_the_gpu_resource_name_is_the_pools(resource: str) -> None:
    engine = _engine(_statefulsets(_qwen(gpuResource=resource))["qwen72b-engine"])
    assert engine["resources"]["requests"][resource] == engine["resources"]["limits"][resource] == "8"
    assert "nvidia.com/gpu" not in engine["resources"]["requests"]
    assert "--gpu" in engine["command"] and "--cpu-kv-gib" not in engine["command"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("security_context", {"runAsUser": 0}),
        ("host_network", True),
        ("host_pid", True),
        ("host_ipc", True),
        ("service_account_name", "admin"),
        ("automount_service_account_token", True),
        ("volumes", [{"name": "k", "secret": {"secretName": "other-tenant-keys"}}]),
        ("node_name", "gpu-1"),
        ("labels", {"kvfleet.io/pool": "other"}),
        ("labels", {"app.kubernetes.io/component": "gateway"}),
        ("annotations", {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}),
    ],
)
def test_the_builder_refuses_what_the_api_refuses(field: str, value: Any) -> None:
    """Defence in depth: a template that got past the CRD and the API model (built without validation
    here) is refused by the builder with the API's message, never merged."""
    workload = shared_workload(_qwen(), IMAGES)
    assert build_engine_statefulset(workload)  # the same pool builds without the template
    bad = PodTemplate.model_construct(**{field: value})
    with pytest.raises(ValueError, match=r"spec\.pool\.podTemplate\.") as refused:
        build_engine_statefulset(dataclasses.replace(workload, template=bad))
    assert "cannot be set" in str(refused.value) or "may not" in str(refused.value)


def test_env_the_operator_owns_is_refused_by_the_model_and_the_builder() -> None:
    with pytest.raises(ValidationError, match="VLLM_PLUGINS"):
        _qwen(podTemplate={"env": [{"name": "VLLM_PLUGINS", "value": ""}]})
    with pytest.raises(ValidationError, match="LMCACHE_"):
        _qwen(podTemplate={"env": [{"name": "LMCACHE_CONFIG_FILE", "value": "/x"}]})


@pytest.mark.parametrize("name", sorted(FORBIDDEN_POD_FIELDS))
def test_each_refused_field_says_why(name: str) -> None:
    value: Any = {"securityContext": {}, "volumes": []}.get(name, "x")
    if name in {"hostNetwork", "hostPID", "hostIPC", "automountServiceAccountToken"}:
        value = False  # even false: the operator's setting is the only one
    with pytest.raises(ValidationError) as refused:
        _qwen(podTemplate={name: value})
    assert f"spec.pool.podTemplate.{name} cannot be set: {FORBIDDEN_POD_FIELDS[name]}" in str(refused.value)


def test_memory_in_the_template_must_be_bytes() -> None:
    with pytest.raises(ValidationError, match="not a size"):
        _qwen(podTemplate={"resources": {"requests": {"memory": "500m"}}})


@pytest.mark.parametrize(
    ("n", "text"), [(288 * GIB, "288Gi"), (1536 << 20, "1536Mi"), (1000, "1000"), (0, "0")]
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
