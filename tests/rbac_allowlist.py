"""The RBAC allowlist derived from the operator's code, never copied by hand (no tests here); the unit
tests check the derivation (tests/unit/test_rbac.py), the tools tests the chart's rendered rules against it
(tests/tools/test_rbac_chart.py).

* every call of the operator's ``KubeClient`` in ``operator/kvfleet_operator`` (read from the source), the
  kind it names (``kinds.X``; a kind held in a variable ranges over ``kinds.CHILD_KINDS``, and a status
  write over the kinds ``StatusWrite`` is built with), and the RBAC verbs that client method needs
  (:data:`CLIENT_VERBS`; server-side apply that creates is authorized as ``create``);
* what kopf does for the handlers the operator registers (its registry): list and watch every resource
  it watches, patch the resources it keeps a finalizer on, create Events.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kopf

from kvfleet_operator.handlers import kopf_handlers  # noqa: F401 - registers the handlers with kopf
from kvfleet_operator.k8s import kinds

OPERATOR = Path(__file__).resolve().parents[1] / "operator" / "kvfleet_operator"

Grant = tuple[str, str, str]  # (API group, resource, verb)

#: The RBAC verbs each KubeClient method needs. ``None``: the method sends no resource request
#: (discovery is open to every authenticated user).
CLIENT_VERBS: dict[str, frozenset[str] | None] = {
    "get": frozenset({"get"}),
    "list": frozenset({"list"}),
    "list_versioned": frozenset({"list"}),
    "watch": frozenset({"watch"}),
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


def kind_named(node: ast.expr) -> kinds.Kind | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kinds":
        kind = getattr(kinds, node.attr)
        assert isinstance(kind, kinds.Kind)
        return kind
    return None


#: The module whose calls name their kind in a variable that ranges over ``kinds.INFORMED_KINDS`` (its
#: watch-fed copies), not over the children.
INFORMER = OPERATOR / "k8s" / "informer.py"


def kinds_of_variable(path: Path) -> tuple[kinds.Kind, ...]:
    """What a kind held in a variable ranges over in the module at ``path``."""
    return kinds.INFORMED_KINDS if path == INFORMER else kinds.CHILD_KINDS


def operator_calls() -> Iterator[tuple[str, ast.Call]]:
    """Every ``<...>client.<method>(...)`` call of a KubeClient method in the operator package."""
    for _path, method, call in operator_calls_by_module():
        yield method, call


def operator_calls_by_module() -> Iterator[tuple[Path, str, ast.Call]]:
    """:func:`operator_calls`, each with the module it is in."""
    for path in sorted(OPERATOR.rglob("*.py")):
        if path.parent.name == "k8s" and path.name == "client.py":
            continue  # the client itself; k8s/leader.py's Lease calls count
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
            if name == "client" and node.func.attr in CLIENT_VERBS:
                yield path, node.func.attr, node


def status_kinds() -> set[kinds.Kind]:
    found = set()
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StatusWrite" and node.args:
                kind = kind_named(node.args[0])
                if kind is not None:
                    found.add(kind)
    assert found, "no StatusWrite(kinds.X, ...) found: the derivation needs updating"
    return found


def resource_of(kind: kinds.Kind, sub: str = "") -> tuple[str, str]:
    return kind.group, kind.plural + sub


def code_grants() -> set[Grant]:
    grants: set[Grant] = set()
    for path, method, call in operator_calls_by_module():
        verbs = CLIENT_VERBS[method]
        if verbs is None:
            continue
        if method == "create_event":
            targets = [(kinds.EVENT.group, kinds.EVENT.plural)]
        elif method == "apply_status":
            named = kind_named(call.args[0])
            targets = [resource_of(k, "/status") for k in ([named] if named else status_kinds())]
        else:
            named = kind_named(call.args[0])
            targets = [resource_of(k) for k in ([named] if named else kinds_of_variable(path))]
        grants |= {(group, resource, verb) for group, resource in targets for verb in verbs}
    return grants


def kopf_grants() -> set[Grant]:
    registry = kopf.get_default_registry()
    grants: set[Grant] = {(kinds.EVENT.group, kinds.EVENT.plural, "create")}  # kopf posts Events
    for handler in [*registry._watching.get_all_handlers(), *registry._spawning.get_all_handlers()]:
        grants |= {(handler.selector.group or "", handler.selector.plural, v) for v in ("list", "watch")}
    for handler in registry._changing.get_all_handlers():  # kopf keeps a finalizer on these
        resource = (handler.selector.group or "", handler.selector.plural)
        grants |= {(*resource, verb) for verb in ("list", "watch", "patch")}
    return grants


#: Everything the operator's code and kopf need: in the namespaces it watches, and its Lease.
NEEDED: frozenset[Grant] = frozenset(code_grants() | kopf_grants())
MONITORING = {(k.group, k.plural) for k in (kinds.SERVICE_MONITOR, kinds.POD_MONITOR)}
#: Ingresses, HTTPRoutes and InferencePools: granted only when the chart asks (rbac.ingress, rbac.httpRoute,
#: rbac.inferencePool; off by default).
EXPOSURE = {(k.group, k.plural) for k in kinds.EXPOSURE_KINDS}
#: The one cluster-scoped grant: listing nodes (rbac.readNodes), in its own ClusterRole; a namespaced Role
#: cannot grant it, so the watched namespaces' Roles are not asked for it.
NODES_LIST: Grant = (kinds.NODE.group, kinds.NODE.plural, "list")
READ_NODES = "kvfleet-read-nodes"
#: Leader election's Lease lives in the release namespace only, never in a watched one.
LEASES = (kinds.LEASE.group, kinds.LEASE.plural)
