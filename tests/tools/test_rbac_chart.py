"""RBAC least privilege, the chart side: the rules ``helm template`` renders grant the operator exactly what
its code uses (the allowlist derived in tests/rbac_allowlist.py), and nothing cluster-wide unless asked.

Rendered rules (every scope and option) must stay inside that allowlist, with no wildcard; the namespaced
rules must cover all of it (or the operator breaks: ``tests/cluster/test_chart_cluster.py`` runs it with
the chart's identity).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary

from components import missing_component
from kvfleet_operator.k8s import kinds
from rbac_allowlist import EXPOSURE, LEASES, MONITORING, NEEDED, NODES_LIST, READ_NODES, Grant

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
RELEASE_NS = "kvfleet-system"


# --- the rendered chart -----------------------------------------------------------------------------------
def _render(*args: str) -> list[dict[str, Any]]:
    helm = find_binary("helm")
    if helm is None:
        missing_component("helm", "hack/build-cluster.sh")
    done = subprocess.run(
        [str(helm), "template", "kvfleet", str(CHART), "-n", RELEASE_NS, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


SCOPES = {
    "default": (),
    "listed-namespaces": ("--set", "operator.watchNamespaces={llm,llm-bank}"),
    "all-namespaces": ("--set", "operator.watchAllNamespaces=true"),
    "no-monitoring": ("--set", "rbac.monitoring=false"),
    "monitoring-api": ("--api-versions", "monitoring.coreos.com/v1"),
    "exposure": (
        "--set",
        "rbac.ingress=true",
        "--set",
        "rbac.httpRoute=true",
        "--set",
        "rbac.inferencePool=true",
        "--set",
        "rbac.keda=true",
    ),
}


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def _roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in {"Role", "ClusterRole"}]


def _grants(role: dict[str, Any]) -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("args", SCOPES.values(), ids=SCOPES.keys())
def test_no_wildcard_and_nothing_the_operator_does_not_use(args: tuple[str, ...]) -> None:
    for role in _roles(_render(*args)):
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, role["metadata"]["name"]
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
        extra = _grants(role) - NEEDED
        assert not extra, (
            f"{role['kind']} {role['metadata']['name']} grants what the operator never uses: {extra}"
        )


@pytest.mark.parametrize("args", SCOPES.values(), ids=SCOPES.keys())
def test_the_watched_namespaces_get_everything_the_operator_needs(args: tuple[str, ...]) -> None:
    docs = _render(*args)
    needed = {g for g in NEEDED if g[:2] not in MONITORING} if "rbac.monitoring=false" in args else NEEDED
    needed = {g for g in needed if g[:2] != LEASES} - {NODES_LIST}
    if "rbac.ingress=true" not in args:
        needed = {g for g in needed if g[:2] not in EXPOSURE}
    watched = [r for r in _roles(docs) if r["metadata"]["name"] == "kvfleet"]
    assert watched
    for role in watched:
        missing = needed - _grants(role)
        assert not missing, f"{role['kind']} in {role['metadata'].get('namespace')} lacks {missing}"


def _cluster_wide(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cluster-wide RBAC objects other than the node-reading pair."""
    return [
        d
        for d in docs
        if d["kind"] in {"ClusterRole", "ClusterRoleBinding"} and d["metadata"]["name"] != READ_NODES
    ]


def test_the_only_cluster_wide_right_by_default_is_listing_nodes() -> None:
    docs = _render()
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert role["metadata"]["name"] == binding["roleRef"]["name"] == READ_NODES
    assert _grants(role) == {NODES_LIST}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvfleet", "namespace": RELEASE_NS}]
    off = _render("--set", "rbac.readNodes=false")
    assert not [d for d in off if d["kind"] in {"ClusterRole", "ClusterRoleBinding"}]


def test_namespaced_by_default_the_release_namespace_only_and_nothing_cluster_wide() -> None:
    docs = _render()
    assert not _cluster_wide(docs)
    watched = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kvfleet"]
    assert [r["metadata"]["namespace"] for r in watched] == [RELEASE_NS]
    args = _operator_args(docs)
    assert f"--namespace={RELEASE_NS}" in args and "--all-namespaces" not in args


def test_listed_namespaces_get_one_role_each_bound_to_the_operator() -> None:
    docs = _render(*SCOPES["listed-namespaces"])
    assert not _cluster_wide(docs)
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kvfleet"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "kvfleet"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm", "llm-bank"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm", "llm-bank"]
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvfleet", "namespace": RELEASE_NS}]
    args = _operator_args(docs)
    assert "--namespace=llm" in args and "--namespace=llm-bank" in args and "--all-namespaces" not in args


