"""The reconcile's decisions between reading the world and building the desired state. Pure.

``handlers/reconcile.py`` runs the reconcile as a list of named steps; the steps that touch no API call
these functions (and ``build``'s admission and builders, ``plan.compute_plan`` and ``status``), so each
decision is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.manifest import format_validation_error
from kvfleet_operator.build.common import SHARED_POOL
from kvfleet_operator.build.keys import (
    KeyResolution,
    api_key_secret_ref,
    find_shared_keys,
    fingerprint_of_hash,
    resolve_api_key_hashes,
)
from kvfleet_operator.build.tenant_table import PoolCapacity, TenantDecision, compute_pool_capacity
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile.conditions import ConditionUpdate
from kvfleet_operator.reconcile.placement import compute_placement_problems
from kvfleet_operator.reconcile.status import problem
from kvfleet_runtime.kv.sizing import SizingError

Obj = dict[str, Any]


def refers_to(raw_tenant: Mapping[str, Any], model_deployment: str) -> bool:
    """Whether the tenant's ``spec.modelDeploymentRef`` names ``model_deployment``."""
    ref = (raw_tenant.get("spec") or {}).get("modelDeploymentRef") or {}
    return bool(ref.get("name") == model_deployment)


def is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def select_tenants(raw_tenants: Iterable[Obj], model_deployment: str) -> dict[str, Obj]:
    """The tenants of ``model_deployment`` that are not being deleted, by name, in the order listed."""
    return {
        str(t["metadata"]["name"]): t
        for t in raw_tenants
        if refers_to(t, model_deployment) and not is_deleting(t)
    }


def _invalid(error: ValidationError) -> ConditionUpdate:
    return problem(reasons.INVALID_SPEC, "; ".join(format_validation_error(error)))


def parse_model_deployment(raw: Obj) -> ModelDeployment | ConditionUpdate:
    """The parsed ModelDeployment, or ``InvalidSpec`` naming every offending field."""
    try:
        return ModelDeployment.model_validate(raw)
    except ValidationError as error:
        return _invalid(error)


def parse_tenants(raw_tenants: Mapping[str, Obj]) -> tuple[list[Tenant], dict[str, ConditionUpdate]]:
    """The tenants that parse, in order, and ``InvalidSpec`` (naming the fields) for each that does not."""
    tenants: list[Tenant] = []
    problems: dict[str, ConditionUpdate] = {}
    for name, raw in raw_tenants.items():
        try:
            tenants.append(Tenant.model_validate(raw))
        except ValidationError as error:
            problems[name] = _invalid(error)
    return tenants, problems


@dataclass
class ResolvedKeys:
    """Each tenant's API keys, and which tenants may go on to admission."""

    #: Tenants whose keys resolve (or will be generated once they are admitted), in order.
    usable: list[Tenant] = field(default_factory=list)
    #: Tenants whose key is refused: served with nothing, but an admitted one keeps the room of its
    #: admitted quota (``admit_tenants``'s ``held``) until its key is fixed.
    refused: list[Tenant] = field(default_factory=list)
    resolutions: dict[str, KeyResolution] = field(default_factory=dict)
    #: Why each refused tenant's key is refused.
    problems: dict[str, ConditionUpdate] = field(default_factory=dict)


def _shared_key_problem(
    model_deployment: str, others: Sequence[str], shared: Sequence[str]
) -> ConditionUpdate:
    names = ", ".join(repr(o) for o in others)
    prints = ", ".join(fingerprint_of_hash(h) for h in shared)
    return problem(
        reasons.API_KEY_SHARED,
        f"Tenant(s) {names} of ModelDeployment {model_deployment!r} have the same API key ({prints}): its "
        "gateway could not tell them apart, so this key is refused for all of them and none is served "
        "with it. Give each tenant its own key (docs/operations.md, rotating an API key).",
    )


def resolve_keys(
    tenants: Sequence[Tenant], secrets: Mapping[str, Obj], model_deployment: str
) -> ResolvedKeys:
    """Each tenant's API keys from the namespace's Secrets (by name); see ``build/keys.py`` for the rules.

    A tenant is refused when its Secret named in ``spec.apiKeySecretRef`` (or its data key) is missing
    (``ApiKeySecretNotFound``), the Secret is not marked for it (``ApiKeySecretNotLabelled``), a key is
    weak (``ApiKeyTooWeak``), or another tenant of ``model_deployment`` holds one of its keys
    (``ApiKeyShared``, for every tenant holding it: which one is the rightful holder cannot be known).
    """
    out = ResolvedKeys()
    for tenant in tenants:
        name = str(tenant.metadata["name"])
        resolution = resolve_api_key_hashes(tenant, secrets.get(api_key_secret_ref(tenant)[0]))
        out.resolutions[name] = resolution
        if resolution.reason is not None:
            out.problems[name] = problem(resolution.reason, resolution.message or "")
    hashes = {name: r.hashes for name, r in out.resolutions.items() if r.hashes}
    for name, others in find_shared_keys(hashes).items():
        theirs = {h for other in others for h in hashes[other]}
        shared = [h for h in hashes[name] if h in theirs]
        out.problems[name] = _shared_key_problem(model_deployment, others, shared)
    for tenant in tenants:
        (out.refused if str(tenant.metadata["name"]) in out.problems else out.usable).append(tenant)
    return out


def size_pool(md: ModelDeployment) -> PoolCapacity | ConditionUpdate:
    """The pool's per-replica capacity, or ``CapacityUnknown`` saying why it cannot be sized."""
    try:
        return compute_pool_capacity(md)
    except SizingError as error:
        return problem(reasons.CAPACITY_UNKNOWN, str(error))


