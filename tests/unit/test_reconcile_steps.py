"""The reconcile's decisions that touch no API: the pure functions (reconcile/steps.py) and the shell's
steps that call them (handlers/reconcile.py), run on a Cycle filled in as the read steps would.

The shell's pure steps run with a ``KubeClient`` that was never opened: any API call would fail, and its
call counter proves none was made. The cluster tests (tests/cluster/test_operator_reconcile.py) run the
whole list against a real API server.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import reasons
from kvfleet_operator.build.keys import KeyResolution
from kvfleet_operator.build.model_deployment import OperatorImages
from kvfleet_operator.build.tenant_table import TenantDecision
from kvfleet_operator.handlers import reconcile as shell
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.conditions import ConditionUpdate
from kvfleet_runtime.config import hash_api_key

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "local"
NAMESPACE = "kvfleet-demo"
CONFIG = shell.OperatorConfig(images=OperatorImages(engine="e:1", gateway="g:1"), salt_master=b"m" * 32)
NOW, LATER, LATEST = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z", "2026-01-01T00:10:00Z"

#: The steps of the shell that make no API call, in the order STEPS and STATUS_STEPS run them.
PURE_STEPS = (
    shell.parse_model_deployment,
    shell.parse_tenants,
    shell.resolve_keys,
    shell.size_pool,
    shell.admit,
    shell.build_desired,
    shell.plan,
    shell.compute_status,
)


def _raw(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def _raw_md(**spec: Any) -> dict[str, Any]:
    doc = _raw("modeldeployment-tiny.yaml", uid="md-uid", generation=1)
    doc["spec"].update(spec)
    return doc


def _raw_tenant(name: str, i: int, **spec: Any) -> dict[str, Any]:
    doc = _raw(
        f"tenant-{name}.yaml", uid=f"uid-{name}", generation=1, creationTimestamp=f"2026-01-01T00:00:0{i}Z"
    )
    doc["spec"].update(spec)
    return doc


def _strong(seed: str) -> str:
    """A key that passes the strength rule, different for each ``seed``."""
    return "kvf-" + hashlib.sha256(seed.encode()).hexdigest()


def _key_secret(name: str, key: str, data_key: str = "api-key", tenant: str | None = None) -> dict[str, Any]:
    """A Secret marked for ``tenant`` (by default the one ``<tenant>-api-key`` names)."""
    owner = tenant or name.removesuffix("-api-key")
    return {
        "metadata": {"name": name, "labels": {"kvfleet.io/tenant": owner}},
        "data": {data_key: base64.b64encode(key.encode()).decode()},
    }


def _unopened_client() -> KubeClient:
    return KubeClient(Credentials(server="https://unused.invalid"))


async def _run_pure(
    raw_md: dict[str, Any] | None,
    raw_tenants: list[dict[str, Any]],
    secrets: Sequence[dict[str, Any]] = (),
    children: Sequence[dict[str, Any]] = (),
    now: str = NOW,
) -> shell.Cycle:
    """What the reconcile decides, given what the read steps would have read."""
    client = _unopened_client()
    c = shell.Cycle(config=CONFIG, namespace=NAMESPACE, name="tiny", now=now)
    c.raw_md = raw_md
    c.raw_tenants = steps.select_tenants(raw_tenants, "tiny")
    c.secrets = {s["metadata"]["name"]: s for s in secrets}
    c.children = list(children)
    for step in PURE_STEPS:
        if c.finished and step not in shell.STATUS_STEPS:
            continue
        await step(client, c)
    assert client.calls == Counter()
    return c


def _local_tenants() -> list[dict[str, Any]]:
    return [_raw_tenant(n, i) for i, n in enumerate(("premium", "basic-a", "basic-b"))]


def _secrets() -> list[dict[str, Any]]:
    return [_key_secret(f"{n}-api-key", _strong(n)) for n in ("premium", "basic-a", "basic-b")]


def _ready_of(write: Any) -> tuple[str, str]:
    ready = next(c for c in write.status["conditions"] if c["type"] == "Ready")
    return ready["status"], ready["reason"]


def _converge(c: shell.Cycle) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The world after ``c`` was applied and every workload became ready: children and statuses."""
    assert c.desired is not None
    children = copy.deepcopy(c.desired)
    for child in children:
        if child["kind"] in ("StatefulSet", "Deployment"):
            child["status"] = {"readyReplicas": child["spec"]["replicas"]}
    statuses = {w.raw["metadata"]["name"]: w.status for w in c.status_writes}
    return children, statuses


