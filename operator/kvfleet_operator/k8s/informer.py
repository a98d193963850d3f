"""Watch-fed copies of the objects every reconcile reads (Kubernetes' informer pattern).

Each reconcile of a ModelDeployment needs the namespace's Tenants (its own, and every uid for ownership)
and the Secrets marked as tenant keys. Listing them per reconcile costs the API server and the operator
a full LIST each time: at 10,000 tenants and 50 ModelDeployments that is most of the work. An
:class:`Informer` lists once, then watches from the list's ``resourceVersion``, and keeps the objects
(without ``managedFields``, which nobody here reads); a reconcile reads the copy. The copy is as fresh as
the watch, like controller-runtime's cache: the reconcile is level-triggered, and every change that
reaches the copy also triggers a reconcile (``on_change``), so a stale read is corrected by the next one.
The operator's own writes go into the copy as the API server answered them (:meth:`Informer.observe`),
so a reconcile right after a write does not decide again on what it already wrote.

A watch that ends is resumed from the last ``resourceVersion`` seen (bookmarks included); one the API
server no longer can resume (``410 Gone``) is replaced by a fresh list, and whatever changed meanwhile is
reported to ``on_change``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from kvfleet_operator.k8s.client import ApiError, KubeClient
from kvfleet_operator.k8s.kinds import SECRET, Kind

log = logging.getLogger(__name__)

Obj = dict[str, Any]
#: Called with the object before and after a change (``None``: it did not exist / no longer does).
OnChange = Callable[[Obj | None, Obj | None], None]

#: How long one watch request lasts before it is resumed (the API server's ``timeoutSeconds``).
WATCH_SECONDS = 300
#: Objects per page of the initial list (a list of 10,000 Tenants in one answer is tens of MiB of text).
LIST_PAGE = 500
#: Pause after a failed list or watch before the next try.
RETRY_SECONDS = 1.0


def slim(obj: Obj) -> Obj:
    """``obj`` without ``metadata.managedFields`` (the larger part of a small object, read by nobody)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return obj


