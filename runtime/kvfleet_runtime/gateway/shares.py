"""Each gateway replica's share of a tenant's rate limits, from what every replica sees. Pure (no I/O; the
clock is passed in).

Without a shared store each of ``N`` replicas enforces ``1/N`` of a tenant's requests and tokens per minute
(``admission.GateLimits``): a tenant whose traffic lands on one replica gets one replica's share. With one
(``gateway.shared_store``) the replicas tell each other, every sync interval, how much each tenant asks of
each of them, and split every limit by that demand:

* **Demand** (``DemandMeter``) is what a tenant asked of this replica, admitted or refused: requests, and
  the token estimates of the requests that reached the token bucket, each an exponentially decayed sum
  with time constant ``tau_s`` (what arrived ``tau_s`` ago weighs ``1/e``). A replica publishes its
  decayed sums; only their ratios matter.
* **The split** (``demand_fraction``): replica ``r`` of ``n`` live replicas gets
  ``floor / n + (1 - floor) x d_r / D`` of the limit, ``D`` being the sum of the published demands. The
  fractions sum to 1, so the replicas together never admit more than the limit, and when the tenant asks
  more than its limit every replica asks more than its fraction, so together they admit all of it. The
  ``floor`` (``FLOOR``, 2 %) keeps a replica the tenant has not used lately able to admit its first
  request (a bucket smaller than one request still admits one when full: ``admission.TokenBucket``)
  before the next sync moves the share there. With no demand anywhere the split is even.
* **Accuracy, traded for a hot path without a network round trip:** the store is read every sync
  interval, not per request, so a share follows a change of where the tenant's traffic lands after a sync
  interval plus the demand's time constant; meanwhile the replicas admit what their previous shares
  allowed, never more than the limit in total, and less when the traffic moved to a replica with a small
  share. Replicas read the store at different moments, so the fractions they apply sum to 1 only up to
  the demand that changed between their reads.

Concurrency (``max_concurrent``) stays split evenly: a request's slot is held for its whole answer, and a
replica cannot give back a slot another replica is using.

**Fair shares of the engines across replicas.** Each replica holds at most its limit of a pool's requests on
the engines and orders the rest by VTC (``admission.EngineQueue``, ``kv.fairness``); alone, it cannot weigh
tenants whose traffic lands on other replicas, so with skewed ingress two tenants weighted 1:4 each get the
half their own replica holds. With the store each replica also publishes, per pool, every tenant's SLA rank,
weight and the requests it has waiting or in flight there (``EngineDemand``). From all replicas' reports
each computes the same allocation of the pool's whole capacity (the replicas' static limits summed) to
tenants (``allocate_engine_slots``: strict priority between SLA ranks, weighted max-min fairness within one,
no tenant given more than it asks), and takes as its limit the part of each tenant's allocation that its own
share of that tenant's requests calls for, plus an even part of what no tenant asks for (``engine_split``);
each tenant's own part is a cap in the replica's queue (``FairQueue.caps``): a tenant at its part waits
while another under its part waits too. Within the replica VTC orders as before, on counters that also grow
by the service the other replicas report (each tenant's weighted tokens served there, the growth since the
last sync charged here: ``FairQueue.charge_elsewhere``): otherwise a tenant's few requests on the replica
where others dominate would always look unserved there and be served first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FLOOR",
    "Demand",
    "DemandMeter",
    "EngineDemand",
    "ReplicaReport",
    "allocate_engine_slots",
    "decode_report",
    "demand_fraction",
    "encode_report",
    "engine_split",
]

#: The part of every limit split evenly over the live replicas, whatever their demand (module docstring).
FLOOR = 0.02
#: Decayed demand below this is forgotten (not published): the tenant has been idle for many ``tau_s``.
_FORGET_BELOW = 1e-3


@dataclass(frozen=True, slots=True)
class Demand:
    """What a tenant asked of one replica lately: requests, and tokens (estimates), as decayed sums."""

    requests: float = 0.0
    tokens: float = 0.0


class DemandMeter:
    """Per-tenant decayed sums of the requests and tokens a replica was asked for (module docstring)."""

    __slots__ = ("_sums", "tau_s")

    def __init__(self, tau_s: float = 3.0) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = tau_s
        #: tenant -> [requests, tokens, when they were last decayed]
        self._sums: dict[str, list[float]] = {}

    def record(self, tenant: str, now: float, requests: float = 0.0, tokens: float = 0.0) -> None:
        """Count what ``tenant`` asked for at ``now``."""
        sums = self._sums.get(tenant)
        if sums is None:
            self._sums[tenant] = [requests, tokens, now]
            return
        decay = math.exp(-(now - sums[2]) / self.tau_s) if now > sums[2] else 1.0
        sums[0] = sums[0] * decay + requests
        sums[1] = sums[1] * decay + tokens
        sums[2] = max(now, sums[2])

    def snapshot(self, now: float) -> dict[str, Demand]:
        """Every tenant's demand decayed to ``now``; tenants idle for long are forgotten."""
        out: dict[str, Demand] = {}
        for tenant, (requests, tokens, stamp) in list(self._sums.items()):
            decay = math.exp(-(now - stamp) / self.tau_s) if now > stamp else 1.0
            demand = Demand(requests * decay, tokens * decay)
            if demand.requests < _FORGET_BELOW and demand.tokens < _FORGET_BELOW:
                del self._sums[tenant]
            else:
                out[tenant] = demand
        return out


