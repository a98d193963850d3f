"""Small helpers shared by the cluster smoke tests (namespaces, waiting, CRD installation).

A test's namespace comes from :func:`scratch_namespace` (created on the session's real API server under a
unique name, deleted afterwards); tests/operator_support.py's ``tiny_namespace`` and tests/cluster/
operators.py's ``prepared_namespace`` fill one with the examples. Modules keep a thin ``namespace``
fixture of their own where the scope, the name prefix or what goes in differs.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from devcluster import ControlPlane, find_binary

from components import missing_component

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"
FIELD_MANAGER = "kvfleet-cluster-tests"


def wait_for(check: Callable[[], Any], *, timeout: float = 60.0, what: str, interval: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy (returned); fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def create_namespace(plane: ControlPlane, prefix: str, labels: dict[str, str] | None = None) -> str:
    """A fresh namespace; in the full tier also waits for its ``default`` service account."""
    name = unique_name(prefix)
    status, body = plane.request(
        "POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}}
    )
    assert status == 201, body
    if plane.tier == "full":
        wait_for(
            lambda: plane.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200,
            what=f"service account default in {name}",
        )
    return name


def delete_namespace(plane: ControlPlane, name: str, *, wait: bool = False) -> None:
    """Delete ``name``; with ``wait``, until it is gone (its pods released their GPUs for the next test)."""
    plane.request("DELETE", f"/api/v1/namespaces/{name}")
    if wait:
        wait_for(
            lambda: plane.request("GET", f"/api/v1/namespaces/{name}")[0] == 404,
            timeout=120,
            what=f"namespace {name} deleted",
        )


@contextmanager
def scratch_namespace(
    plane: ControlPlane,
    prefix: str,
    labels: dict[str, str] | None = None,
    *,
    crds: bool = False,
    wait: bool = False,
) -> Iterator[str]:
    """A fresh namespace (:func:`create_namespace`) for the ``with`` block, deleted when it ends however it
    ends (:func:`delete_namespace`; ``wait``: until it is gone). ``crds``: kvfleet's CRDs applied first
    (:func:`apply_crds`). In a fixture: ``with scratch_namespace(plane, "x") as ns: yield ns``."""
    if crds:
        apply_crds(plane)
    name = create_namespace(plane, prefix, labels)
    try:
        yield name
    finally:
        delete_namespace(plane, name, wait=wait)


def crd_files() -> list[Path]:
    return sorted(p for p in CRD_DIR.glob("*.yaml") if p.is_file())


def iter_crd_documents() -> Iterator[dict[str, Any]]:
    for path in crd_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                yield doc


def apply_crds(plane: ControlPlane) -> list[str]:
    """Server-side apply every CRD in crds/ exactly as written; returns their names once Established and
    their resources are served."""
    names = []
    for doc in iter_crd_documents():
        name = doc["metadata"]["name"]
        status, body = plane.request(
            "PATCH",
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            f"?fieldManager={FIELD_MANAGER}&force=true&fieldValidation=Strict",
            doc,
            content_type="application/apply-patch+yaml",
        )
        assert status in (200, 201), f"CRD {name} rejected ({status}): {body}"
        names.append(name)
    for name in names:
        wait_for(lambda name=name: crd_established(plane, name), what=f"CRD {name} Established")
    # A CRD just (re)applied answers 429 "storage is (re)initializing" for a moment after Established.
    for doc in iter_crd_documents():
        group, plural = doc["spec"]["group"], doc["spec"]["names"]["plural"]
        served = [v["name"] for v in doc["spec"]["versions"] if v.get("served")]
        for version in served:
            path = f"/apis/{group}/{version}/{plural}?limit=1"
            wait_for(lambda path=path: plane.request("GET", path)[0] == 200, what=f"{path} served")
    return names


def crd_established(plane: ControlPlane, name: str) -> bool:
    status, body = plane.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    if status != 200:
        return False
    # A CRD the API server has only just stored has ``status: {}`` or ``conditions: null``: not yet.
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def cel_messages() -> set[str]:
    """Every ``message`` of an ``x-kubernetes-validations`` rule in crds/."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []) or []:
                if "message" in rule:
                    found.add(rule["message"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for doc in iter_crd_documents():
        walk(doc)
    return found


def plural_path(doc_kind: str, namespace: str) -> str:
    plural = {"Tenant": "tenants", "ModelDeployment": "modeldeployments"}[doc_kind]
    return f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/{plural}"


def pinned_kubernetes_version() -> str:
    """The K8S_VERSION pinned in hack/build-cluster.sh."""
    text = (REPO / "hack" / "build-cluster.sh").read_text()
    match = re.search(r"^K8S_VERSION=(v[0-9.]+)$", text, re.MULTILINE)
    assert match, "K8S_VERSION not found in hack/build-cluster.sh"
    return match.group(1)


def run_tool(
    plane: ControlPlane, name: str, *args: str, stdin: str | None = None, timeout: float = 180
) -> str:
    """Run a provisioned tool (``kubectl``, ``helm``) against ``plane`` and return its output; a failure
    fails the test with the tool's output, a missing tool names the command that provisions it."""
    path = find_binary(name)
    if path is None:
        missing_component(name, "hack/build-cluster.sh")
    done = subprocess.run(
        [str(path), *args],
        env=plane.env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
