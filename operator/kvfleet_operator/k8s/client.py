"""The only place the operator talks to the Kubernetes API.

A small async client on aiohttp (the operator's event loop is kopf's; the official ``kubernetes`` client
would block it). It knows the handful of kinds the operator manages (``kinds.py``), speaks server-side
apply with one field manager, and counts every call by verb so tests can assert that a converged
reconcile mutates nothing.
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import ssl
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import yaml

from kvfleet_operator.k8s.kinds import EVENT, Kind

FIELD_MANAGER = "kvfleet-operator"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MUTATING_VERBS = frozenset({"apply", "create", "delete", "patch", "update", "patch_status"})

Obj = dict[str, Any]


class ApiError(Exception):
    """A non-success answer from the API server, with its status code and ``Status`` message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def invalid(self) -> bool:
        return self.status == 422


@dataclass(frozen=True)
class Credentials:
    """How to reach and authenticate to one API server."""

    server: str
    ca_data: bytes | None = None
    token: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    insecure: bool = False

    @classmethod
    def from_kubeconfig(cls, path: Path, context: str | None = None) -> Self:
        config = yaml.safe_load(path.read_text()) or {}
        name = context or config.get("current-context")
        contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
        if name not in contexts:
            raise ValueError(f"kubeconfig {path}: context {name!r} not found")
        ctx = contexts[name]
        cluster = {c["name"]: c["cluster"] for c in config.get("clusters", [])}[ctx["cluster"]]
        user = {u["name"]: u.get("user") or {} for u in config.get("users", [])}[ctx["user"]]
        base = path.parent

        def _blob(data_key: str, path_key: str, section: dict[str, Any]) -> bytes | None:
            if section.get(data_key):
                return base64.b64decode(section[data_key])
            if section.get(path_key):
                return (base / str(section[path_key])).read_bytes()
            return None

        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = (base / user["tokenFile"]).read_text().strip()
        return cls(
            server=cluster["server"].rstrip("/"),
            ca_data=_blob("certificate-authority-data", "certificate-authority", cluster),
            token=token,
            cert_data=_blob("client-certificate-data", "client-certificate", user),
            key_data=_blob("client-key-data", "client-key", user),
            insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        )

    @classmethod
    def in_cluster(cls) -> Self:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(
            server=f"https://{host}:{port}",
            ca_data=(SERVICE_ACCOUNT_DIR / "ca.crt").read_bytes(),
            token=(SERVICE_ACCOUNT_DIR / "token").read_text().strip(),
        )

    @classmethod
    def discover(cls) -> Self:
        """``$KUBECONFIG``, then the in-cluster service account, then ``~/.kube/config``."""
        if os.environ.get("KUBECONFIG"):
            return cls.from_kubeconfig(Path(os.environ["KUBECONFIG"].split(os.pathsep)[0]))
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.in_cluster()
        return cls.from_kubeconfig(Path.home() / ".kube" / "config")

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context()
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif self.ca_data:
            ctx.load_verify_locations(cadata=self.ca_data.decode())
        if self.cert_data and self.key_data:
            # ssl only loads client certificates from files; keep them private and short-lived.
            with tempfile.TemporaryDirectory() as tmp:
                cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
                cert.write_bytes(self.cert_data)
                key.write_bytes(self.key_data)
                ctx.load_cert_chain(cert, key)
        return ctx


def _typed_items(payload: Obj, kind: Kind) -> list[Obj]:
    items: list[Obj] = payload.get("items", [])
    for item in items:  # list items carry no apiVersion/kind; restore them for uniform handling
        item.setdefault("apiVersion", kind.api_version)
        item.setdefault("kind", kind.kind)
    return items