async def test_a_second_reconcile_of_a_converged_object_plans_and_writes_nothing() -> None:
    first = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    assert first.desired and first.plan and all(w.changed for w in first.status_writes)
    children, statuses = _converge(first)
    raw_md = {**_raw_md(), "status": statuses["tiny"]}
    tenants = [{**t, "status": statuses[t["metadata"]["name"]]} for t in _local_tenants()]
    ready = await _run_pure(raw_md, tenants, _secrets(), children, now=LATER)
    assert ready.plan == []
    # The workloads became ready since the first reconcile: Ready flips once...
    assert [_ready_of(w) for w in ready.status_writes] == [("True", "Ready")] * 4
    children, statuses = _converge(ready)
    raw_md = {**_raw_md(), "status": statuses["tiny"]}
    tenants = [{**t, "status": statuses[t["metadata"]["name"]]} for t in _local_tenants()]
    # ...and then nothing changes any more.
    again = await _run_pure(raw_md, tenants, _secrets(), children, now=LATEST)
    assert again.plan == []
    assert [w.changed for w in again.status_writes] == [False] * 4


async def test_drift_is_planned_and_an_orphaned_child_pruned() -> None:
    first = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    children, _ = _converge(first)
    gateway = next(c for c in children if c["kind"] == "Deployment")
    gateway["spec"]["replicas"] = 5  # someone scaled it by hand
    stray = copy.deepcopy(next(c for c in children if c["kind"] == "ConfigMap"))
    stray["metadata"]["name"] = "tiny-old"
    again = await _run_pure(_raw_md(), _local_tenants(), _secrets(), [*children, stray])
    assert [a.describe() for a in again.plan] == [
        f"apply Deployment {NAMESPACE}/tiny-gateway",
        f"delete ConfigMap {NAMESPACE}/tiny-old",
    ]


async def test_tenant_with_a_missing_secret_is_left_out_of_everything() -> None:
    ghost = _raw_tenant("basic-a", 3, apiKeySecretRef={"name": "nowhere"})
    ghost["metadata"]["name"] = "ghost"
    tenants = [*_local_tenants(), ghost]
    c = await _run_pure(_raw_md(), tenants, _secrets())
    assert "ghost" not in {t.metadata["name"] for t in c.tenants}
    assert "ghost" not in {d.name for d in c.decisions}
    assert c.tenant_problems["ghost"].reason == reasons.API_KEY_SECRET_NOT_FOUND
    rendered = "".join(str(child) for child in c.desired or [])
    assert "ghost" not in rendered
    by_name = {w.raw["metadata"]["name"]: w for w in c.status_writes}
    assert _ready_of(by_name["ghost"]) == ("False", "ApiKeySecretNotFound")
    assert set(by_name["ghost"].status) == {"conditions", "observedGeneration"}


async def test_only_admitted_tenants_get_a_generated_key_and_a_key_hash() -> None:
    greedy = _raw_tenant("premium", 5, kvQuota={"hbm": "60%"}, burstLimit="60%")
    greedy["metadata"]["name"] = "greedy"
    c = await _run_pure(_raw_md(), [*_local_tenants(), greedy], _secrets())  # no Secret for greedy
    decisions = {d.name: d for d in c.decisions}
    assert not decisions["greedy"].admitted
    assert c.keys["greedy"].generate
    assert steps.keys_to_generate(c.keys, c.decisions) == []
    keys_secret = next(ch for ch in c.desired or [] if ch["kind"] == "Secret")
    key_file = base64.b64decode(keys_secret["data"]["keys.json"]).decode()
    assert "greedy" not in key_file
    assert hash_api_key(_strong("premium")) in key_file


def _with_status(raws: list[dict[str, Any]], statuses: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**t, "status": statuses[t["metadata"]["name"]]} for t in raws]


async def test_status_shows_requested_and_admitted_quota_and_key_fingerprints() -> None:
    c = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    status = {w.raw["metadata"]["name"]: w.status for w in c.status_writes}["premium"]
    quota = {"hbm": "40%", "cpu": "64Mi", "nvme": "0", "burstLimit": "60%"}
    assert status["requestedQuota"] == status["admittedQuota"] == quota
    assert status["apiKeyFingerprints"] == {"current": f"sha256:{hash_api_key(_strong('premium'))[:12]}"}


