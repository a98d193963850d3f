"""The CRDs' CEL rules, evaluated by a real CEL implementation (cel-python) on real manifests.

What the API server does on admission is reproduced in miniature: structural defaulting from the
schema's ``default`` values, then every ``x-kubernetes-validations`` rule evaluated with ``self`` bound
to the node (and ``oldSelf`` for transition rules on updates). Kubernetes' CEL environment adds the
strings extension library on top of standard CEL; of it the rules use only ``replace``, which is supplied
here with the library's semantics. The real kube-apiserver replays the same table in tests/cluster.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from invalid_manifests import (
    INVALID_MANIFESTS,
    InvalidManifestCase,
    RuleKind,
    build_base_manifest,
    build_invalid_manifest,
    build_old_manifest,
)
from kvfleet_operator.api.manifest import parse_manifest

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = {"ModelDeployment": "kvfleet.io_modeldeployments.yaml", "Tenant": "kvfleet.io_tenants.yaml"}
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
_ENV = celpy.Environment()


def _replace(
    text: celtypes.StringType, old: celtypes.StringType, new: celtypes.StringType
) -> celtypes.StringType:
    """Kubernetes' strings library ``<string>.replace(old, new)`` (all occurrences)."""
    return celtypes.StringType(str(text).replace(str(old), str(new)))


@functools.cache
def _schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / CRD_FILES[kind]).read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: missing properties get their default, then
    defaulted objects are defaulted in turn."""
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def evaluate_rules(schema: Mapping[str, Any], value: Any, old: Any, path: str) -> list[tuple[str, str]]:
    """Every failing rule as (field path it reports, message). Transition rules run only with ``old``."""
    failures: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations", []):
        is_transition = "oldSelf" in rule["rule"]
        if is_transition and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if is_transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        program = _ENV.program(_ENV.compile(rule["rule"]), functions={"replace": _replace})
        result = program.evaluate(activation)
        if not (isinstance(result, celtypes.BoolType) and bool(result)):
            failures.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                failures += evaluate_rules(sub, value[name], old_sub, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            failures += evaluate_rules(schema["items"], item, None, f"{path}[{index}]")
    return failures


def admit(kind: str, manifest: dict[str, Any], old: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    schema = _schema(kind)
    new = apply_defaults(schema, copy.deepcopy(manifest))
    previous = apply_defaults(schema, copy.deepcopy(old)) if old is not None else None
    return evaluate_rules(schema, new, previous, "")


CEL_CASES = [case for case in INVALID_MANIFESTS if case.rule is RuleKind.CEL]


@pytest.mark.parametrize("case", CEL_CASES, ids=lambda case: case.id)
def test_cel_rule_rejects_and_names_the_field(case: InvalidManifestCase) -> None:
    old = build_old_manifest(case)
    if old is not None:
        assert admit(case.kind, old) == []
    failures = admit(case.kind, build_invalid_manifest(case), old)
    assert failures, f"{case.id}: no CEL rule rejected it"
    assert any(case.field == path or case.field in message for path, message in failures), (
        f"{case.id}: failures {failures} do not name {case.field}"
    )


@pytest.mark.parametrize("kind", ["ModelDeployment", "Tenant"])
def test_base_manifest_passes_every_rule(kind: str) -> None:
    assert admit(kind, build_base_manifest(kind)) == []
    base = build_base_manifest(kind)
    assert admit(kind, base, old=base) == []  # an unchanged update passes the transition rules


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_examples_pass_every_rule(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    assert admit(manifest["kind"], manifest) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_schema_defaults_equal_model_defaults(path: Path) -> None:
    """The API server's defaulting (from the CRD) and pydantic's defaults give the same object."""
    manifest = yaml.safe_load(path.read_text())
    defaulted = apply_defaults(_schema(manifest["kind"]), copy.deepcopy(manifest))
    model = parse_manifest(manifest)
    assert model.model_dump(by_alias=True, exclude_none=True, mode="json")["spec"] == defaulted["spec"]


def test_isolation_rule_compares_old_and_new() -> None:
    """The transition rule fires on a change and only on a change."""
    old = build_base_manifest("Tenant")
    new = build_base_manifest("Tenant")
    new["spec"]["isolation"] = "shared"
    assert "spec.isolation" in {path for path, _ in admit("Tenant", new, old)}
    assert admit("Tenant", new) == []