def demand_fraction(own: float, others: Iterable[float], floor: float = FLOOR) -> float:
    """This replica's fraction of a limit: ``own`` is its demand, ``others`` the other live replicas'."""
    rest = list(others)
    n = 1 + len(rest)
    total = own + sum(rest)
    if total <= _FORGET_BELOW:
        return 1.0 / n
    return floor / n + (1.0 - floor) * (own / total)


@dataclass(frozen=True, slots=True)
class EngineDemand:
    """A tenant's requests waiting for or running on a pool's engines at one replica, with what orders it."""

    rank: int
    weight: float
    requests: float
    #: Weighted tokens this replica served the tenant on the pool, since it started (``FairQueue.served``):
    #: the others charge what it grew by to their own counters (``FairQueue.charge_elsewhere``).
    served: float = 0.0


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica publishes: rate-limit demand per tenant, engine demand per pool and tenant."""

    rates: Mapping[str, Demand]
    engines: Mapping[str, Mapping[str, EngineDemand]]


def allocate_engine_slots(capacity: float, demands: Mapping[str, EngineDemand]) -> dict[str, float]:
    """Slots of a pool's engines per tenant, ``demands`` being each tenant's over every replica: the
    highest SLA rank first, and within a rank weighted max-min fairness (water-filling: a tenant asking
    less than its weighted part gets what it asks, the rest is shared again among the others)."""
    out: dict[str, float] = {}
    left = float(capacity)
    for rank in sorted({d.rank for d in demands.values()}, reverse=True):
        hungry = {t: d for t, d in demands.items() if d.rank == rank and d.requests > 0}
        while hungry and left > 1e-9:
            weights = sum(d.weight for d in hungry.values())
            fits = {t: d for t, d in hungry.items() if d.requests <= left * d.weight / weights}
            if not fits:
                for t, d in hungry.items():
                    out[t] = left * d.weight / weights
                left = 0.0
                break
            for t, d in fits.items():
                out[t] = d.requests
                left -= d.requests
                del hungry[t]
    return out


def engine_split(
    static_limit: int, mine: Mapping[str, EngineDemand], others: Sequence[Mapping[str, EngineDemand]]
) -> tuple[int, dict[str, int]]:
    """This replica's in-flight limit on one pool's engines and each of its tenants' part of it (module
    docstring): the pool's capacity is ``static_limit`` times the live replicas; the limit is at least 1,
    a tenant's part at least 1 (rounded half up)."""
    n = 1 + len(others)
    total: dict[str, EngineDemand] = {}
    for report in (mine, *others):
        for tenant, d in report.items():
            seen = total.get(tenant)
            requests = d.requests + (seen.requests if seen is not None else 0.0)
            total[tenant] = EngineDemand(d.rank, d.weight, requests)
    capacity = static_limit * n
    allocation = allocate_engine_slots(capacity, total)
    limit = (capacity - sum(allocation.values())) / n
    parts: dict[str, int] = {}
    for tenant, d in mine.items():
        if d.requests > 0 and tenant in allocation:
            part = allocation[tenant] * d.requests / total[tenant].requests
            limit += part
            parts[tenant] = max(1, math.floor(part + 0.5))
    return max(1, math.floor(limit + 0.5)), parts


def encode_report(report: ReplicaReport) -> str:
    """What a replica publishes (JSON; rounded: ratios are what count)."""
    return json.dumps(
        {
            "rates": {t: [round(d.requests, 4), round(d.tokens, 2)] for t, d in sorted(report.rates.items())},
            "engines": {
                pool: {
                    t: [d.rank, d.weight, d.requests, round(d.served, 1)] for t, d in sorted(tenants.items())
                }
                for pool, tenants in sorted(report.engines.items())
            },
        },
        separators=(",", ":"),
    )


def _numbers(value: object, size: int) -> list[float] | None:
    if not isinstance(value, list) or len(value) != size:
        return None
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value
    ):
        return None
    return [float(v) for v in value]


def decode_report(payload: str | bytes) -> ReplicaReport:
    """Another replica's report; raises ``ValueError`` for anything that is not one (a replica of another
    version, a key written by something else)."""
    try:
        raw = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a replica report: {exc}") from None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("rates"), dict)
        or not isinstance(raw.get("engines"), dict)
    ):
        raise ValueError("not a replica report: wants an object with rates and engines")
    rates: dict[str, Demand] = {}
    for tenant, value in raw["rates"].items():
        numbers = _numbers(value, 2)
        if numbers is None:
            raise ValueError(f"not a replica report: tenant {tenant!r} has rates {value!r}")
        rates[tenant] = Demand(numbers[0], numbers[1])
    engines: dict[str, dict[str, EngineDemand]] = {}
    for pool, tenants in raw["engines"].items():
        if not isinstance(tenants, dict):
            raise ValueError(f"not a replica report: pool {pool!r} has {tenants!r}")
        engines[pool] = {}
        for tenant, value in tenants.items():
            numbers = _numbers(value, 4)
            if numbers is None or numbers[1] <= 0:
                raise ValueError(f"not a replica report: tenant {tenant!r} of pool {pool!r} has {value!r}")
            engines[pool][tenant] = EngineDemand(int(numbers[0]), numbers[1], numbers[2], numbers[3])
    return ReplicaReport(rates, engines)