async def test_a_refused_raise_keeps_serving_at_the_admitted_quota() -> None:
    """Threat: an admitted tenant that asks for more loses what it had (or takes a neighbour's room)."""
    first = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    children, statuses = _converge(first)
    raised = _with_status(_local_tenants(), statuses)
    raised[0]["spec"].update(kvQuota={"hbm": "90%", "cpu": "64Mi"}, burstLimit="90%")
    c = await _run_pure(_raw_md(), raised, _secrets(), children, now=LATER)
    premium = {w.raw["metadata"]["name"]: w.status for w in c.status_writes}["premium"]
    conditions = {x["type"]: (x["status"], x["reason"]) for x in premium["conditions"]}
    assert conditions == {
        "Ready": ("True", "QuotaChangeRefused"),
        "Progressing": ("False", "QuotaChangeRefused"),
        "Degraded": ("True", "QuotaChangeRefused"),
    }
    assert premium["admittedQuota"]["hbm"] == "40%" and premium["requestedQuota"]["hbm"] == "90%"
    assert "HBM guarantees would total" in next(x["message"] for x in premium["conditions"])
    assert c.plan == []  # nothing of the refused raise reaches the data plane
    assert [_ready_of(w) for w in c.status_writes[2:]] == [("True", "Ready")] * 2  # the neighbours


async def test_tenants_sharing_a_key_are_refused_and_neither_hash_is_rendered() -> None:
    """Threat: two tenants with one key; the gateway would route the key to one of them silently."""
    first = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    children, statuses = _converge(first)
    secrets = _secrets()
    secrets[1] = _key_secret("basic-a-api-key", _strong("premium"))  # basic-a copies premium's key
    c = await _run_pure(_raw_md(), _with_status(_local_tenants(), statuses), secrets, children, now=LATER)
    by_name = {w.raw["metadata"]["name"]: w for w in c.status_writes}
    for name, other in (("premium", "basic-a"), ("basic-a", "premium")):
        assert _ready_of(by_name[name]) == ("False", "ApiKeyShared")
        assert f"'{other}'" in by_name[name].status["conditions"][0]["message"]
        # Each keeps the room it was admitted with, to come back at the same quota once its key is fixed.
        assert by_name[name].status["admittedQuota"] == statuses[name]["admittedQuota"]
    keys_secret = next(ch for ch in c.desired or [] if ch["kind"] == "Secret")
    key_file = base64.b64decode(keys_secret["data"]["keys.json"]).decode()
    assert hash_api_key(_strong("premium")) not in key_file
    assert hash_api_key(_strong("basic-b")) in key_file
    assert {d.name for d in c.decisions} == {"basic-b"}


@pytest.mark.parametrize(
    ("raw_md", "writes"),
    [
        pytest.param(None, [("Tenant", "ModelDeploymentNotFound")] * 3, id="missing"),
        pytest.param(
            _raw_md() | {"metadata": _raw_md()["metadata"] | {"deletionTimestamp": NOW}},
            [("Tenant", "ModelDeploymentDeleting")] * 3,
            id="deleting",
        ),
        pytest.param(_raw_md(pool={"replicas": -1}), [("ModelDeployment", "InvalidSpec")], id="invalid"),
    ],
)
async def test_a_model_deployment_that_cannot_be_served_ends_the_work(
    raw_md: dict[str, Any] | None, writes: list[tuple[str, str]]
) -> None:
    c = await _run_pure(raw_md, _local_tenants(), _secrets())
    assert c.finished
    assert (c.tenants, c.decisions, c.desired, c.plan) == ([], [], None, [])
    assert [(w.kind.kind, _ready_of(w)[1]) for w in c.status_writes] == writes


async def test_a_pool_that_cannot_be_sized_changes_no_child() -> None:
    first = await _run_pure(_raw_md(), _local_tenants(), _secrets())
    children, _ = _converge(first)
    md = _raw_md()
    del md["spec"]["pool"]["cpuKvCacheSpace"]  # a CPU engine with no KV space cannot be sized
    c = await _run_pure(md, _local_tenants(), _secrets(), children)
    assert c.result.problem is not None and c.result.problem.reason == reasons.CAPACITY_UNKNOWN
    assert (c.decisions, c.desired, c.plan) == ([], None, [])  # existing children are left alone
    assert [_ready_of(w) for w in c.status_writes] == [("False", "CapacityUnknown")] + [
        ("False", "ModelDeploymentNotReady")
    ] * 3


# --- The pure functions, one table each -----------------------------------------------------------------


def _t(name: str, ref: str | None = "tiny", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "spec": {"modelDeploymentRef": {"name": ref}} if ref else {}}


