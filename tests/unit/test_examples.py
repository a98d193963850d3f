"""The ModelDeployment examples for the clusters people have (72B on H200s, 8B on MIG slices, 8B on one
L4/A10G): each passes the CRD's schema and CEL rules, renders through the real builders into engine pods
that ask the scheduler for what the example says, and the ``kvfleet plan`` numbers quoted in its comments
are what the planner prints today for exactly the spec's settings, and what the operator admits against.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import ValidationError as SchemaError
from openapi_schema_validator import OAS30Validator
from test_crds_cel import admit

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import compute_pool_capacity
from kvfleet_runtime.cli import main
from kvfleet_runtime.config import KeyFile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "modeldeployment-qwen72b.yaml": "nvidia.com/gpu",
    "modeldeployment-llama8b-mig.yaml": "nvidia.com/mig-3g.40gb",
    "modeldeployment-llama8b-l4.yaml": "nvidia.com/gpu",
}
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
COMMAND = re.compile(r"^# \$ kvfleet plan (?P<args>.+)$", re.MULTILINE)
NUMBERS = re.compile(
    r"^# kvfleet plan: (?P<blocks>[\d,]+) blocks, (?P<tokens>[\d,]+) tokens per replica; "
    r"(?P<pool>[\d,]+) tokens in the pool$",
    re.MULTILINE,
)


def _load(name: str) -> tuple[str, dict[str, Any]]:
    text = (ROOT / "examples" / name).read_text()
    doc: dict[str, Any] = yaml.safe_load(text)
    return text, doc


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _plan_flags(md: ModelDeployment) -> dict[str, str]:
    """The planner flags that say what the spec says (the command in the comment must use exactly these)."""
    spec = md.spec
    assert spec.model.architecture.preset is not None
    assert spec.pool.gpu_memory is not None
    return {
        "--preset": spec.model.architecture.preset.value,
        "--tensor-parallel": str(spec.engine.tensor_parallel_size),
        "--gpu-memory": spec.pool.gpu_memory,
        "--gpu-memory-utilization": f"{spec.engine.gpu_memory_utilization:g}",
        "--kv-dtype": spec.engine.kv_cache_dtype.value,
        "--block-size": str(spec.engine.block_size),
        "--replicas": str(spec.pool.replicas),
    }


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_passes_the_crd(name: str) -> None:
    _, doc = _load(name)
    crd = yaml.safe_load((ROOT / "crds" / "kvfleet.io_modeldeployments.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    errors: list[SchemaError] = list(OAS30Validator(schema).iter_errors(doc))
    assert not errors, errors[0].message
    assert admit("ModelDeployment", doc) == []


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_quoted_plan_is_the_planners_and_the_operators(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text, doc = _load(name)
    md = ModelDeployment.model_validate(doc)
    command, numbers = COMMAND.search(text), NUMBERS.search(text)
    assert command and numbers, f"{name}: no '# $ kvfleet plan ...' and '# kvfleet plan: ...' lines"
    argv = shlex.split(command["args"])
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert flags == _plan_flags(md), f"{name}: the quoted command does not plan this spec"
    assert main(["plan", *argv, "--output", "json"]) == 0
    capacity = json.loads(capsys.readouterr().out)["capacity"]
    quoted = {k: _int(numbers[k]) for k in ("blocks", "tokens", "pool")}
    assert quoted == {
        "blocks": capacity["blocks_per_replica"],
        "tokens": capacity["tokens_per_replica"],
        "pool": capacity["tokens_pool"],
    }
    operator = compute_pool_capacity(md)  # what tenants are admitted against
    assert (operator.hbm_blocks, operator.hbm_tokens) == (quoted["blocks"], quoted["tokens"])


@pytest.mark.parametrize(("name", "gpu_resource"), sorted(EXAMPLES.items()))
def test_the_example_renders_pods_that_ask_for_what_it_says(name: str, gpu_resource: str) -> None:
    _, doc = _load(name)
    md = ModelDeployment.model_validate({**doc, "metadata": {**doc["metadata"], "uid": "md-uid"}})
    capacity = compute_pool_capacity(md)
    children = build_desired_children(md, capacity, [], [], KEYS, IMAGES)
    (sts,) = [c for c in children if c["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    requests = engine["resources"]["requests"]
    gpus = str(md.spec.pool.gpus_per_replica)
    assert requests[gpu_resource] == engine["resources"]["limits"][gpu_resource] == gpus
    own = md.spec.pool.pod_template.resources.requests.get("memory", "32Gi")
    # The LMCache CPU tier is visible to the scheduler: in the memory request, on top of the engine's own.
    assert parse_quantity(requests["memory"]) == parse_quantity(own) + parse_quantity(
        md.spec.kv_cache.cpu_size
    )
    assert pod["nodeSelector"]["kvfleet.io/gpu-pool"] == "shared"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == md.spec.pool.gpu_type
    assert "--gpu" in engine["command"]  # the GPU build: block size 16 is fine
    template = md.spec.pool.pod_template
    if template.runtime_class_name:
        assert pod["runtimeClassName"] == template.runtime_class_name


#: Hugging Face repositories that answer 401 without an accepted licence and a token.
GATED = ("meta-llama/",)
SECRET_COMMAND = re.compile(
    r"^# \$ kubectl create secret generic (?P<name>\S+) -n (?P<ns>\S+) --from-literal=HF_TOKEN=", re.MULTILINE
)


def _gated(name: str) -> bool:
    return str(_load(name)[1]["spec"]["model"]["source"].get("huggingFace", "")).startswith(GATED)


def test_the_gated_examples_are_the_llama_ones() -> None:
    assert sorted(n for n in EXAMPLES if _gated(n)) == [
        "modeldeployment-llama8b-l4.yaml",
        "modeldeployment-llama8b-mig.yaml",
    ]


@pytest.mark.parametrize("name", sorted(n for n in EXAMPLES if _gated(n)))
def test_a_gated_model_names_a_token_secret_and_shows_how_to_create_it(name: str) -> None:
    """A user copying an example of a gated model gets the token Secret it names from the command in
    its comment (same name, same namespace); without it the download stops at the hub's 401."""
    text, doc = _load(name)
    source = doc["spec"]["model"]["source"]
    ref = source.get("credentialsSecretRef")
    assert ref, f"{name}: a gated model without credentialsSecretRef cannot be downloaded"
    command = SECRET_COMMAND.search(text)
    assert command, f"{name}: no `kubectl create secret generic ... HF_TOKEN=` command in the comment"
    assert (command["name"], command["ns"]) == (ref["name"], doc["metadata"]["namespace"])
