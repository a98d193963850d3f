"""The generated CRDs: structural, valid OpenAPI v3, and the examples validate against them (drift:
test_generated.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator
from openapi_schema_validator import OAS30Validator, oas30_format_checker
from openapi_spec_validator import validate as validate_openapi_spec

from kvfleet_operator.api.manifest import parse_manifest

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))

# Keywords a Kubernetes structural schema may not contain (apiextensions validation rejects them, or,
# for additionalProperties: false, forbids it alongside properties).
FORBIDDEN_KEYWORDS = {
    "$ref",
    "$defs",
    "definitions",
    "allOf",
    "oneOf",
    "not",
    "const",
    "title",
    "dependencies",
    "patternProperties",
    "propertyNames",
    "examples",
    "$schema",
    "id",
    "discriminator",
}


@functools.cache
def _crd_files() -> dict[str, dict[str, Any]]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(CRD_DIR.glob("*.yaml"))}


@functools.cache
def _schema_of(kind: str) -> dict[str, Any]:
    for crd in _crd_files().values():
        if crd["spec"]["names"]["kind"] == kind:
            schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"no CRD for {kind}")


def _walk(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}[*]")


def test_crd_metadata() -> None:
    crds = {crd["spec"]["names"]["kind"]: crd for crd in _crd_files().values()}
    assert set(crds) == {"ModelDeployment", "Tenant"}
    md, tn = crds["ModelDeployment"], crds["Tenant"]
    for crd in (md, tn):
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        assert crd["spec"]["group"] == "kvfleet.io"
        assert crd["spec"]["scope"] == "Namespaced"
        assert crd["spec"]["names"]["categories"] == ["kvfleet"]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"]["status"] == {}
    assert md["spec"]["names"]["shortNames"] == ["md"]
    assert tn["spec"]["names"]["shortNames"] == ["tn"]
    assert md["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.pool.replicas"
    # A dedicated pool's replicas, for KEDA's HPA (spec.dedicated.autoscaling).
    assert tn["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.dedicated.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {
        kind: [c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
        for kind, crd in crds.items()
    }
    assert columns["Tenant"] == ["MODEL", "TIER", "ISOLATION", "HBM QUOTA", "ADMITTED HBM", "READY", "AGE"]
    assert columns["ModelDeployment"] == [
        "MODEL",
        "REPLICAS",
        "FLOOR",
        "READY",
        "KV DTYPE",
        "KV CAPACITY",
        "AGE",
    ]


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_printer_columns_point_at_schema_fields(kind: str) -> None:
    schema = _schema_of(kind)
    crd = next(c for c in _crd_files().values() if c["spec"]["names"]["kind"] == kind)
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".metadata"):
            continue
        node: Mapping[str, Any] = schema
        for part in re.sub(r"\[\?.*\]", "", path).strip(".").split("."):
            node = node["properties"][part] if "properties" in node else node["items"]["properties"][part]


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_schema_is_structural(kind: str) -> None:
    schema = _schema_of(kind)
    assert schema["properties"]["metadata"] == {"type": "object"}
    for path, node in _walk(schema, kind):
        assert not FORBIDDEN_KEYWORDS & set(node), (
            f"{path}: forbidden keywords {FORBIDDEN_KEYWORDS & set(node)}"
        )
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node.get("anyOf") in (None, [{"type": "integer"}, {"type": "string"}]), path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
            assert "anyOf" not in node, f"{path}: anyOf outside int-or-string"
        assert node.get("additionalProperties") is not False, f"{path}: additionalProperties: false"
        assert not ("properties" in node and "additionalProperties" in node), path
        top_level = path in {f"{kind}.apiVersion", f"{kind}.kind"}  # never reached by CEL rules
        if node.get("type") == "string" and "enum" not in node and not top_level:
            assert "maxLength" in node, f"{path}: unbounded string (CEL cost)"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list (CEL cost)"
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path}: unbounded map (CEL cost)"
        for name in node.get("required", []):
            assert name in node.get("properties", {}), f"{path}: required {name} is not a property"


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_every_field_has_a_description(kind: str) -> None:
    for path, node in _walk(_schema_of(kind), kind):
        if path.endswith(("[]", "[*]")) or path.endswith(".metadata"):
            continue
        assert len(node.get("description", "")) >= 8, f"{path}: no useful description"


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_defaults_validate_against_their_own_schema(kind: str) -> None:
    for path, node in _walk(_schema_of(kind), kind):
        if "default" in node:
            errors = list(
                OAS30Validator(node, format_checker=oas30_format_checker).iter_errors(node["default"])
            )
            assert not errors, f"{path}: default {node['default']!r} is invalid: {errors[0].message}"


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_cel_rules_are_well_formed_and_reference_real_fields(kind: str) -> None:
    count = 0
    for path, node in _walk(_schema_of(kind), kind):
        for rule in node.get("x-kubernetes-validations", []):
            count += 1
            assert set(rule) <= {"rule", "message", "fieldPath", "reason", "messageExpression"}, path
            assert rule["rule"].strip() and len(rule["message"]) >= 10, path
            assert rule["rule"].count("(") == rule["rule"].count(")"), f"{path}: {rule['rule']}"
            # Every self.<a>.<b> chain must walk existing properties (catches typos in rules).
            for chain in re.findall(r"\bself((?:\.[A-Za-z_]\w*)+)", rule["rule"]):
                target: Mapping[str, Any] = node
                for part in chain.strip(".").split("."):
                    if part in {"replace", "startsWith", "all", "size", "matches"}:
                        break
                    assert part in target.get("properties", {}), f"{path}: rule names unknown field {part}"
                    target = target["properties"][part]
            if "fieldPath" in rule:
                target = node
                for part in rule["fieldPath"].strip(".").split("."):
                    assert part in target.get("properties", {}), f"{path}: bad fieldPath {rule['fieldPath']}"
                    target = target["properties"][part]
    assert count >= 5


def test_schemas_are_valid_openapi_v3() -> None:
    document = {
        "openapi": "3.0.3",
        "info": {"title": "kvfleet CRDs", "version": "v1alpha1"},
        "paths": {},
        "components": {"schemas": {kind: _schema_of(kind) for kind in ("ModelDeployment", "Tenant")}},
    }
    validate_openapi_spec(document)
    for kind in ("ModelDeployment", "Tenant"):
        OAS30Validator.check_schema(_schema_of(kind))
        Draft4Validator.check_schema(_schema_of(kind))


def test_validator_rejects_a_broken_schema() -> None:
    """The OpenAPI check can fail: a schema with a wrong type keyword is caught."""
    document = {
        "openapi": "3.0.3",
        "info": {"title": "broken", "version": "0"},
        "paths": {},
        "components": {"schemas": {"X": {"type": "object", "properties": {"a": {"type": "strin"}}}}},
    }
    with pytest.raises(Exception, match="strin"):
        validate_openapi_spec(document)


def test_examples_exist() -> None:
    names = {path.relative_to(ROOT / "examples").as_posix() for path in EXAMPLES}
    assert {
        "modeldeployment-qwen72b.yaml",
        "tenant-bank.yaml",
        "tenant-saas.yaml",
        "tenant-startup-a.yaml",
        "tenant-startup-b.yaml",
        "local/modeldeployment-tiny.yaml",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_example_validates_against_crd_schema_and_models(path: Path) -> None:
    for manifest in yaml.safe_load_all(path.read_text()):
        schema = _schema_of(manifest["kind"])
        errors = list(OAS30Validator(schema, format_checker=oas30_format_checker).iter_errors(manifest))
        assert not errors, f"{path.name}: {errors[0].json_path}: {errors[0].message}"
        parse_manifest(manifest)