@pytest.mark.parametrize(
    ("listed", "selected"),
    [
        pytest.param([_t("a"), _t("b")], ["a", "b"], id="all-mine"),
        pytest.param([_t("b"), _t("a")], ["b", "a"], id="listed-order-kept"),
        pytest.param([_t("a", ref="other")], [], id="another-model-deployment"),
        pytest.param([_t("a", ref=None)], [], id="no-reference"),
        pytest.param([_t("a", deleting=True), _t("b")], ["b"], id="being-deleted"),
    ],
)
def test_select_tenants(listed: list[dict[str, Any]], selected: list[str]) -> None:
    assert list(steps.select_tenants(listed, "tiny")) == selected


@pytest.mark.parametrize(
    ("raw", "reason", "field"),
    [
        pytest.param(_raw_md(), None, None, id="valid"),
        pytest.param(
            _raw_md(pool={"replicas": -1}), reasons.INVALID_SPEC, "spec.pool.replicas", id="bad-field"
        ),
        pytest.param(_raw_md(bogus=1), reasons.INVALID_SPEC, "spec.bogus", id="unknown-field"),
    ],
)
def test_parse_model_deployment(raw: dict[str, Any], reason: str | None, field: str | None) -> None:
    parsed = steps.parse_model_deployment(raw)
    if reason is None:
        assert not isinstance(parsed, ConditionUpdate)
        assert parsed.metadata["name"] == "tiny"
    else:
        assert isinstance(parsed, ConditionUpdate)
        assert (parsed.type, parsed.status, parsed.reason) == ("Ready", "False", reason)
        assert field is not None and field in parsed.message


def test_parse_tenants_names_the_field_of_each_bad_one() -> None:
    bad = _raw_tenant("basic-a", 1, tier="gold")
    bad["metadata"]["name"] = "bad"
    tenants, problems = steps.parse_tenants({"premium": _raw_tenant("premium", 0), "bad": bad})
    assert [t.metadata["name"] for t in tenants] == ["premium"]
    assert set(problems) == {"bad"}
    assert problems["bad"].reason == reasons.INVALID_SPEC and "spec.tier" in problems["bad"].message


@pytest.mark.parametrize(
    ("spec", "secrets", "usable", "resolution", "problem"),
    [
        pytest.param({}, {}, True, KeyResolution("premium-api-key", generate=True), None, id="to-generate"),
        pytest.param(
            {},
            {"premium-api-key": _key_secret("premium-api-key", _strong("k"))},
            True,
            KeyResolution(
                "premium-api-key",
                hashes=(hash_api_key(_strong("k")),),
                fingerprints=(f"sha256:{hash_api_key(_strong('k'))[:12]}",),
            ),
            None,
            id="resolved",
        ),
        pytest.param(
            {"apiKeySecretRef": {"name": "own"}},
            {"premium-api-key": _key_secret("premium-api-key", _strong("k"))},
            False,
            None,
            reasons.API_KEY_SECRET_NOT_FOUND,
            id="referenced-secret-missing",
        ),
        pytest.param(
            {"apiKeySecretRef": {"name": "basic-a-api-key"}},
            {"basic-a-api-key": _key_secret("basic-a-api-key", _strong("k"))},
            False,
            None,
            reasons.API_KEY_SECRET_NOT_LABELLED,
            id="another-tenants-secret",
        ),
        pytest.param(
            {},
            {"premium-api-key": _key_secret("premium-api-key", "kvf-premium")},
            False,
            None,
            reasons.API_KEY_TOO_WEAK,
            id="weak",
        ),
    ],
)
def test_resolve_keys(
    spec: dict[str, Any],
    secrets: dict[str, dict[str, Any]],
    usable: bool,
    resolution: KeyResolution | None,
    problem: str | None,
) -> None:
    (tenant,), _ = steps.parse_tenants({"premium": _raw_tenant("premium", 0, **spec)})
    resolved = steps.resolve_keys([tenant], secrets, "tiny")
    assert (resolved.usable == [tenant]) is usable
    assert (resolved.refused == [tenant]) is not usable
    if resolution is not None:
        assert resolved.resolutions["premium"] == resolution
    assert (resolved.problems["premium"].reason if resolved.problems else None) == problem