def keys_to_generate(
    resolutions: Mapping[str, KeyResolution], decisions: Sequence[TenantDecision]
) -> list[str]:
    """Tenants that get a generated API key Secret: admitted ones without a Secret. A rejected tenant
    leaves nothing behind."""
    return [
        d.name for d in decisions if d.admitted and d.name in resolutions and resolutions[d.name].generate
    ]


def key_hashes(resolutions: Mapping[str, KeyResolution]) -> dict[str, tuple[str, ...]]:
    """Tenant name -> hashes of its valid API keys, for the tenants whose keys resolved."""
    return {name: r.hashes for name, r in resolutions.items() if r.hashes}


def child_kinds(monitoring: bool, exposure: Collection[kinds.Kind] = ()) -> list[kinds.Kind]:
    """The kinds of children to list (and so to plan against): the monitoring kinds only when the
    cluster serves them, the exposure kinds only those the chart lets the operator manage (``exposure``)."""
    return [
        k
        for k in kinds.CHILD_KINDS
        if (monitoring or k not in kinds.MONITORING_KINDS)
        and (k in exposure or k not in kinds.EXPOSURE_KINDS)
    ]


#: Per exposure kind: the spec field that asks for it and the chart value that grants its rights.
_EXPOSURE_SOURCES = {
    kinds.INGRESS: ("spec.gateway.exposure.ingress", "rbac.ingress"),
    kinds.HTTP_ROUTE: ("spec.gateway.exposure.httpRoute", "rbac.httpRoute"),
    kinds.INFERENCE_POOL: ("spec.gateway.inferencePool", "rbac.inferencePool"),
    kinds.SCALED_OBJECT: ("spec.pool.autoscaling", "rbac.keda"),
}
#: What to install where the cluster does not serve a kind.
_INSTALL = {
    kinds.INGRESS: "an ingress controller",
    kinds.HTTP_ROUTE: "the Gateway API CRDs and a Gateway implementation",
    kinds.INFERENCE_POOL: "the Gateway API Inference Extension's InferencePool CRD (kubectl apply -f "
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.5.0/"
    "manifests.yaml) and a gateway that supports it",
    kinds.SCALED_OBJECT: "KEDA (v2.21 or later; docs/operations.md, Autoscaling)",
}
_UNTIL = "Until then the gateway is reachable in the cluster only (status.endpoint)."
#: What holds until a kind is created, where it is not ``_UNTIL``.
_UNTIL_KIND = {
    kinds.INFERENCE_POOL: "Until then no InferencePool is created, no NetworkPolicy admits the platform "
    "gateway's pods, and an HTTPRoute goes to the gateway Service.",
    kinds.SCALED_OBJECT: "Until then nothing scales the pool: spec.pool.replicas is what runs.",
}


def withhold_exposure(
    desired: Sequence[Obj], managed: Collection[kinds.Kind], unserved: Collection[kinds.Kind]
) -> tuple[list[Obj], dict[str, str]]:
    """``desired`` without the exposure objects the operator may not manage (not in ``managed``: the
    chart grants no rights on their kind) or the cluster does not serve (``unserved``: e.g. no Gateway API
    CRDs), and for each kind left out (by its ``kind`` name) a sentence saying why and what to do. The
    rest of the ModelDeployment is served as usual: the gateway stays reachable in the cluster."""
    kept: list[Obj] = []
    why: dict[str, str] = {}
    for obj in desired:
        kind = kinds.BY_API_KIND.get((str(obj["apiVersion"]), str(obj["kind"])))
        if kind is None or kind not in kinds.EXPOSURE_KINDS or (kind in managed and kind not in unserved):
            kept.append(obj)
            continue
        field, value = _EXPOSURE_SOURCES[kind]
        until = _UNTIL_KIND.get(kind, _UNTIL)
        article = "an" if kind.kind[0] in "AEIOU" else "a"
        if kind not in managed:
            why[kind.kind] = (
                f"{field} asks for {article} {kind.kind}, but this operator may not manage {kind.plural}: "
                f"install the chart with {value}=true. {until}"
            )
        else:
            why[kind.kind] = (
                f"{field} asks for {article} {kind.kind}, but the cluster does not serve "
                f"{kind.api_version}: install {_INSTALL[kind]}. {until}"
            )
    return kept, why


def engines_waiting(desired: Sequence[Obj] | None, children: Sequence[Obj]) -> bool:
    """Whether some desired engine StatefulSet has fewer ready replicas than it wants (or does not exist
    yet): only then is it worth listing the nodes to say why (a converged pool costs no node list)."""
    live = {o["metadata"]["name"]: o for o in children if o["kind"] == "StatefulSet"}
    for obj in desired or []:
        if obj["kind"] != "StatefulSet":
            continue
        ready = int(((live.get(obj["metadata"]["name"]) or {}).get("status") or {}).get("readyReplicas") or 0)
        if ready < int(obj["spec"]["replicas"]):
            return True
    return False


def compute_placement(
    desired: Sequence[Obj] | None, nodes: Sequence[Obj] | None, decisions: Sequence[TenantDecision]
) -> dict[str, str]:
    """Pool -> why no node can run its engine pods (``NoMatchingNodes``); empty when the nodes were not
    read (none waiting, or no right to list them) or every pool fits."""
    if desired is None or nodes is None:
        return {}
    owners = {d.pool: d.name for d in decisions if d.admitted and d.pool != SHARED_POOL}
    return compute_placement_problems(desired, nodes, owners)
