"""Leader election on a ``coordination.k8s.io/v1`` Lease: only one operator replica writes at a time.

Why not kopf's peering: kopf's peering pauses an operator while a peer of higher priority runs, needs its
own cluster-wide CRD, and has no notion of a term; it is not leader election. This is client-go's
algorithm (``k8s.io/client-go/tools/leaderelection``), in two parts:

* the pure decision (:func:`observe`, :func:`decide`, :func:`build_lease`, :func:`build_released`,
  :func:`leadership_lost`): what to do given the Lease as read and the local monotonic clock;
* the shell (:class:`LeaderElector`): the Lease reads and writes, and a watchdog thread.

Safety rests on durations measured by each replica's own monotonic clock, never on comparing clocks:

* a standby takes the Lease over only after it has seen the same Lease record, unchanged, for the
  record's ``leaseDurationSeconds`` (``lease_duration``), or at once when the holder released it;
* the leader counts its deadline from the moment it *sent* its last successful renewal, which is before
  the server stored it and so before any standby saw it. When no renewal succeeded for
  ``renew_deadline`` (< ``lease_duration``), the leader stops writing: the watchdog ends the process
  (``os._exit``), which also stops kopf's own writes. So the old leader is gone at least
  ``lease_duration - renew_deadline`` before a standby can start.

Writes use the Lease's ``resourceVersion`` (optimistic concurrency): of two replicas that both decide to
take over, one gets ``409 Conflict`` and stays a standby.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Final

import aiohttp

from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import ApiError, KubeClient

log = logging.getLogger(__name__)

Obj = dict[str, Any]

#: Exit status of a leader that lost its Lease (Kubernetes restarts the container as a standby).
LOST_EXIT_CODE: Final = 3


@dataclass(frozen=True)
class LeaseTimings:
    """How long a Lease lasts, how long its holder may fail to renew before it stops, how often to try.

    ``lease_duration`` bounds the fail-over time after a leader dies (plus ``retry_period`` and the new
    leader's start-up); ``lease_duration - renew_deadline`` is the margin between the old leader stopping
    and a new one starting.
    """

    lease_duration: float = 8.0
    renew_deadline: float = 5.0
    #: How often the leader renews and a standby looks at the Lease.
    retry_period: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} < {self.renew_deadline} < {self.lease_duration}"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as the decision needs it."""

    holder: str
    lease_duration_seconds: int
    transitions: int
    acquire_time: str | None = None
    renew_time: str | None = None

    @classmethod
    def from_lease(cls, lease: Obj) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
        )


@dataclass(frozen=True)
class Observation:
    """The Lease as last read (``None``: it does not exist), its ``resourceVersion``, and the local
    monotonic time when this exact record was first seen."""

    record: LeaseRecord | None
    resource_version: str | None
    seen_at: float


class Decision(Enum):
    CREATE = "create"  # no Lease yet: create it, holding it
    TAKE_OVER = "take-over"  # expired or released: write it with us as holder (a new term)
    RENEW = "renew"  # we hold it: write a new renewTime
    WAIT = "wait"  # someone else holds it and it has not expired (for us)


def observe(previous: Observation | None, lease: Obj | None, now: float) -> Observation:
    """The observation after reading ``lease`` at ``now``: the expiry clock restarts whenever the record
    changes (a renewal by the holder changes ``renewTime``)."""
    record = None if lease is None else LeaseRecord.from_lease(lease)
    version = None if lease is None else str(lease["metadata"].get("resourceVersion") or "")
    if previous is not None and previous.record == record:
        return Observation(record, version, previous.seen_at)
    return Observation(record, version, now)


def decide(observation: Observation, identity: str, now: float) -> Decision:
    """What a replica called ``identity`` does next, given what it observed."""
    record = observation.record
    if record is None:
        return Decision.CREATE
    if record.holder == identity:
        return Decision.RENEW
    if not record.holder or now - observation.seen_at >= record.lease_duration_seconds:
        return Decision.TAKE_OVER
    return Decision.WAIT


