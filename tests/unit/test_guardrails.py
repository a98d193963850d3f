"""The platform's guardrails on a ModelDeployment (``build/guardrails.py``): each rule refuses the field it
guards and names it, lets through what it allows, and the operator's own vLLM flags stay in step with the
launcher's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import (
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    env_from_prefix_ok,
)
from kvfleet_operator.build.guardrails import (
    HTTP_ROUTE,
    INGRESS,
    OPERATOR_ENGINE_FLAGS,
    TUNING_ENGINE_FLAGS,
    Guardrails,
    check_engine_args,
    check_host_path,
    check_model_deployment,
    describe_refusals,
    engine_flag_name,
    parse_guardrails,
)
from kvfleet_operator.build.model_deployment import OperatorImages
from kvfleet_operator.build.tenant_table import build_engine_settings
from kvfleet_runtime.config import EngineSettings
from kvfleet_runtime.engine.launcher import EngineReplica, ReplicaSite, build_vllm_args

IMAGES = OperatorImages(engine="ghcr.io/kvfleet/engine:1", gateway="ghcr.io/kvfleet/gateway:1")
BASE: dict[str, Any] = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m", "namespace": "team-a"},
    "spec": {
        "model": {
            "servedName": "m",
            "source": {"huggingFace": "org/m"},
            "architecture": {"preset": "tiny-llama"},
        },
        "pool": {"gpusPerReplica": 0, "cpuKvCacheSpace": "1Gi"},
    },
}


def _md(**paths: Any) -> ModelDeployment:
    doc = copy.deepcopy(BASE)
    for path, value in paths.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return ModelDeployment.model_validate(doc)


def _fields(md: ModelDeployment, guardrails: Guardrails | None = None, **kw: Any) -> list[str]:
    return [r.field for r in check_model_deployment(md, guardrails or Guardrails(), IMAGES, **kw)]


def test_a_plain_model_deployment_passes_the_defaults() -> None:
    assert _fields(_md()) == []


@pytest.mark.parametrize(
    ("paths", "field"),
    [
        pytest.param(
            {"engine__image": "evil.example.com/x:1"}, "spec.engine.image", id="foreign-engine-image"
        ),
        pytest.param(
            {"gateway__image": "evil.example.com/x:1"}, "spec.gateway.image", id="foreign-gateway-image"
        ),
        pytest.param(
            {"kvCache__nvme": {"size": "1Gi", "hostPath": "/"}}, "spec.kvCache.nvme.hostPath", id="host-path"
        ),
        pytest.param(
            {"engine__extraArgs": ["--kv-transfer-config", "{}"]}, "spec.engine.extraArgs", id="operator-flag"
        ),
        pytest.param(
            {"engine__extraArgs": ["--enable-log-requests"]}, "spec.engine.extraArgs", id="log-prompts"
        ),
        pytest.param({"engine__extraArgs": ["--middleware=x.y"]}, "spec.engine.extraArgs", id="loads-code"),
        pytest.param(
            {"pool__podTemplate": {"priorityClassName": "system-node-critical"}},
            "spec.pool.podTemplate.priorityClassName",
            id="system-priority",
        ),
        pytest.param(
            {"gateway__exposure": {"service": {"type": "LoadBalancer"}}},
            "spec.gateway.exposure.service.type",
            id="load-balancer",
        ),
        pytest.param(
            {"gateway__exposure": {"service": {"annotations": {"a/b": "c"}}}},
            "spec.gateway.exposure.service.annotations",
            id="service-annotation",
        ),
        pytest.param(
            {"gateway__exposure": {"ingress": {"host": "x.example.com"}}},
            "spec.gateway.exposure.ingress.host",
            id="any-host",
        ),
        pytest.param(
            {
                "gateway__exposure": {
                    "ingress": {
                        "host": "x.example.com",
                        "annotations": {"nginx.ingress.kubernetes.io/configuration-snippet": "x"},
                    }
                }
            },
            "spec.gateway.exposure.ingress.annotations",
            id="snippet",
        ),
        pytest.param(
            {"gateway__exposure": {"ingress": {"host": "x.example.com", "className": "public"}}},
            "spec.gateway.exposure.ingress.className",
            id="ingress-class",
        ),
        pytest.param(
            {
                "gateway__exposure": {
                    "httpRoute": {"parentRefs": [{"name": "gw", "namespace": "infra"}], "hostnames": ["x.io"]}
                }
            },
            "spec.gateway.exposure.httpRoute.parentRefs",
            id="foreign-gateway",
        ),
    ],
)
def test_the_defaults_refuse_each_field_naming_it(paths: dict[str, Any], field: str) -> None:
    assert field in _fields(_md(**paths))


def test_what_the_platform_allows_passes() -> None:
    allowed = Guardrails(
        images=("registry.example.com/llm/",),
        host_path_roots=("/mnt/nvme",),
        engine_args=("--trust-remote-code",),
        priority_class_names=("inference-high",),
        service_types=("ClusterIP", "LoadBalancer"),  # type: ignore[arg-type]
        service_annotations=("service.beta.kubernetes.io/*-internal",),
        ingress_classes=("nginx",),
        hosts=("*.{namespace}.llm.example.com",),
        parent_gateways=("infra/public",),
    )
    md = _md(
        engine__image="registry.example.com/llm/engine:2",
        engine__extraArgs=["--trust_remote_code", "--max-num-seqs=8", "--enforce-eager"],
        kvCache__nvme={"size": "1Gi", "hostPath": "/mnt/nvme/fast"},
        pool__podTemplate={"priorityClassName": "inference-high"},
        gateway__exposure={
            "service": {
                "type": "LoadBalancer",
                "annotations": {"service.beta.kubernetes.io/azure-load-balancer-internal": "true"},
            },
            "ingress": {"host": "chat.team-a.llm.example.com", "className": "nginx"},
        },
    )
    assert _fields(md, allowed) == []
    route = _md(
        gateway__exposure={
            "httpRoute": {
                "parentRefs": [{"name": "public", "namespace": "infra"}],
                "hostnames": ["chat.team-a.llm.example.com"],
            }
        }
    )
    assert _fields(route, allowed) == []
    # {namespace} is the ModelDeployment's own: another team's name is refused.
    other = _md(gateway__exposure={"ingress": {"host": "chat.team-b.llm.example.com"}})
    assert _fields(other, allowed) == ["spec.gateway.exposure.ingress.host"]


def test_an_exposure_kind_the_operator_may_not_create_is_not_checked() -> None:
    """rbac.ingress off: the Ingress is never written (ExposureUnavailable says so), nothing to refuse."""
    md = _md(gateway__exposure={"ingress": {"host": "x.example.com"}})
    assert _fields(md, managed=()) == []
    assert _fields(md, managed=(INGRESS, HTTP_ROUTE)) == ["spec.gateway.exposure.ingress.host"]


def test_the_default_gateway_is_any_in_the_own_namespace() -> None:
    route = {"parentRefs": [{"name": "mine"}, {"name": "also", "namespace": "team-a"}], "hostnames": ["x.io"]}
    assert _fields(_md(gateway__exposure={"httpRoute": route}), Guardrails(hosts=("x.io",))) == []


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/", "not one of"),
        ("/mnt", "not one of"),
        ("/mnt/nvme-other", "not one of"),
        ("/mnt/nvme/../etc", "normalized"),
        ("/mnt//nvme", "normalized"),
        ("/etc", "not one of"),
    ],
)
def test_host_paths_outside_the_roots_are_refused(path: str, why: str) -> None:
    message = check_host_path(path, Guardrails(host_path_roots=("/mnt/nvme",)))
    assert message is not None and why in message


def test_host_paths_are_refused_without_roots_and_allowed_under_them() -> None:
    assert "hostPathRoots is empty" in (check_host_path("/mnt/nvme", Guardrails()) or "")
    roots = Guardrails(host_path_roots=("/mnt/nvme/",))
    assert check_host_path("/mnt/nvme", roots) is None
    assert check_host_path("/mnt/nvme/a/b", roots) is None


@pytest.mark.parametrize("root", ["/", "mnt/nvme", "/mnt/../etc", "/mnt//nvme"])
def test_a_root_that_is_no_clean_absolute_folder_is_a_configuration_error(root: str) -> None:
    with pytest.raises(ValidationError, match="hostPathRoots"):
        Guardrails(host_path_roots=(root,))


def test_flag_names_are_read_as_vllms_parser_reads_them() -> None:
    assert engine_flag_name("--max_num_seqs=8") == "--max-num-seqs"
    assert engine_flag_name("--compilation-config.level=3") == "--compilation-config.level"
    assert engine_flag_name("8") is None
    # abbreviations, dotted sub-options and values that look like flags are not on the list
    assert check_engine_args(["--kv-transfer", "x", "--max-num-seqs", "--host=0"], Guardrails()) == [
        "--kv-transfer",
        "--host",
    ]


def test_the_platform_cannot_allow_an_operator_flag() -> None:
    assert check_engine_args(["--port=1"], Guardrails(engine_args=("--port",))) == ["--port"]
    assert not TUNING_ENGINE_FLAGS & OPERATOR_ENGINE_FLAGS


def test_the_operators_flags_are_every_flag_the_launcher_renders() -> None:
    """OPERATOR_ENGINE_FLAGS is written out (the operator may not import the launcher); every flag the
    launcher renders for the richest settings must be on it, or an extraArgs copy would override it. The
    test sees both sides: the import-linter contracts bind the packages, not the tests."""

    md = _md(
        engine__tensorParallelSize=2,
        engine__pipelineParallelSize=2,
        engine__dataParallelSize=2,
        engine__expertParallelSize=2,
        engine__maxModelLen=4096,
        engine__maxNumBatchedTokens=8192,
        kvCache__cpuSize="1Gi",
        pool__gpusPerReplica=8,
        pool__cpuKvCacheSpace=None,
    )
    settings: EngineSettings = build_engine_settings(md).model_copy(
        update={"revision": "main", "num_gpu_blocks_override": 10}
    )
    site = ReplicaSite(host="0.0.0.0", cpu_kv_cache_gib=None, allowed_media_domains=("media.example.com",))
    args = build_vllm_args(EngineReplica(settings, served_model_name="m", block_size=16, site=site))
    rendered = {engine_flag_name(a) for a in args} - {None}
    assert rendered <= OPERATOR_ENGINE_FLAGS, rendered - OPERATOR_ENGINE_FLAGS


def test_the_message_names_every_field_and_says_nothing_is_written() -> None:
    refusals = check_model_deployment(
        _md(engine__image="evil.example.com/x", kvCache__nvme={"size": "1Gi", "hostPath": "/"}),
        Guardrails(),
        IMAGES,
    )
    message = describe_refusals(refusals)
    assert "spec.engine.image" in message and "spec.kvCache.nvme.hostPath" in message
    assert "nothing is written" in message and "keep running" in message


def test_guardrails_parse_from_the_charts_json_and_refuse_typos() -> None:
    assert parse_guardrails(None) == Guardrails() == parse_guardrails(" ")
    parsed = parse_guardrails('{"images": ["r.example.com/"], "hostPathRoots": ["/mnt/nvme"]}')
    assert parsed.images == ("r.example.com/",) and parsed.host_path_roots == ("/mnt/nvme",)
    with pytest.raises(ValidationError):
        parse_guardrails('{"image": ["r.example.com/"]}')


@pytest.mark.parametrize(
    ("prefix", "ok"),
    [
        (None, False),
        ("", False),
        ("APP_", True),
        ("L", False),  # L + D_PRELOAD
        ("LMCACHE_", False),
        ("LMCACHE_X_", False),
        ("VLLM_", False),  # VLLM_ + SERVER_DEV_MODE
        ("PY", False),
        ("TUNING_", True),
    ],
)
def test_an_env_from_prefix_keeps_every_key_off_the_reserved_names(prefix: str | None, ok: bool) -> None:
    assert env_from_prefix_ok(prefix) is ok
    if ok:
        assert prefix is not None
        assert not any(r.startswith(prefix) for r in (*RESERVED_ENV_NAMES, *RESERVED_ENV_PREFIXES))