@dataclass
class KubeClient:
    """Async CRUD + server-side apply for the kinds in ``kinds.py``. Use as an async context manager."""

    credentials: Credentials
    calls: Counter[str] = field(default_factory=Counter)
    #: Called with the verb of every call (the operator feeds its api_calls metric from here).
    observer: Callable[[str], None] | None = None
    #: ``User-Agent`` of every request; the API server's audit log tells operator replicas apart by it.
    user_agent: str | None = None
    _session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        headers = {"Accept": "application/json"}
        if self.credentials.token:
            headers["Authorization"] = f"Bearer {self.credentials.token}"
        if self.user_agent:
            headers["User-Agent"] = self.user_agent
        connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context(), limit=64)
        self._session = aiohttp.ClientSession(
            self.credentials.server, headers=headers, connector=connector, timeout=aiohttp.ClientTimeout(30)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def mutating_calls(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb in MUTATING_VERBS)

    async def _request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        body: Obj | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        if self._session is None:
            raise RuntimeError("KubeClient used outside 'async with'")
        self.calls[verb] += 1
        if self.observer is not None:
            self.observer(verb)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else None
        async with self._session.request(method, path, data=data, params=params, headers=headers) as resp:
            text = await resp.text()
            # Errors outside the API machinery (e.g. 404 for an unserved group) are plain text.
            payload: Obj = json.loads(text) if text and resp.content_type == "application/json" else {}
            if resp.status >= 400:
                reason = str(payload.get("reason", resp.reason))
                raise ApiError(resp.status, reason, str(payload.get("message", text)))
            return payload

    async def get(self, kind: Kind, name: str, namespace: str | None = None) -> Obj | None:
        """The object, or ``None`` when it does not exist."""
        try:
            return await self._request("get", "GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list(
        self, kind: Kind, namespace: str | None = None, label_selector: str | None = None
    ) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        payload = await self._request("list", "GET", kind.path(namespace), params=params)
        return _typed_items(payload, kind)

    async def list_versioned(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        page: int | None = None,
    ) -> tuple[builtins.list[Obj], str]:
        """The objects and the list's ``resourceVersion`` (where a watch of them starts); with ``page``, in
        pages of that many (one consistent snapshot), so that a large list never sits in memory twice as
        text and objects."""
        params = {"labelSelector": label_selector} if label_selector else {}
        if page is not None:
            params["limit"] = str(page)
        items: builtins.list[Obj] = []
        version = ""
        while True:
            payload = await self._request("list", "GET", kind.path(namespace), params=params or None)
            items += _typed_items(payload, kind)
            meta = payload.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "")
            if not meta.get("continue"):
                return items, version
            params["continue"] = str(meta["continue"])

    async def watch(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        resource_version: str,
        timeout_seconds: int,
    ) -> AsyncIterator[Obj]:
        """The watch events (``{"type": ..., "object": ...}``) of ``kind`` from ``resource_version`` on, with
        bookmarks, until the API server ends the watch (after ``timeout_seconds``)."""
        if self._session is None:
            raise RuntimeError("KubeClient used outside 'async with'")
        self.calls["watch"] += 1
        if self.observer is not None:
            self.observer("watch")
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
        } | ({"labelSelector": label_selector} if label_selector else {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_seconds + 30)
        async with self._session.get(kind.path(namespace), params=params, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                raise ApiError(resp.status, str(resp.reason), text)
            pending = b""
            async for chunk in resp.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    async def apply(self, kind: Kind, obj: Obj, *, force: bool = True) -> Obj:
        """Server-side apply ``obj`` with the operator's field manager."""
        meta = obj["metadata"]
        return await self._request(
            "apply",
            "PATCH",
            kind.path(meta.get("namespace"), meta["name"]),
            body=obj,
            params={"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"},
            content_type="application/apply-patch+yaml",
        )

    async def apply_status(self, kind: Kind, name: str, namespace: str | None, status: Obj) -> Obj:
        """Server-side apply of the status subresource (only the fields given)."""
        body = {
            "apiVersion": kind.api_version,
            "kind": kind.kind,
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "status": status,
        }
        return await self._request(
            "patch_status",
            "PATCH",
            kind.path(namespace, name) + "/status",
            body=body,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def create(self, kind: Kind, obj: Obj) -> Obj:
        """Create ``obj`` (POST); ``ApiError.conflict`` when it exists already."""
        return await self._request("create", "POST", kind.path(obj["metadata"].get("namespace")), body=obj)

    async def replace(self, kind: Kind, obj: Obj) -> Obj:
        """Replace ``obj`` (PUT): with ``metadata.resourceVersion`` set, ``ApiError.conflict`` when the
        object changed since it was read (optimistic concurrency)."""
        meta = obj["metadata"]
        return await self._request("update", "PUT", kind.path(meta.get("namespace"), meta["name"]), body=obj)

    async def merge_patch(self, kind: Kind, name: str, namespace: str | None, patch: Obj) -> Obj:
        return await self._request(
            "patch",
            "PATCH",
            kind.path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, kind: Kind, name: str, namespace: str | None = None) -> bool:
        """Delete with foreground-independent background propagation; ``False`` if it was already gone."""
        try:
            await self._request(
                "delete",
                "DELETE",
                kind.path(namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def force_delete(self, kind: Kind, name: str, namespace: str | None, uid: str) -> bool:
        """Delete at once (grace period 0) the object of that name only while its uid is ``uid``;
        ``False`` if it is gone or another object of the name replaced it (the precondition failed)."""
        try:
            await self._request(
                "delete",
                "DELETE",
                kind.path(namespace, name),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": uid},
                    "propagationPolicy": "Background",
                },
            )
        except ApiError as exc:
            if exc.not_found or exc.conflict:
                return False
            raise
        return True

    async def create_event(self, namespace: str, event: Obj) -> None:
        await self._request("create", "POST", EVENT.path(namespace), body=event)

    async def api_group_exists(self, group_version: str) -> bool:
        """Whether the server serves ``group/version`` (e.g. ``monitoring.coreos.com/v1``)."""
        try:
            await self._request("discovery", "GET", f"/apis/{group_version}")
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True
