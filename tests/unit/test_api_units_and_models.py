"""Parse helpers (quantities, durations, percentages) and the models' defaults and runtime mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from invalid_manifests import apply_patch, build_base_manifest
from kvfleet_operator.api import (
    ArchitecturePreset,
    ModelDeployment,
    Tenant,
    WeightDtype,
    parse_duration,
    parse_manifest,
    parse_percent,
    parse_quantity,
)
from kvfleet_runtime.config import Isolation, SlaTier
from kvfleet_runtime.kv import sizing
from kvfleet_runtime.kv.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256Gi", 256 * 1024**3),
        ("2Ti", 2 * 1024**4),
        ("1.5Gi", 3 * 1024**3 // 2),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("1024", 1024),
        (4096, 4096),
        ("0", 0),
        ("0.5Ki", 512),
    ],
)
def test_parse_quantity(text: str | int, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["256GB", "-1Gi", "1e3", "Gi", "", "1 Gi", "500m", "1.2.3Gi", True])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("10m", 600),
        ("24h", 86_400),
        ("1h30m", 5_400),
        ("500ms", 0.5),
        ("1.5h", 5_400),
        ("0s", 0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-30s", "30", "1d", "30 s", "s", "", "30sec", "1w"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "fraction"), [("50%", 0.5), ("12.5%", 0.125), ("0%", 0.0), ("100%", 1.0)])
def test_parse_percent(text: str, fraction: float) -> None:
    assert parse_percent(text) == pytest.approx(fraction)


@pytest.mark.parametrize("text", ["50", "0.5", "-5%", "%", "fifty%"])
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="percentage"):
        parse_percent(text)


def test_model_deployment_defaults() -> None:
    md = ModelDeployment.model_validate(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "ModelDeployment",
            "spec": {
                "model": {
                    "servedName": "m",
                    "source": {"uri": "s3://bucket/m"},
                    "architecture": {"preset": "llama-3.1-8b"},
                }
            },
        }
    )
    ttl = md.spec.kv_cache.ttl
    assert (parse_duration(ttl.hbm), parse_duration(ttl.cpu), parse_duration(ttl.nvme)) == (30, 600, 86_400)
    assert md.spec.engine.kv_cache_dtype == "auto"
    assert md.spec.engine.block_size == 16
    assert md.spec.engine.enable_prefix_caching and md.spec.engine.enable_chunked_prefill
    assert md.spec.engine.scheduling_policy == "priority"
    assert md.spec.pool.replicas == 1 and md.spec.gateway.replicas == 2
    assert parse_quantity(md.spec.kv_cache.cpu_size) == 0 and md.spec.kv_cache.nvme is None
    assert md.spec.pool.gpu_resource == "nvidia.com/gpu"
    assert md.spec.pool.pod_template.model_dump(exclude_defaults=True) == {}


def test_tenant_defaults() -> None:
    tenant = Tenant.model_validate(
        {"apiVersion": "kvfleet.io/v1alpha1", "kind": "Tenant", "spec": {"modelDeploymentRef": {"name": "m"}}}
    )
    assert parse_percent(tenant.spec.burst_limit) == 0.5
    assert tenant.spec.isolation is Isolation.SALTED
    assert tenant.spec.tier is SlaTier.STANDARD
    assert tenant.spec.ttl.hbm is None  # taken from the ModelDeployment
    assert tenant.spec.dedicated is None and tenant.spec.api_key_secret_ref is None


def test_qwen72b_example_reads_as_specified() -> None:
    md = parse_manifest(yaml.safe_load((ROOT / "examples" / "modeldeployment-qwen72b.yaml").read_text()))
    assert isinstance(md, ModelDeployment)
    engine, kv = md.spec.engine, md.spec.kv_cache
    assert engine.tensor_parallel_size == 8 and md.spec.pool.gpus_per_replica == 8
    assert engine.kv_cache_dtype == "fp8_e5m2" and engine.max_num_batched_tokens == 8192
    assert engine.enable_prefix_caching and engine.enable_chunked_prefill
    assert parse_quantity(kv.cpu_size) == 256 * 1024**3
    assert kv.nvme is not None and parse_quantity(kv.nvme.size) == 2 * 1024**4
    assert md.spec.model.architecture.preset is ArchitecturePreset.QWEN2_5_72B


@pytest.mark.parametrize(
    ("name", "tier", "isolation"),
    [
        ("tenant-bank.yaml", "premium", "dedicated"),
        ("tenant-saas.yaml", "standard", "salted"),
        ("tenant-startup-a.yaml", "basic", "shared"),
        ("tenant-startup-b.yaml", "basic", "shared"),
    ],
)
def test_tenant_examples(name: str, tier: str, isolation: str) -> None:
    tenant = parse_manifest(yaml.safe_load((ROOT / "examples" / name).read_text()))
    assert isinstance(tenant, Tenant)
    assert (tenant.spec.tier, tenant.spec.isolation) == (tier, isolation)
    assert (tenant.spec.dedicated is not None) == (isolation == "dedicated")


def test_architecture_maps_one_to_one_onto_the_runtime() -> None:
    """Explicit fields become kvfleet_runtime.kv.sizing.ModelArchitecture unchanged."""
    api_fields = set(
        ModelDeployment.model_fields["spec"]
        .annotation.model_fields["model"]  # type: ignore[union-attr]
        .annotation.model_fields["architecture"]
        .annotation.model_fields
    ) - {"preset"}
    assert api_fields == set(sizing.ModelArchitecture.model_fields)
    assert {d.value for d in WeightDtype} == {d.value for d in sizing.WeightDtype}
    assert {p.value for p in ArchitecturePreset} == set(PRESETS)

    manifest = apply_patch(
        build_base_manifest("ModelDeployment"),
        {
            "spec.model.architecture": {
                "numLayers": 2,
                "numAttentionHeads": 4,
                "numKvHeads": 2,
                "headDim": 32,
                "hiddenSize": 128,
                "numParameters": 1_000_000,
                "weightDtype": "bfloat16",
            }
        },
    )
    md = parse_manifest(manifest)
    assert isinstance(md, ModelDeployment)
    arch = sizing.ModelArchitecture(**md.spec.model.architecture.to_sizing_fields())
    # The tiny model: 2 layers x 2 KV heads x 32 dims x K and V x 2 bytes = 512 bytes per token.
    assert sizing.compute_kv_bytes_per_token(arch) == 512


def test_preset_architecture_has_no_explicit_fields() -> None:
    md = parse_manifest(build_base_manifest("ModelDeployment"))
    assert isinstance(md, ModelDeployment)
    assert md.spec.model.architecture.to_sizing_fields() == {}


def test_manifest_round_trips_through_the_model() -> None:
    """Dumping a parsed manifest by alias and parsing it again gives the same model (camelCase wire)."""
    for kind in ("ModelDeployment", "Tenant"):
        model = parse_manifest(build_base_manifest(kind))
        again = parse_manifest(model.model_dump(by_alias=True, exclude_none=True, mode="json"))
        assert again == model
