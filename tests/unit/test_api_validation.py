"""Every row of the invalid-manifest table is rejected, and the error names the field.

The same table is replayed against a real kube-apiserver by the cluster tests. Here each row runs through
the pydantic models; rows the OpenAPI schema alone must catch also run through a real JSON-schema
validator on the generated CRD, and rows that only CEL catches must pass that schema (so the table's
schema/CEL classification is checked, not just asserted).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS30Validator, oas30_format_checker

from invalid_manifests import (
    INVALID_MANIFESTS,
    REMOVE,
    InvalidManifestCase,
    RuleKind,
    apply_patch,
    build_base_manifest,
    build_invalid_manifest,
    build_old_manifest,
)
from kvfleet_operator.api.manifest import ManifestError, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = {"ModelDeployment": "kvfleet.io_modeldeployments.yaml", "Tenant": "kvfleet.io_tenants.yaml"}


@functools.cache
def _schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / CRD_FILES[kind]).read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _schema_error_paths(kind: str, manifest: dict[str, Any]) -> set[str]:
    """Kubernetes-style paths of every JSON-schema error (``required`` errors name the missing field)."""
    paths = set()
    for error in OAS30Validator(_schema(kind), format_checker=oas30_format_checker).iter_errors(manifest):
        path = ""
        for part in error.absolute_path:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        if error.validator == "required":
            missing = str(error.message).split("'")[1]
            path = f"{path}.{missing}" if path else missing
        paths.add(path)
    return paths


def test_table_is_big_and_ids_are_unique() -> None:
    assert len(INVALID_MANIFESTS) >= 40
    assert len({case.id for case in INVALID_MANIFESTS}) == len(INVALID_MANIFESTS)
    kinds = {case.rule for case in INVALID_MANIFESTS}
    assert kinds == {RuleKind.SCHEMA, RuleKind.CEL}
    assert any(case.is_transition for case in INVALID_MANIFESTS)


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_base_manifests_are_valid_everywhere(kind: str) -> None:
    manifest = build_base_manifest(kind)
    parse_manifest(manifest)
    assert _schema_error_paths(kind, manifest) == set()


@pytest.mark.parametrize("case", INVALID_MANIFESTS, ids=lambda case: case.id)
def test_pydantic_rejects_and_names_the_field(case: InvalidManifestCase) -> None:
    old = build_old_manifest(case)
    if old is not None:
        parse_manifest(old)  # the previous version itself is valid: only the transition is not
    with pytest.raises(ManifestError) as caught:
        parse_manifest(build_invalid_manifest(case), old)
    assert case.field in str(caught.value), f"{case.id}: error does not name {case.field}: {caught.value}"


@pytest.mark.parametrize("case", INVALID_MANIFESTS, ids=lambda case: case.id)
def test_openapi_schema_agrees_with_the_rule_kind(case: InvalidManifestCase) -> None:
    manifest = build_invalid_manifest(case)
    paths = _schema_error_paths(case.kind, manifest)
    if case.rule is RuleKind.SCHEMA and not case.strict_only:
        assert case.field in paths, f"{case.id}: schema errors {paths} do not name {case.field}"
    else:
        # CEL rows (and unknown fields, which only strict field validation rejects) pass the schema.
        assert paths == set(), f"{case.id}: expected only CEL to reject it, schema says {paths}"


def test_transition_rows_are_valid_as_new_objects() -> None:
    """Isolation changes are only wrong as updates: each new version alone is a valid Tenant."""
    for case in INVALID_MANIFESTS:
        if case.is_transition:
            parse_manifest(build_invalid_manifest(case))


def test_same_isolation_update_is_allowed() -> None:
    old = build_base_manifest("Tenant")
    new = apply_patch(build_base_manifest("Tenant"), {"spec.kvQuota.hbm": "30%"})
    parse_manifest(new, old)


def test_apply_patch_sets_nested_and_removes() -> None:
    manifest = apply_patch({"a": {"b": 1}}, {"a.c.d": 2, "a.b": REMOVE})
    assert manifest == {"a": {"c": {"d": 2}}}


@pytest.mark.parametrize(
    ("manifest", "field"),
    [
        ({"apiVersion": "v1", "kind": "Tenant", "spec": {}}, "apiVersion"),
        ({"apiVersion": "kvfleet.io/v1alpha1", "kind": "Pod", "spec": {}}, "kind"),
    ],
)
def test_wrong_api_version_or_kind(manifest: dict[str, Any], field: str) -> None:
    with pytest.raises(ManifestError, match=field):
        parse_manifest(manifest)