def _micro_time(at: datetime) -> str:
    """The API's MicroTime format."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_lease(
    namespace: str,
    name: str,
    identity: str,
    decision: Decision,
    observation: Observation,
    timings: LeaseTimings,
    at: datetime,
) -> Obj:
    """The Lease to write for ``decision`` (not ``WAIT``), with the observed ``resourceVersion`` so that
    the write fails if anyone wrote in between."""
    if decision is Decision.WAIT:
        raise ValueError("nothing to write while waiting")
    record = observation.record
    stamp = _micro_time(at)
    transitions = 0 if record is None else record.transitions
    acquire = stamp
    if decision is Decision.TAKE_OVER:
        transitions += 1
    elif decision is Decision.RENEW and record is not None:
        acquire = record.acquire_time or stamp
    metadata: Obj = {"name": name, "namespace": namespace}
    if observation.resource_version:
        metadata["resourceVersion"] = observation.resource_version
    return {
        "apiVersion": kinds.LEASE.api_version,
        "kind": kinds.LEASE.kind,
        "metadata": metadata,
        "spec": {
            "holderIdentity": identity,
            # Whole seconds, rounded up: a standby never waits less than the holder's deadline allows for.
            "leaseDurationSeconds": int(-(-timings.lease_duration // 1)),
            "acquireTime": acquire,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        },
    }


def build_released(namespace: str, name: str, observation: Observation, at: datetime) -> Obj:
    """The Lease a leader writes when it steps down (client-go's ``ReleaseOnCancel``): no holder, so a
    standby takes it over at its next look instead of waiting for it to expire."""
    record = observation.record or LeaseRecord(holder="", lease_duration_seconds=1, transitions=0)
    stamp = _micro_time(at)
    return {
        "apiVersion": kinds.LEASE.api_version,
        "kind": kinds.LEASE.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            **({"resourceVersion": observation.resource_version} if observation.resource_version else {}),
        },
        "spec": {
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": record.transitions,
        },
    }


def leadership_lost(last_renewal_sent: float, now: float, timings: LeaseTimings) -> bool:
    """Whether a leader whose last successful renewal was sent at ``last_renewal_sent`` must stop."""
    return now - last_renewal_sent > timings.renew_deadline


# --- The shell: the Lease's reads and writes, and the watchdog. -----------------------------------------


class LeadershipLost(Exception):
    """Another replica holds the Lease now."""


_TRANSIENT = (ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


class LeaderElector:
    """Acquires the Lease ``namespace/name`` for ``identity`` and keeps it.

    ``await acquire()`` returns once this replica leads; then ``start_watchdog()`` and run
    ``keep()`` beside the work: it renews until cancelled, and calls ``on_lost`` (default: end the
    process with :data:`LOST_EXIT_CODE`) as soon as the Lease is lost or the renew deadline passes.
    ``release()`` steps down.
    """

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings | None = None,
        on_lost: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.namespace, self.name, self.identity = client, namespace, name, identity
        self.timings = timings or LeaseTimings()
        self.on_lost = on_lost or _exit_lost
        self.clock = clock
        self.observation: Observation | None = None
        #: Local monotonic time when the last successful write of the Lease was sent; ``None``: not leading.
        self.last_renewal_sent: float | None = None
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()

    @property
    def leading(self) -> bool:
        return self.last_renewal_sent is not None

    async def _try(self) -> Decision:
        """One look at the Lease, and the write it calls for. Returns what was decided; leading
        afterwards iff a CREATE, TAKE_OVER or RENEW write succeeded."""
        lease = await self.client.get(kinds.LEASE, self.name, self.namespace)
        now = self.clock()
        self.observation = observation = observe(self.observation, lease, now)
        decision = decide(observation, self.identity, now)
        if decision is Decision.WAIT:
            return decision
        body = build_lease(
            self.namespace, self.name, self.identity, decision, observation, self.timings, datetime.now(UTC)
        )
        sent = self.clock()
        try:
            if decision is Decision.CREATE:
                written = await self.client.create(kinds.LEASE, body)
            else:
                written = await self.client.replace(kinds.LEASE, body)
        except ApiError as exc:
            if exc.conflict:  # someone wrote in between: look again
                return Decision.WAIT
            raise
        self.observation = observe(self.observation, written, self.clock())
        if decision is Decision.TAKE_OVER or decision is Decision.CREATE:
            log.info(
                "leader election: %s leads %s/%s (term %d)",
                self.identity,
                self.namespace,
                self.name,
                int(written.get("spec", {}).get("leaseTransitions") or 0),
            )
        self.last_renewal_sent = sent
        return decision

    async def acquire(self) -> None:
        """Wait, as a standby, until this replica holds the Lease."""
        log.info("leader election: %s waits for %s/%s", self.identity, self.namespace, self.name)
        while not self.leading:
            try:
                await self._try()
            except _TRANSIENT as exc:
                log.warning("leader election: cannot read or write the Lease: %s", exc)
            if not self.leading:
                await asyncio.sleep(self.timings.retry_period)

    async def keep(self) -> None:
        """Renew every ``retry_period`` until cancelled; hand over to ``on_lost`` when it is lost."""
        while True:
            await asyncio.sleep(self.timings.retry_period)
            try:
                await self._renew()
            except LeadershipLost as exc:
                self._lose(str(exc))
                return
            except _TRANSIENT as exc:  # the deadline decides, not one failed call
                log.warning("leader election: renewal failed: %s", exc)

    async def _renew(self) -> None:
        """One renewal, written against the Lease as this replica last wrote it (no read): a conflict
        means another replica wrote it since, so it is lost."""
        observation = self.observation
        if observation is None or observation.record is None or observation.record.holder != self.identity:
            raise LeadershipLost(f"the Lease is not held by {self.identity}")
        body = build_lease(
            self.namespace, self.name, self.identity, Decision.RENEW, observation, self.timings,
            datetime.now(UTC),
        )  # fmt: skip
        sent = self.clock()
        try:
            written = await self.client.replace(kinds.LEASE, body)
        except ApiError as exc:
            if exc.conflict or exc.not_found:
                raise LeadershipLost(f"the Lease changed under {self.identity}: {exc}") from exc
            raise
        self.observation = observe(observation, written, self.clock())
        if self.last_renewal_sent is not None:  # not lost (by the watchdog) meanwhile
            self.last_renewal_sent = sent

    async def release(self) -> None:
        """Step down: write the Lease without a holder, if it is still ours. Call only once nothing of this
        replica writes any more."""
        self.stop_watchdog()
        if not self.leading or self.observation is None:
            return
        self.last_renewal_sent = None
        observation = self.observation
        for _ in range(3):
            body = build_released(self.namespace, self.name, observation, datetime.now(UTC))
            try:
                await self.client.replace(kinds.LEASE, body)
                log.info("leader election: %s released %s/%s", self.identity, self.namespace, self.name)
                return
            except ApiError as exc:
                if not exc.conflict:
                    log.warning("leader election: release failed (the Lease will expire): %s", exc)
                    return
            except _TRANSIENT as exc:  # it expires on its own
                log.warning("leader election: release failed (the Lease will expire): %s", exc)
                return
            # A renewal cancelled in flight may have been stored: read it, and release it if still ours.
            try:
                lease = await self.client.get(kinds.LEASE, self.name, self.namespace)
            except _TRANSIENT as exc:
                log.warning("leader election: release failed (the Lease will expire): %s", exc)
                return
            observation = observe(observation, lease, self.clock())
            if observation.record is None or observation.record.holder != self.identity:
                return  # not ours any more: nothing to release

    def start_watchdog(self) -> None:
        """A thread that ends the leader when the renew deadline passes: it runs even when the event loop
        is stuck, so a stuck leader cannot wake up later and write in another replica's term."""

        def watch() -> None:
            while not self._watchdog_stop.wait(0.1):
                sent = self.last_renewal_sent
                if sent is not None and leadership_lost(sent, self.clock(), self.timings):
                    self._lose(f"no renewal for {self.timings.renew_deadline:g} s")
                    return

        self._watchdog = threading.Thread(target=watch, name="lease-watchdog", daemon=True)
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        self._watchdog_stop.set()

    def _lose(self, why: str) -> None:
        self.last_renewal_sent = None
        self.on_lost(why)


def _exit_lost(why: str) -> None:
    """Stop every write of this process now: no graceful shutdown may write in the next leader's term."""
    log.error("leader election: leadership lost (%s); exiting", why)
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


def user_agent(identity: str, via: str = "kvfleet-operator") -> str:
    """The ``User-Agent`` of every request of replica ``identity`` (``via``: which client sends it)."""
    return f"{via} ({identity})"


def default_identity() -> str:
    """The pod's name (``POD_NAME`` from the downward API), else ``<hostname>-<pid>``."""
    return os.environ.get("POD_NAME") or f"{os.uname().nodename}-{os.getpid()}"
