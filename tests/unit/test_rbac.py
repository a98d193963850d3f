"""RBAC least privilege: the chart grants the operator exactly what its code uses, and nothing cluster-wide
unless asked.

The allowlist is derived from the code, never copied by hand:

* every call of the operator's ``KubeClient`` in ``operator/kvfleet_operator`` (read from the source), the
  kind it names (``kinds.X``; a kind held in a variable ranges over ``kinds.CHILD_KINDS``, and a status
  write over the kinds ``StatusWrite`` is built with), and the RBAC verbs that client method needs
  (:data:`CLIENT_VERBS`; server-side apply that creates is authorized as ``create``);
* what kopf does for the handlers the operator registers (its registry): list and watch every resource
  it watches, patch the resources it keeps a finalizer on, create Events.

Rendered rules (every scope and option) must stay inside that allowlist, with no wildcard; the namespaced
rules must cover all of it (or the operator breaks: ``tests/cluster/test_chart_cluster.py`` runs it with
the chart's identity). And Secrets are only ever listed through a label selector.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from devcluster import find_binary

from conftest import missing_component
from kvfleet_operator.handlers import kopf_handlers  # noqa: F401 - registers the handlers with kopf
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import KubeClient

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
OPERATOR = REPO / "operator" / "kvfleet_operator"
RELEASE_NS = "kvfleet-system"

Grant = tuple[str, str, str]  # (API group, resource, verb)

#: The RBAC verbs each KubeClient method needs. ``None``: the method sends no resource request
#: (discovery is open to every authenticated user).
CLIENT_VERBS: dict[str, frozenset[str] | None] = {
    "get": frozenset({"get"}),
    "list": frozenset({"list"}),
    "apply": frozenset({"create", "patch"}),  # server-side apply of a missing object is a create
    "apply_status": frozenset({"patch"}),
    "merge_patch": frozenset({"patch"}),
    "delete": frozenset({"delete"}),
    "force_delete": frozenset({"delete"}),
    "create_event": frozenset({"create"}),
    "create": frozenset({"create"}),
    "replace": frozenset({"update"}),
    "api_group_exists": None,
}


def test_every_client_request_method_has_its_verbs() -> None:
    """A new KubeClient method must say which verbs it needs before the allowlist can be trusted."""
    methods = {
        name
        for name, fn in inspect.getmembers(KubeClient, inspect.iscoroutinefunction)
        if not name.startswith("_") and "_request" in inspect.getsource(fn)
    }
    assert methods == set(CLIENT_VERBS)


def _kind_named(node: ast.expr) -> kinds.Kind | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kinds":
        kind = getattr(kinds, node.attr)
        assert isinstance(kind, kinds.Kind)
        return kind
    return None


def _operator_calls() -> Iterator[tuple[str, ast.Call]]:
    """Every ``<...>client.<method>(...)`` call of a KubeClient method in the operator package."""
    for path in sorted(OPERATOR.rglob("*.py")):
        if path.parent.name == "k8s" and path.name == "client.py":
            continue  # the client itself; k8s/leader.py's Lease calls count
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
            if name == "client" and node.func.attr in CLIENT_VERBS:
                yield node.func.attr, node


def _status_kinds() -> set[kinds.Kind]:
    found = set()
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StatusWrite" and node.args:
                kind = _kind_named(node.args[0])
                if kind is not None:
                    found.add(kind)
    assert found, "no StatusWrite(kinds.X, ...) found: the derivation needs updating"
    return found


def _resource(kind: kinds.Kind, sub: str = "") -> tuple[str, str]:
    return kind.group, kind.plural + sub


def _code_grants() -> set[Grant]:
    grants: set[Grant] = set()
    for method, call in _operator_calls():
        verbs = CLIENT_VERBS[method]
        if verbs is None:
            continue
        if method == "create_event":
            targets = [(kinds.EVENT.group, kinds.EVENT.plural)]
        elif method == "apply_status":
            named = _kind_named(call.args[0])
            targets = [_resource(k, "/status") for k in ([named] if named else _status_kinds())]
        else:
            named = _kind_named(call.args[0])
            targets = [_resource(k) for k in ([named] if named else kinds.CHILD_KINDS)]
        grants |= {(group, resource, verb) for group, resource in targets for verb in verbs}
    return grants


def _kopf_grants() -> set[Grant]:
    registry = kopf.get_default_registry()
    grants: set[Grant] = {(kinds.EVENT.group, kinds.EVENT.plural, "create")}  # kopf posts Events
    for handler in [*registry._watching.get_all_handlers(), *registry._spawning.get_all_handlers()]:
        grants |= {(handler.selector.group or "", handler.selector.plural, v) for v in ("list", "watch")}
    for handler in registry._changing.get_all_handlers():  # kopf keeps a finalizer on these
        resource = (handler.selector.group or "", handler.selector.plural)
        grants |= {(*resource, verb) for verb in ("list", "watch", "patch")}
    return grants


#: Everything the operator's code and kopf need: in the namespaces it watches, and its Lease.
NEEDED: frozenset[Grant] = frozenset(_code_grants() | _kopf_grants())
MONITORING = {(k.group, k.plural) for k in (kinds.SERVICE_MONITOR, kinds.POD_MONITOR)}
#: Ingresses and HTTPRoutes: granted only when the chart asks (rbac.ingress, rbac.httpRoute; off by default).
EXPOSURE = {(k.group, k.plural) for k in kinds.EXPOSURE_KINDS}
#: The one cluster-scoped grant: listing nodes (rbac.readNodes), in its own ClusterRole; a namespaced Role
#: cannot grant it, so the watched namespaces' Roles are not asked for it.
NODES_LIST: Grant = (kinds.NODE.group, kinds.NODE.plural, "list")
READ_NODES = "kvfleet-read-nodes"
#: Leader election's Lease lives in the release namespace only, never in a watched one.
LEASES = (kinds.LEASE.group, kinds.LEASE.plural)


def test_the_derivation_finds_what_the_operator_does() -> None:
    """The derived allowlist is not empty or trivially wide: a few facts any reader can check."""
    assert ("apps", "statefulsets", "create") in NEEDED and ("apps", "statefulsets", "delete") in NEEDED
    assert ("", "secrets", "list") in NEEDED and ("", "secrets", "get") in NEEDED
    assert ("kvfleet.io", "tenants/status", "patch") in NEEDED
    assert ("kvfleet.io", "modeldeployments", "patch") in NEEDED  # kopf's finalizer
    never = {"update", "deletecollection", "escalate", "bind", "impersonate"}
    assert not {g for g in NEEDED if g[2] in never and g[:2] != LEASES}
    assert {g for g in NEEDED if g[:2] == LEASES} == {(*LEASES, v) for v in ("get", "create", "update")}
    assert not {g for g in NEEDED if g[:2] == ("kvfleet.io", "tenants") and g[2] not in {"list", "watch"}}
    assert not {g for g in NEEDED if g[1] in {"serviceaccounts", "namespaces"}}
    # Pods: listed, to read the engines' KV capacity on their metrics port, and deleted (an engine pod stuck
    # Terminating on a lost node, reconcile/node_loss.py); never created or changed.
    assert {g for g in NEEDED if g[1] == "pods"} == {("", "pods", "list"), ("", "pods", "delete")}
    assert {g for g in NEEDED if g[1] == "nodes"} == {NODES_LIST}  # read only, for NoMatchingNodes


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
    "exposure": ("--set", "rbac.ingress=true", "--set", "rbac.httpRoute=true"),
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
        pytest.param(SCOPES["exposure"], EXPOSURE, "Ingress,HTTPRoute", id="both"),
    ],
)
def test_exposure_rights_only_when_enabled_and_the_operator_is_told(
    args: tuple[str, ...], granted: set[tuple[str, str]], env: str
) -> None:
    """Least privilege: no right on Ingresses or HTTPRoutes unless the chart value asks; the operator
    learns which it may manage from KVFLEET_EXPOSURE_KINDS (it never lists a kind it has no right to), and
    nothing watches them (the verbs are list, create, patch, delete)."""
    docs = _render(*args)
    for role in _roles(docs):
        assert {g[:2] for g in _grants(role)} & EXPOSURE == (
            granted if role["metadata"]["name"] == "kvfleet" else set()
        )
    role = next(r for r in _roles(docs) if r["metadata"]["name"] == "kvfleet")
    for resource in granted:
        assert {g[2] for g in _grants(role) if g[:2] == resource} == {"list", "create", "patch", "delete"}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    environment = {
        e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert environment["KVFLEET_EXPOSURE_KINDS"] == env
    assert [k.kind for k in kinds.parse_exposure_kinds(env)] == [k for k in env.split(",") if k]


def test_without_monitoring_rbac_no_monitor_rights() -> None:
    for role in _roles(_render(*SCOPES["no-monitoring"])):
        assert not {g[:2] for g in _grants(role)} & MONITORING


def test_secrets_are_only_ever_listed_through_a_label_selector() -> None:
    """RBAC cannot limit a list by label; the operator's code does: every list that can return Secrets
    (``kinds.SECRET`` or a kind variable over the children) passes a label selector."""
    lists = [call for method, call in _operator_calls() if method == "list"]
    secret_lists = [c for c in lists if _kind_named(c.args[0]) in (None, kinds.SECRET)]
    assert secret_lists, "no list that can return Secrets found: the derivation needs updating"
    for call in secret_lists:
        assert any(k.arg == "label_selector" for k in call.keywords), ast.unparse(call)