def test_cluster_wide_only_when_asked() -> None:
    docs = _render(*SCOPES["all-namespaces"])
    (cluster_role,) = [d for d in _cluster_wide(docs) if d["kind"] == "ClusterRole"]
    (binding,) = [d for d in _cluster_wide(docs) if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"] == "kvfleet"
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kvfleet"]
    args = _operator_args(docs)
    assert "--all-namespaces" in args and not [a for a in args if a.startswith("--namespace=")]


def test_the_release_namespace_secret_is_the_salt_master_by_name_only() -> None:
    """The operator keeps its salt master key in one Secret of the release namespace: every verb on it is
    limited to that name (the create by server-side apply is authorized with the name)."""
    role = next(
        d for d in _render(*SCOPES["listed-namespaces"]) if d["metadata"]["name"] == "kvfleet-salt-master"
    )
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == RELEASE_NS
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["kvfleet-salt-master"],
            "verbs": ["get", "create", "patch"],
        }
    ]


def test_the_shared_stores_secrets_are_read_by_name_only_and_only_when_a_store_is_set() -> None:
    """``gatewaySharedStore``: the operator reads the store's password and CA Secrets (in the release
    namespace) by name, with ``get`` alone; named Secrets without a URL grant nothing."""
    store = (
        "--set", "gatewaySharedStore.passwordSecret.name=store-password",
        "--set", "gatewaySharedStore.caSecret.name=store-ca",
    )  # fmt: skip

    def rules(*args: str) -> list[dict[str, Any]]:
        docs = _render(*SCOPES["listed-namespaces"], *store, *args)
        return next(d for d in docs if d["metadata"]["name"] == "kvfleet-salt-master")["rules"]

    assert rules()[1:] == []
    assert rules("--set", "gatewaySharedStore.url=rediss://store.platform:6380")[1:] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["store-password", "store-ca"],
            "verbs": ["get"],
        }
    ]


@pytest.mark.parametrize("args", SCOPES.values(), ids=SCOPES.keys())
def test_leader_election_reads_and_renews_its_lease_by_name_only(args: tuple[str, ...]) -> None:
    """The Lease: get and update limited to its name, create (which RBAC cannot limit by name) on Leases of
    the release namespace only; no other role touches Leases."""
    roles = _roles(_render(*args))
    (role,) = [r for r in roles if r["metadata"]["name"] == "kvfleet-leader-election"]
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == RELEASE_NS
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["kvfleet-leader"],
            "verbs": ["get", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]
    assert _grants(role) == {g for g in NEEDED if g[:2] == LEASES}
    others = [r for r in roles if r is not role and {g[:2] for g in _grants(r)} & {LEASES}]
    assert not others, [r["metadata"]["name"] for r in others]
    assert "--leader-election-lease=kvfleet-leader" in _operator_args(_render(*args))


@pytest.mark.parametrize(
    ("args", "granted", "env"),
    [
        pytest.param((), set(), "", id="off-by-default"),
        pytest.param(
            ("--set", "rbac.ingress=true"), {("networking.k8s.io", "ingresses")}, "Ingress", id="ingress"
        ),
        pytest.param(
            ("--set", "rbac.httpRoute=true"),
            {("gateway.networking.k8s.io", "httproutes")},
            "HTTPRoute",
            id="route",
        ),
        pytest.param(
            ("--set", "rbac.inferencePool=true"),
            {("inference.networking.k8s.io", "inferencepools")},
            "InferencePool",
            id="inference-pool",
        ),
        pytest.param(("--set", "rbac.keda=true"), {("keda.sh", "scaledobjects")}, "ScaledObject", id="keda"),
        pytest.param(SCOPES["exposure"], EXPOSURE, "Ingress,HTTPRoute,InferencePool,ScaledObject", id="all"),
    ],
)
def test_exposure_rights_only_when_enabled_and_the_operator_is_told(
    args: tuple[str, ...], granted: set[tuple[str, str]], env: str
) -> None:
    """Least privilege: no right on Ingresses, HTTPRoutes, InferencePools or KEDA ScaledObjects unless the
    chart value asks;
    the operator learns which it may manage from KVFLEET_EXPOSURE_KINDS (it never lists a kind it has no
    right to), and nothing watches them (the verbs are get, list, create, patch, delete; get: whose an
    object of the name is, before any write)."""
    docs = _render(*args)
    for role in _roles(docs):
        assert {g[:2] for g in _grants(role)} & EXPOSURE == (
            granted if role["metadata"]["name"] == "kvfleet" else set()
        )
    role = next(r for r in _roles(docs) if r["metadata"]["name"] == "kvfleet")
    for resource in granted:
        verbs = {g[2] for g in _grants(role) if g[:2] == resource}
        assert verbs == {"get", "list", "create", "patch", "delete"}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    environment = {
        e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert environment["KVFLEET_EXPOSURE_KINDS"] == env
    assert [k.kind for k in kinds.parse_exposure_kinds(env)] == [k for k in env.split(",") if k]


def test_without_monitoring_rbac_no_monitor_rights() -> None:
    for role in _roles(_render(*SCOPES["no-monitoring"])):
        assert not {g[:2] for g in _grants(role)} & MONITORING
