"""Tenant status writes, batched: the newest status of each Tenant, written by a few workers at once.

A reconcile of a ModelDeployment with hundreds of tenants computes hundreds of statuses. Written one
after another inside the reconcile, they hold its lock (and every trigger of it, a tenant's edit
included) for hundreds of round trips; and when the ModelDeployment's pool starts with its tenants,
every tenant is written twice, first waiting for the pool, then ``Ready`` a few seconds later. The
operator's reconciles hand the tenants' statuses here instead (``OperatorConfig.status_writer``):

* the newest status of a tenant wins: one computed while an older one waits replaces it, and one equal
  to what the tenant already has cancels what waits (it would undo it);
* a status that only says the tenant waits for its pool (:func:`status.is_waiting_for_pool`) is held up to
  ``hold_seconds``: a pool that starts with its tenants is usually ready by then, and the tenant's status
  is written once, ``Ready``; a pool that takes longer gets the waiting status written when the hold
  ends. Any other status (``Ready``, a refusal, a problem) is written at once, so an edit's outcome or a
  problem is never held back;
* the Events are those of the status the tenant had to the status written (``status.compute_events``);
  a tenant's news of its pool goes into one Event per ModelDeployment per batch
  (``status.compute_tenant_summary_events``).

The write is the same server-side apply the reconcile makes; the reconcile stays level-triggered: a write
that fails is dropped, and the next reconcile (a watched change or the resync timer) computes it again.
A reconcile run on its own (tests, tools) writes its statuses itself, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfleet_operator.k8s.client import ApiError, KubeClient
from kvfleet_operator.k8s.informer import is_newer
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.conditions import now_rfc3339, rebase_conditions

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]

#: Default hold of a status that only says the tenant waits for its pool (``KVFLEET_STATUS_HOLD_SECONDS``).
HOLD_SECONDS = 10.0
#: Writes in flight at once.
WORKERS = 16
#: Statuses written per batch (one summary Event per ModelDeployment per batch).
BATCH = 512


@dataclass
class _Pending:
    write: st.StatusWrite
    #: The tenant's ModelDeployment as the reconcile read it: the summary Events go on it.
    raw_md: Obj | None
    #: When it may be written (``time.monotonic``).
    due: float


class StatusWriter:
    """Writes the Tenant statuses the reconciles hand it (:meth:`submit`); :meth:`start` it in the
    operator's event loop and :meth:`stop` it before the client closes."""

    def __init__(
        self,
        client: KubeClient,
        observe: Callable[[Obj], None],
        current: Callable[[str, str], Obj | None],
        *,
        hold_seconds: float = HOLD_SECONDS,
        workers: int = WORKERS,
    ) -> None:
        self.client = client
        #: Called with each object the API server answered a write with (the watch-fed copies).
        self.observe = observe
        #: The tenant as the copy holds it now (``namespace``, ``name``), to compare with.
        self.current = current
        self.hold_seconds = hold_seconds
        self._pending: dict[Key, _Pending] = {}
        #: Statuses taken to be written (waiting for a slot or sent): one computed again meanwhile (from a
        #: copy that does not show it yet) is compared with it, not written twice.
        self._in_flight: dict[Key, Obj] = {}
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(workers)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="status-writer")

    async def stop(self) -> None:
        """Stop writing; what waits is dropped (the next leader's reconciles compute it again)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, write: st.StatusWrite, raw_md: Obj | None) -> None:
        """The status a reconcile computed for a tenant (changed or not: an unchanged one cancels an
        older status that waits).

        The reconcile read the tenant a while ago: a status written since (being written now, or already
        in the copy) is what it is compared with, its conditions' transition times kept where their status
        did not flip. So two reconciles that read the tenant before either wrote write it once."""
        meta = write.raw["metadata"]
        key = (str(meta.get("namespace") or ""), str(meta["name"]))
        base = self._in_flight.get(key)
        if base is None:
            current = self.current(key[0], key[1])
            newer = current is not None and is_newer(current, write.raw) and current is not write.raw
            base = (current or {}).get("status") if newer else write.raw.get("status")
        status = {
            **write.status,
            "conditions": rebase_conditions(
                write.status.get("conditions") or [], (base or {}).get("conditions")
            ),
        }
        write = st.StatusWrite(write.kind, {**write.raw, "status": base}, status)
        if not write.changed:
            self._pending.pop(key, None)
            return
        now = time.monotonic()
        held = st.is_waiting_for_pool(write.status)
        due = now + self.hold_seconds if held else now
        previous = self._pending.get(key)
        if previous is not None and held:
            due = min(due, previous.due)  # repeated reconciles never extend a hold
        self._pending[key] = _Pending(write, raw_md, due)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            due = [key for key, p in self._pending.items() if p.due <= now][:BATCH]
            if not due:
                self._wake.clear()
                wait = min((p.due for p in self._pending.values()), default=now + 3600) - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(wait, 0.0))
                continue
            batch = [(key, self._pending.pop(key)) for key in due]
            for key, pending in batch:  # in flight from now on: waiting for a slot counts
                self._in_flight[key] = pending.write.status
            told = await asyncio.gather(*(self._write(key, p) for key, p in batch))
            await self._summarize([(p, events) for (_key, p), events in zip(batch, told, strict=True)])

    async def _create_event(self, namespace: str, event: Obj) -> None:
        try:
            await self.client.create_event(namespace, event)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:  # an Event is worth no retry
            log.warning("event %s in %s not written: %s", event.get("reason"), namespace, exc)

    async def _write(self, key: Key, pending: _Pending) -> list[Obj]:
        """Write one status and its tenant's own Events; returns its Events of its pool (for the
        summary)."""
        write = pending.write
        meta = write.raw["metadata"]
        async with self._slots:
            try:
                answer = await self.client.apply_status(write.kind, key[1], key[0], write.status)
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                # Dropped: the next reconcile computes it again. Deleted meanwhile: nothing to report on.
                if not (isinstance(exc, ApiError) and exc.not_found):
                    log.warning("status of %s/%s not written: %s", key[0], key[1], exc)
                return []
            finally:
                self._in_flight.pop(key, None)
            self.observe(answer)
            told: list[Obj] = []
            before = (write.raw.get("status") or {}).get("conditions")
            for event in st.compute_events(write.raw, before, write.status.get("conditions")):
                if pending.raw_md is not None and st.told_on_model_deployment(event):
                    told.append(event)
                else:
                    await self._create_event(str(meta.get("namespace")), event)
            return told

    async def _summarize(self, written: list[tuple[_Pending, list[Obj]]]) -> None:
        by_md: dict[str, tuple[Obj, list[Obj]]] = {}
        for pending, events in written:
            if events and pending.raw_md is not None:
                uid = str(pending.raw_md["metadata"].get("uid") or pending.raw_md["metadata"]["name"])
                by_md.setdefault(uid, (pending.raw_md, []))[1].extend(events)
        now = now_rfc3339()
        for raw_md, events in by_md.values():
            for event in st.compute_tenant_summary_events(raw_md, events, now):
                await self._create_event(str(raw_md["metadata"].get("namespace")), event)