def test_a_shared_key_is_refused_for_every_tenant_holding_it_naming_the_others() -> None:
    tenants, _ = steps.parse_tenants(
        {n: _raw_tenant(n, i) for i, n in enumerate(("premium", "basic-a", "basic-b"))}
    )
    shared = _strong("shared")
    secrets = {
        "premium-api-key": _key_secret("premium-api-key", shared),
        "basic-a-api-key": _key_secret("basic-a-api-key", _strong("a"), tenant="basic-a"),
        "basic-b-api-key": _key_secret("basic-b-api-key", _strong("b")),
    }
    # basic-a's previous key is premium's current one: a shared key all the same.
    secrets["basic-a-api-key"]["data"]["api-key-previous"] = base64.b64encode(shared.encode()).decode()
    resolved = steps.resolve_keys(tenants, secrets, "tiny")
    assert [t.metadata["name"] for t in resolved.usable] == ["basic-b"]
    assert [t.metadata["name"] for t in resolved.refused] == ["premium", "basic-a"]
    for name, other in (("premium", "basic-a"), ("basic-a", "premium")):
        problem = resolved.problems[name]
        assert problem.reason == reasons.API_KEY_SHARED
        assert f"'{other}'" in problem.message and "ModelDeployment 'tiny'" in problem.message
        assert f"sha256:{hash_api_key(shared)[:12]}" in problem.message
        assert shared not in problem.message


def test_size_pool() -> None:
    md = steps.parse_model_deployment(_raw_md())
    assert not isinstance(md, ConditionUpdate)
    sized = steps.size_pool(md)
    assert not isinstance(sized, ConditionUpdate) and sized.hbm_blocks == 65_536
    unsized = _raw_md()
    del unsized["spec"]["pool"]["cpuKvCacheSpace"]
    md = steps.parse_model_deployment(unsized)
    assert not isinstance(md, ConditionUpdate)
    problem = steps.size_pool(md)
    assert isinstance(problem, ConditionUpdate) and problem.reason == reasons.CAPACITY_UNKNOWN
    assert "cpuKvCacheSpace" in problem.message


def _decision(name: str, admitted: bool) -> TenantDecision:
    return TenantDecision(
        name, admitted, reasons.ADMITTED if admitted else reasons.QUOTA_EXCEEDS_CAPACITY, "", "shared"
    )


@pytest.mark.parametrize(
    ("resolutions", "decisions", "expected"),
    [
        pytest.param(
            {"a": KeyResolution("a-api-key", generate=True)}, [_decision("a", True)], ["a"], id="admitted"
        ),
        pytest.param(
            {"a": KeyResolution("a-api-key", generate=True)}, [_decision("a", False)], [], id="rejected"
        ),
        pytest.param(
            {"a": KeyResolution("a-api-key", hashes=("h",))}, [_decision("a", True)], [], id="has-a-key"
        ),
        pytest.param({}, [_decision("a", True)], [], id="unknown-tenant"),
    ],
)
def test_keys_to_generate(
    resolutions: dict[str, KeyResolution], decisions: list[TenantDecision], expected: list[str]
) -> None:
    assert steps.keys_to_generate(resolutions, decisions) == expected


def test_key_hashes_only_for_resolved_keys() -> None:
    resolutions = {
        "a": KeyResolution("a", hashes=("h1", "h0")),
        "b": KeyResolution("b", generate=True),
        "c": KeyResolution("c", reason=reasons.API_KEY_SECRET_NOT_FOUND, message="no"),
    }
    assert steps.key_hashes(resolutions) == {"a": ("h1", "h0")}


@pytest.mark.parametrize(
    ("monitoring", "present", "absent"),
    [
        pytest.param(
            False,
            {kinds.STATEFUL_SET, kinds.CONFIG_MAP},
            {kinds.SERVICE_MONITOR, kinds.POD_MONITOR},
            id="off",
        ),
        pytest.param(True, {kinds.SERVICE_MONITOR, kinds.POD_MONITOR, kinds.STATEFUL_SET}, set(), id="on"),
    ],
)
def test_child_kinds(monitoring: bool, present: set[kinds.Kind], absent: set[kinds.Kind]) -> None:
    listed = steps.child_kinds(monitoring)
    assert present <= set(listed) and not absent & set(listed)
    assert listed == [k for k in kinds.CHILD_KINDS if k in listed]  # apply order kept


def test_steps_run_reads_before_decisions_and_writes_after() -> None:
    order = [step.__name__ for step in shell.STEPS]
    assert order.index("read_tenants") < order.index("parse_tenants") < order.index("admit")
    # A key Secret is generated only once admission has decided, and before the key file is built.
    assert order.index("admit") < order.index("generate_api_keys") < order.index("build_desired")
    assert order.index("plan") < order.index("apply") < order.index("prune")
    # A lost engine pod is force-deleted once the StatefulSets it belongs to are applied and listed.
    assert order.index("read_children") < order.index("replace_lost_engine_pods")
    assert order.index("prune") < order.index("replace_lost_engine_pods")
    assert [step.__name__ for step in shell.STATUS_STEPS] == ["compute_status", "write_status"]