def _version(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion") or "")


def is_newer(candidate: Obj, current: Obj | None) -> bool:
    """Whether ``candidate`` is a later version than ``current``. ``resourceVersion`` is opaque by contract
    but an etcd revision in practice: compared as a number when both are, else the candidate wins."""
    if current is None:
        return True
    new = str(candidate.get("metadata", {}).get("resourceVersion") or "")
    old = str(current.get("metadata", {}).get("resourceVersion") or "")
    if new.isdigit() and old.isdigit():
        return int(new) >= int(old)
    return True


class Informer:
    """The objects of ``kind`` in ``namespaces`` (``None``: all namespaces), optionally label-selected."""

    def __init__(
        self,
        client: KubeClient,
        kind: Kind,
        namespaces: Sequence[str | None],
        *,
        label_selector: str | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        if kind == SECRET and not label_selector:
            raise ValueError("Secrets are only ever read through a label selector")
        self.client = client
        self.kind = kind
        self.namespaces = tuple(namespaces) or (None,)
        self.label_selector = label_selector
        self.on_change = on_change
        #: namespace -> name -> object.
        self._objects: dict[str, dict[str, Obj]] = {}
        self._synced: dict[str | None, asyncio.Event] = {ns: asyncio.Event() for ns in self.namespaces}
        self._tasks: list[asyncio.Task[None]] = []
        #: :meth:`list` answers, by namespace (``None``: all), until the next change there.
        self._lists: dict[str | None, list[Obj]] = {}
        #: (namespace, name) -> the version that deleted it: an own write answered after the deletion was
        #: seen must not bring the object back.
        self._gone: dict[tuple[str, str], Obj] = {}

    def start(self) -> None:
        for namespace in self.namespaces:
            self._tasks.append(asyncio.create_task(self._run(namespace), name=f"informer-{self.kind.plural}"))

    async def wait_synced(self) -> None:
        """Until every namespace was listed once (a reconcile must never see half of a namespace)."""
        await asyncio.gather(*(e.wait() for e in self._synced.values()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def list(self, namespace: str | None = None) -> list[Obj]:
        """The objects of ``namespace`` (``None``: of all), in name order like a LIST answers. The same
        list until something there changes (every reconcile reads it: it is not sorted again each time);
        callers must not change it."""
        cached = self._lists.get(namespace)
        if cached is not None:
            return cached
        spaces = [namespace] if namespace is not None else sorted(self._objects)
        out: builtins.list[Obj] = []
        for ns in spaces:
            objects = self._objects.get(str(ns), {})
            out += [objects[name] for name in sorted(objects)]
        self._lists[namespace] = out
        return out

    def _changed(self, namespace: str) -> None:
        self._lists.pop(namespace, None)
        self._lists.pop(None, None)

    def get(self, namespace: str, name: str) -> Obj | None:
        return self._objects.get(namespace, {}).get(name)

    def observe(self, obj: Obj) -> None:
        """Put an object the API server just answered with (after a write) into the copy, unless the copy
        holds a later version already. No ``on_change``, and none when the write's own watch event comes:
        it finds that version held already (:meth:`_put`). The writer acted on what it wrote (a reconcile
        that created a tenant's key Secret serves the key at once), so its write is no news; a reconcile
        started by each of ten thousand key Secrets it created would only read the same again."""
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        if not name or not self._covers(namespace):
            return
        gone = self._gone.get((namespace, name))
        if gone is not None and not is_newer(obj, gone):
            return
        objects = self._objects.setdefault(namespace, {})
        if is_newer(obj, objects.get(name)):
            obj.setdefault("apiVersion", self.kind.api_version)
            obj.setdefault("kind", self.kind.kind)
            objects[name] = slim(obj)
            self._changed(namespace)

    def _covers(self, namespace: str) -> bool:
        return None in self.namespaces or namespace in self.namespaces

    def _put(self, obj: Obj) -> None:
        obj.setdefault("apiVersion", self.kind.api_version)
        obj.setdefault("kind", self.kind.kind)
        meta = obj["metadata"]
        objects = self._objects.setdefault(str(meta.get("namespace") or ""), {})
        old = objects.get(str(meta["name"]))
        if old is not None and _version(old) and _version(old) == _version(obj):
            return  # that very version is held: an own write observed first, or nothing changed
        if not is_newer(obj, old):
            return  # the copy holds a later version already (an own write observed first)
        objects[str(meta["name"])] = slim(obj)
        self._changed(str(meta.get("namespace") or ""))
        self._notify(old, obj)

    def _drop(self, obj: Obj) -> None:
        meta = obj["metadata"]
        if len(self._gone) > 10_000:
            self._gone.clear()  # a bound: only writes in flight at the deletion need the mark
        self._gone[(str(meta.get("namespace") or ""), str(meta["name"]))] = {"metadata": dict(meta)}
        old = self._objects.get(str(meta.get("namespace") or ""), {}).pop(str(meta["name"]), None)
        self._changed(str(meta.get("namespace") or ""))
        if old is not None:
            self._notify(old, None)

    def _notify(self, old: Obj | None, new: Obj | None) -> None:
        if self.on_change is None or not self._all_synced():
            return
        try:
            self.on_change(old, new)
        except Exception:
            log.exception("%s informer: change handler failed", self.kind.plural)

    def _all_synced(self) -> bool:
        return all(e.is_set() for e in self._synced.values())

    def _replace(self, namespace: str | None, items: builtins.list[Obj]) -> None:
        """A fresh list of ``namespace``: what is gone is dropped, what is new or newer put."""
        listed = {(str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"])) for o in items}
        spaces = [namespace] if namespace is not None else list(self._objects)
        for ns in spaces:
            for name in [n for n in self._objects.get(str(ns), {}) if (str(ns), n) not in listed]:
                self._drop(self._objects[str(ns)][name])
        for item in items:
            self._put(item)

    async def _run(self, namespace: str | None) -> None:
        while True:
            try:
                items, version = await self.client.list_versioned(
                    self.kind, namespace, label_selector=self.label_selector, page=LIST_PAGE
                )
                self._replace(namespace, items)
                self._synced[namespace].set()
                await self._watch(namespace, version)
            except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # The copy must outlive a failed request or a broken stream: listed again, then watched.
                log.warning("%s informer (%s): %s; listing again", self.kind.plural, namespace or "*", exc)
                await asyncio.sleep(RETRY_SECONDS)

    async def _watch(self, namespace: str | None, version: str) -> None:
        """Watch from ``version`` until the API server can no longer resume it (return: list again)."""
        while True:
            async for event in self.client.watch(
                self.kind,
                namespace,
                label_selector=self.label_selector,
                resource_version=version,
                timeout_seconds=WATCH_SECONDS,
            ):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    if code == 410:
                        return  # too old: list again
                    raise ApiError(code, str(obj.get("reason")), str(obj.get("message")))
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED"):
                    self._put(obj)
                elif kind == "DELETED":
                    self._drop(obj)
