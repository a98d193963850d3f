"""Reading the API server's own audit log: what was written, by whom, from which client.

The local API server logs every write (create, update, patch, delete) at Metadata level, nothing else
(``devcluster.cluster.AUDIT_POLICY``; the log is ``ControlPlane.audit_log``). These helpers turn it into
:class:`Write` records, so tests and benchmarks count the operator's writes as the API server saw them:
kopf's finalizer and annotation patches and Events included, not only the calls the operator's own
client counts.

The operator is counted by user: the ServiceAccount it runs as (``operators.operator_user``), whoever's
client sent the write. Every operator replica also sends a ``User-Agent`` that names it
(``kvfleet_operator.k8s.leader.user_agent``): ``kvfleet-operator (<identity>)`` from the operator's client,
``kopf/<version> (<identity>)`` from kopf's; that tells two replicas of one ServiceAccount apart.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

#: The Lease renewals of leader election: writes by design, counted apart from the operator's work.
LEASE_RESOURCE = ("coordination.k8s.io", "leases")
#: ``kvfleet-operator (<identity>)`` or ``kopf/<version> (<identity>)``; nothing else names a replica (kwok,
#: for one, also ends its User-Agent with parentheses).
_IDENTITY = re.compile(r"^(?:kvfleet-operator|kopf/\S+) \(([^()]+)\)$")


@dataclass(frozen=True)
class Write:
    """One audited write (an event of stage ``ResponseComplete``).

    ``received`` is when the API server received the request, ``at`` when it logged the response. The
    log's line order is the order of ``at``, which is not the order of the writes: the API server logs a
    response after it has sent it, from the request's own goroutine, so on a loaded machine a write that
    came later (a new leader taking the Lease the old one had just released) can be logged first.
    """

    received: datetime
    at: datetime
    verb: str
    user: str
    user_agent: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int

    @property
    def identity(self) -> str | None:
        """The operator replica that sent it (from its User-Agent), or ``None``."""
        match = _IDENTITY.match(self.user_agent)
        return match.group(1) if match else None

    @property
    def is_lease(self) -> bool:
        return (self.group, self.resource) == LEASE_RESOURCE

    @property
    def succeeded(self) -> bool:
        return 200 <= self.code < 300

    def describe(self) -> str:
        target = "/".join(p for p in (self.resource, self.namespace, self.name) if p)
        sub = f"/{self.subresource}" if self.subresource else ""
        return f"{self.verb} {target}{sub} ({self.code}) by {self.user_agent}"


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def read_writes(path: Path, offset: int = 0) -> list[Write]:
    """Every write logged in ``path`` from byte ``offset`` on (a line being written is left out)."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    out: list[Write] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:  # the last line, half written
            continue
        if event.get("stage") != "ResponseComplete":
            continue
        ref = event.get("objectRef") or {}
        out.append(
            Write(
                received=_parse_time(event["requestReceivedTimestamp"]),
                at=_parse_time(event.get("stageTimestamp") or event["requestReceivedTimestamp"]),
                verb=str(event.get("verb", "")),
                user=str((event.get("user") or {}).get("username", "")),
                user_agent=str(event.get("userAgent", "")),
                group=str(ref.get("apiGroup", "")),
                resource=str(ref.get("resource", "")),
                subresource=str(ref.get("subresource", "")),
                namespace=str(ref.get("namespace", "")),
                name=str(ref.get("name", "")),
                code=int((event.get("responseStatus") or {}).get("code") or 0),
            )
        )
    return out


class AuditLog:
    """A window on the audit log: :meth:`mark` now, later :meth:`writes` since the mark."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.mark()

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def writes(self) -> list[Write]:
        return read_writes(self.path, self.offset)


def by_operator(
    writes: Iterable[Write], namespace: str | None = None, *, user: str | None = None
) -> list[Write]:
    """The writes of the operator, in ``namespace`` if given: those of ``user`` (its ServiceAccount, the
    issue's rule), or, for an operator run with admin credentials (``user`` ``None``), those whose
    User-Agent names a replica."""
    return [
        w
        for w in writes
        if (w.user == user if user is not None else w.identity is not None)
        and (namespace is None or w.namespace == namespace)
    ]


def count_by(writes: Iterable[Write], key: str) -> Counter[str]:
    """Writes counted by one attribute (``user``, ``user_agent``, ``identity``, ``verb``, ``resource``)."""
    return Counter(str(getattr(w, key)) for w in writes)


def terms(writes: Iterable[Write]) -> Iterator[tuple[str, list[Write]]]:
    """The writes in the order the API server received them, grouped into runs of one identity.

    Received, not logged (see :class:`Write`): two successful updates of one Lease are serialized by its
    resourceVersion, so the later one was sent after the earlier had been answered, hence received after
    it; the order of the log's lines can still swap them."""
    current: str | None = None
    run: list[Write] = []
    for write in sorted(writes, key=lambda w: w.received):
        if write.identity != current and run:
            yield str(current), run
            run = []
        current = write.identity
        run.append(write)
    if run:
        yield str(current), run
