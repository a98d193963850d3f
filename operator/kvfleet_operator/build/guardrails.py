"""What the platform lets a ModelDeployment ask the operator for, and the one check against it. Pure.

The operator applies a ModelDeployment's children with its own rights, so each field that becomes part of
a pod, a Service, an Ingress or an HTTPRoute is something a team could get through the operator that it
could not create itself. Whatever no platform would allow (reserved and loader environment names, envFrom
without a safe prefix) the CRD refuses (``api/modeldeployment.py``). Whatever depends on the platform is
decided here, against :class:`Guardrails` (the chart's ``guardrails`` value, ``KVFLEET_GUARDRAILS``):
images, host paths, vLLM flags beyond the built-in tuning ones, priority classes, the gateway's Service
type and annotations, ingress classes and annotations, hosts and parent Gateways.

:func:`check_model_deployment` returns one :class:`Refusal` per field that breaks a rule, naming it. The
reconcile turns them into ``Ready=False`` with reason ``GuardrailRefused`` and then writes nothing for
that ModelDeployment: it neither creates nor rewrites nor deletes its children, so the running pods of a
ModelDeployment that an upgrade now refuses keep serving until its spec is fixed.

The chart's ValidatingAdmissionPolicy (``templates/model-deployment-rights.yaml``) adds the other half:
who asks. Creating or changing a ModelDeployment's spec needs the requesting user's own right to create
pods in the namespace (and Services, Ingresses or HTTPRoutes for the exposure that makes them).
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Annotated, Final

from pydantic import Field, field_validator

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.common import CrdModel
from kvfleet_operator.api.modeldeployment import ServiceType
from kvfleet_operator.build.model_deployment import OperatorImages

#: The environment variable the chart passes :class:`Guardrails` in, as JSON.
GUARDRAILS_ENV: Final = "KVFLEET_GUARDRAILS"

#: vLLM flags the operator's launcher sets itself (``kvfleet_runtime.engine.launcher.build_vllm_args``;
#: a unit test keeps the two in step). vLLM keeps the last of a repeated flag and ``extraArgs`` come last,
#: so any of these would override the operator's: ``--kv-transfer-config`` sends every tenant's KV to
#: another LMCache, ``--host``/``--port`` move the server off the port the NetworkPolicy guards, ``--model``
#: serves other weights, ``--allowed-media-domains`` lets vLLM fetch media from anywhere,
#: ``--kv-events-config`` would publish every tenant's token ids elsewhere. Never allowed, whatever the
#: platform lists.
OPERATOR_ENGINE_FLAGS: Final = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--revision",
        "--load-format",
        "--served-model-name",
        "--block-size",
        "--kv-cache-dtype",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--scheduling-policy",
        "--enable-prompt-tokens-details",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--enable-expert-parallel",
        "--num-gpu-blocks-override",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--kv-transfer-config",
        "--kv-events-config",
        "--allowed-media-domains",
    }
)

#: vLLM flags any ModelDeployment may pass in ``spec.engine.extraArgs``: they tune scheduling, memory and
#: output parsing inside the limits the operator set, and none loads code, reads or writes files, opens a
#: connection, logs request content or changes what the server exposes. An allowlist, not a denylist:
#: vLLM has hundreds of flags and adds more each release (``--middleware``, ``--tool-parser-plugin``,
#: ``--worker-extension-cls`` import code; ``--otlp-traces-endpoint``, ``--kv-events-config`` send data
#: out; ``--enable-log-requests`` logs prompts; ``--config`` reads more flags from a file), and a new
#: dangerous one must not pass by default. The platform adds more with ``guardrails.engineArgs``.
TUNING_ENGINE_FLAGS: Final = frozenset(
    {
        "--max-num-seqs",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--long-prefill-token-threshold",
        "--enforce-eager",
        "--max-seq-len-to-capture",
        "--cuda-graph-sizes",
        "--disable-custom-all-reduce",
        "--swap-space",
        "--cpu-offload-gb",
        "--dtype",
        "--quantization",
        "--seed",
        "--max-logprobs",
        "--disable-cascade-attn",
        "--async-scheduling",
        "--disable-sliding-window",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--reasoning-parser",
        "--limit-mm-per-prompt",
        "--max-parallel-loading-workers",
        "--tokenizer-mode",
    }
)

#: Ingress annotations allowed unless the platform sets ``guardrails.ingressAnnotations``: ingress-nginx's
#: buffering, timeout and body-size switches a streaming API needs. Not ``auth-url``, ``*-snippet``,
#: ``rewrite-target`` or ``whitelist-source-range``, which change who the controller lets through and how.
DEFAULT_INGRESS_ANNOTATIONS: Final = (
    "nginx.ingress.kubernetes.io/proxy-buffering",
    "nginx.ingress.kubernetes.io/proxy-read-timeout",
    "nginx.ingress.kubernetes.io/proxy-send-timeout",
    "nginx.ingress.kubernetes.io/proxy-body-size",
)
#: The placeholder in ``hosts`` and ``parentGateways`` patterns that stands for the ModelDeployment's
#: namespace, so one pattern gives each team its own names (``*.{namespace}.llm.example.com``).
NAMESPACE_PLACEHOLDER: Final = "{namespace}"

#: The exposure kinds, by name (``k8s.kinds.INGRESS.kind``, ``k8s.kinds.HTTP_ROUTE.kind``).
INGRESS: Final = "Ingress"
HTTP_ROUTE: Final = "HTTPRoute"

Pattern = Annotated[str, Field(min_length=1, max_length=253)]


class Guardrails(CrdModel):
    """The platform's allowlists (chart value ``guardrails``). Empty lists allow nothing of that kind,
    except where a field says otherwise; the defaults allow only what cannot reach beyond the namespace."""

    images: tuple[Pattern, ...] = Field(
        default=(),
        description="Image prefixes spec.engine.image and spec.gateway.image may start with, e.g. "
        "registry.example.com/llm/ (end a registry or folder with /). The operator's own images are always "
        "allowed.",
    )
    host_path_roots: tuple[Pattern, ...] = Field(
        default=(),
        description="Node folders spec.kvCache.nvme.hostPath may name or lie under, e.g. /mnt/nvme; empty: "
        "no host path. Each pool mounts only <hostPath>/<namespace>/<modelDeployment>/<pool>.",
    )
    engine_args: tuple[Pattern, ...] = Field(
        default=(),
        description="vLLM flags spec.engine.extraArgs may use besides the built-in tuning flags, e.g. "
        "--trust-remote-code. The flags the operator sets are refused whatever is listed.",
    )
    priority_class_names: tuple[Pattern, ...] = Field(
        default=(),
        description="PriorityClasses spec.pool.podTemplate.priorityClassName may name; empty: any but "
        "Kubernetes' own system-* classes.",
    )
    service_types: tuple[ServiceType, ...] = Field(
        default=(ServiceType.CLUSTER_IP,),
        description="Types spec.gateway.exposure.service.type may take.",
    )
    service_annotations: tuple[Pattern, ...] = Field(
        default=(),
        description="Annotation keys (shell patterns) spec.gateway.exposure.service.annotations may set.",
    )
    ingress_classes: tuple[Pattern, ...] = Field(
        default=(),
        description="IngressClasses spec.gateway.exposure.ingress.className may name; unset className (the "
        "cluster's default class) is always allowed.",
    )
    ingress_annotations: tuple[Pattern, ...] = Field(
        default=DEFAULT_INGRESS_ANNOTATIONS,
        description="Annotation keys (shell patterns) spec.gateway.exposure.ingress.annotations may set.",
    )
    hosts: tuple[Pattern, ...] = Field(
        default=(),
        description="Hosts (shell patterns; {namespace} stands for the ModelDeployment's) an Ingress host or "
        "HTTPRoute hostname may be, e.g. *.{namespace}.llm.example.com; empty: none.",
    )
    parent_gateways: tuple[Pattern, ...] = Field(
        default=(f"{NAMESPACE_PLACEHOLDER}/*",),
        description="Gateways an HTTPRoute may attach to, as namespace/name shell patterns ({namespace}: "
        "the ModelDeployment's); the default: any Gateway in its own namespace.",
    )
    inference_gateway_namespaces: tuple[Pattern, ...] = Field(
        default=(NAMESPACE_PLACEHOLDER,),
        description="Namespaces (shell patterns; {namespace}: the ModelDeployment's) whose pods "
        "spec.gateway.inferencePool.gatewayPods may name: the NetworkPolicies admit those pods to the "
        "Endpoint Picker and to the engines' OpenAI port. The default: the ModelDeployment's own namespace "
        "only; list the namespace the platform's GIE gateway runs in, e.g. gateways.",
    )

    @field_validator("host_path_roots")
    @classmethod
    def _roots_absolute(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        for root in roots:
            if not root.startswith("/") or posixpath.normpath(root) != root.rstrip("/") or root == "/":
                raise ValueError(
                    f"guardrails.hostPathRoots: {root!r} must be an absolute, normalized folder other than "
                    "/, e.g. /mnt/nvme"
                )
        return tuple(r.rstrip("/") for r in roots)


def parse_guardrails(text: str | None) -> Guardrails:
    """:class:`Guardrails` from their JSON (``KVFLEET_GUARDRAILS``); empty or ``None``: the defaults.

    Raises ``pydantic.ValidationError`` for a typo or a bad value: never a guardrail nobody asked for."""
    if not text or not text.strip():
        return Guardrails()
    return Guardrails.model_validate_json(text)


@dataclass(frozen=True)
class Refusal:
    """One field of a ModelDeployment the platform does not allow, and why."""

    field: str
    message: str

    def describe(self) -> str:
        return f"{self.field}: {self.message}"


def describe_refusals(refusals: Iterable[Refusal]) -> str:
    """One message for the condition: every refused field, what is wrong, how to fix it."""
    return (
        "refused by the platform's guardrails (the chart's guardrails value); nothing is written for this "
        "ModelDeployment until the spec is fixed, and pods it already runs keep running. "
        + "; ".join(r.describe() for r in refusals)
    )


def _matches(value: str, patterns: Iterable[str], namespace: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p.replace(NAMESPACE_PLACEHOLDER, namespace)) for p in patterns)


def _listing(patterns: Iterable[str]) -> str:
    listed = ", ".join(patterns)
    return listed or "nothing"


def engine_flag_name(arg: str) -> str | None:
    """The flag ``arg`` sets as vLLM's parser reads it (``--max_num_seqs=8`` -> ``--max-num-seqs``), or
    ``None`` for a value."""
    if not arg.startswith("--"):
        return None
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


def check_engine_args(args: Iterable[str], guardrails: Guardrails) -> list[str]:
    """The flags of ``args`` that are not allowed, in order, each once."""
    allowed = (
        TUNING_ENGINE_FLAGS | {engine_flag_name(a) for a in guardrails.engine_args}
    ) - OPERATOR_ENGINE_FLAGS
    refused: list[str] = []
    for arg in args:
        name = engine_flag_name(arg)
        if name is not None and name not in allowed and name not in refused:
            refused.append(name)
    return refused


def check_host_path(path: str, guardrails: Guardrails) -> str | None:
    """Why ``path`` may not be an NVMe host path (``None``: it may)."""
    roots = guardrails.host_path_roots
    if not roots:
        return (
            "host paths are not allowed on this platform (the chart's guardrails.hostPathRoots is empty): "
            "use storageClassName"
        )
    norm = posixpath.normpath(path)
    if (path.rstrip("/") or "/") != norm or ".." in path.split("/"):
        return f"{path!r} must be a normalized absolute path (no .., no //)"
    if not any(norm == root or norm.startswith(root + "/") for root in roots):
        return f"{path!r} is not one of, or under, the allowed roots ({_listing(roots)})"
    return None


def _check_image(
    field: str, image: str | None, guardrails: Guardrails, images: OperatorImages
) -> list[Refusal]:
    if image is None or image in (images.engine, images.gateway) or image.startswith(guardrails.images):
        return []
    return [
        Refusal(
            field,
            f"image {image!r} is not the operator's and starts with none of the allowed prefixes "
            f"({_listing(guardrails.images)}); remove it to use the operator's image, or ask the platform "
            "team to add its registry to guardrails.images",
        )
    ]


def _check_annotations(
    field: str, keys: Iterable[str], allowed: Iterable[str], namespace: str
) -> list[Refusal]:
    refused = [k for k in keys if not _matches(k, allowed, namespace)]
    if not refused:
        return []
    return [
        Refusal(
            field,
            f"annotations {', '.join(sorted(refused))} are not allowed (allowed: {_listing(allowed)}); the "
            "controllers that read them act for the whole cluster",
        )
    ]


def _check_exposure(
    md: ModelDeployment, guardrails: Guardrails, namespace: str, managed: Collection[str]
) -> list[Refusal]:
    exposure = md.spec.gateway.exposure
    prefix = "spec.gateway.exposure"
    refusals: list[Refusal] = []
    if exposure.service.type not in guardrails.service_types:
        allowed = ", ".join(t.value for t in guardrails.service_types)
        refusals.append(
            Refusal(
                f"{prefix}.service.type",
                f"{exposure.service.type.value} is not allowed (allowed: {allowed or 'nothing'}); a "
                "LoadBalancer or NodePort opens the gateway outside the cluster: ask the platform team "
                "(guardrails.serviceTypes) or use an allowed Ingress or HTTPRoute",
            )
        )
    refusals += _check_annotations(
        f"{prefix}.service.annotations",
        exposure.service.annotations,
        guardrails.service_annotations,
        namespace,
    )
    hosts: list[tuple[str, list[str]]] = []
    if (ingress := exposure.ingress) is not None and INGRESS in managed:
        if ingress.class_name is not None and ingress.class_name not in guardrails.ingress_classes:
            refusals.append(
                Refusal(
                    f"{prefix}.ingress.className",
                    f"IngressClass {ingress.class_name!r} is not allowed (allowed: "
                    f"{_listing(guardrails.ingress_classes)}); leave it unset for the cluster's default "
                    "class",
                )
            )
        refusals += _check_annotations(
            f"{prefix}.ingress.annotations", ingress.annotations, guardrails.ingress_annotations, namespace
        )
        hosts.append((f"{prefix}.ingress.host", [ingress.host]))
    if (route := exposure.http_route) is not None and HTTP_ROUTE in managed:
        hosts.append((f"{prefix}.httpRoute.hostnames", list(route.hostnames)))
        foreign = [
            f"{ref.namespace or namespace}/{ref.name}"
            for ref in route.parent_refs
            if not _matches(f"{ref.namespace or namespace}/{ref.name}", guardrails.parent_gateways, namespace)
        ]
        if foreign:
            refusals.append(
                Refusal(
                    f"{prefix}.httpRoute.parentRefs",
                    f"Gateways {', '.join(foreign)} are not allowed (allowed: "
                    f"{_listing(guardrails.parent_gateways)}, {{namespace}} being {namespace})",
                )
            )
    for field, names in hosts:
        claimed = [h for h in names if not _matches(h, guardrails.hosts, namespace)]
        if claimed:
            refusals.append(
                Refusal(
                    field,
                    f"hosts {', '.join(claimed)} are not allowed here (allowed: "
                    f"{_listing(guardrails.hosts)}, {{namespace}} being {namespace}); a host belongs to the "
                    "team the platform gave it to",
                )
            )
    return refusals


def _check_inference_pool(md: ModelDeployment, guardrails: Guardrails, namespace: str) -> list[Refusal]:
    """The platform gateway's pods are admitted to the engines' OpenAI port (where no key, salt or limit
    applies) and to the Endpoint Picker: only in a namespace the platform allows. Checked whether or not
    the operator may create InferencePools: it writes the NetworkPolicies either way."""
    pool = md.spec.gateway.inference_pool
    if pool is None:
        return []
    target = pool.gateway_pods.namespace or namespace
    if _matches(target, guardrails.inference_gateway_namespaces, namespace):
        return []
    return [
        Refusal(
            "spec.gateway.inferencePool.gatewayPods.namespace",
            f"namespace {target} is not allowed (allowed: "
            f"{_listing(guardrails.inference_gateway_namespaces)}, {{namespace}} being {namespace}); the "
            "pods named there reach the engines' OpenAI port: ask the "
            "platform team to list the namespace its gateway runs in (guardrails.inferenceGatewayNamespaces)",
        )
    ]


def check_model_deployment(
    md: ModelDeployment,
    guardrails: Guardrails,
    images: OperatorImages,
    managed: Collection[str] = (INGRESS, HTTP_ROUTE),
) -> list[Refusal]:
    """Every field of ``md`` the platform does not allow, in spec order (empty: it may be served).

    ``managed``: the exposure kinds the operator may create (the chart's ``rbac.ingress`` and
    ``rbac.httpRoute``). An Ingress or HTTPRoute it may not create is not checked: it is not written
    anyway, and ``ExposureUnavailable`` says so while the rest is served."""
    spec = md.spec
    namespace = str(md.metadata.get("namespace", ""))
    refusals = _check_image("spec.engine.image", spec.engine.image, guardrails, images)
    flags = check_engine_args(spec.engine.extra_args, guardrails)
    if flags:
        listed = ", ".join(sorted(TUNING_ENGINE_FLAGS | set(guardrails.engine_args)))
        refusals.append(
            Refusal(
                "spec.engine.extraArgs",
                f"{', '.join(flags)} not allowed: the operator sets its own flags (vLLM keeps the last), and "
                f"other flags can load code, log prompts or send KV elsewhere; allowed: {listed} (the "
                "platform team adds more with guardrails.engineArgs)",
            )
        )
    if spec.kv_cache.nvme is not None and spec.kv_cache.nvme.host_path is not None:
        why = check_host_path(spec.kv_cache.nvme.host_path, guardrails)
        if why is not None:
            refusals.append(Refusal("spec.kvCache.nvme.hostPath", why))
    priority = spec.pool.pod_template.priority_class_name
    if priority is not None:
        allowed_priorities = guardrails.priority_class_names
        if (allowed_priorities and priority not in allowed_priorities) or (
            not allowed_priorities and priority.startswith("system-")
        ):
            refusals.append(
                Refusal(
                    "spec.pool.podTemplate.priorityClassName",
                    f"{priority!r} is not allowed ("
                    + (
                        f"allowed: {_listing(allowed_priorities)}"
                        if allowed_priorities
                        else "system-* classes preempt other namespaces' pods"
                    )
                    + ")",
                )
            )
    refusals += _check_image("spec.gateway.image", spec.gateway.image, guardrails, images)
    refusals += _check_exposure(md, guardrails, namespace, managed)
    refusals += _check_inference_pool(md, guardrails, namespace)
    return refusals
