"""RBAC least privilege, the code side: the allowlist the chart is held to is derived from the operator's
code (tests/rbac_allowlist.py: its KubeClient calls and kopf's registry), never copied by hand. Checked here:
every KubeClient method that sends a request says which verbs it needs, the derivation finds what the
operator does and nothing trivially wide, and Secrets are only ever listed through a label selector.

The chart's rendered rules against that allowlist (helm template): tests/tools/test_rbac_chart.py.
"""

from __future__ import annotations

import ast
import inspect

from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import KubeClient
from rbac_allowlist import CLIENT_VERBS, LEASES, NEEDED, NODES_LIST, kind_named, operator_calls


def test_every_client_request_method_has_its_verbs() -> None:
    """A new KubeClient method must say which verbs it needs before the allowlist can be trusted."""
    methods = {
        name
        for name, fn in inspect.getmembers(KubeClient, inspect.iscoroutinefunction)
        + inspect.getmembers(KubeClient, inspect.isasyncgenfunction)
        if not name.startswith("_")
        and any(call in inspect.getsource(fn) for call in ("self._request(", "self._session."))
    }
    assert methods == set(CLIENT_VERBS)


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


def test_secrets_are_only_ever_listed_through_a_label_selector() -> None:
    """RBAC cannot limit a list by label; the operator's code does: every list that can return Secrets
    (``kinds.SECRET`` or a kind variable over the children) passes a label selector."""
    lists = [call for method, call in operator_calls() if method in ("list", "list_versioned", "watch")]
    secret_lists = [c for c in lists if kind_named(c.args[0]) in (None, kinds.SECRET)]
    assert secret_lists, "no list that can return Secrets found: the derivation needs updating"
    for call in secret_lists:
        assert any(k.arg == "label_selector" for k in call.keywords), ast.unparse(call)
