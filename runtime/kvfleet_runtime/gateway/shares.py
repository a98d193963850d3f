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
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "FLOOR",
    "Demand",
    "DemandMeter",
    "decode_demands",
    "demand_fraction",
    "encode_demands",
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


def encode_demands(demands: Mapping[str, Demand]) -> str:
    """What a replica publishes: ``{"tenant": [requests, tokens], ...}`` (rounded; ratios are what count)."""
    return json.dumps(
        {t: [round(d.requests, 4), round(d.tokens, 2)] for t, d in sorted(demands.items())},
        separators=(",", ":"),
    )


def decode_demands(payload: str | bytes) -> dict[str, Demand]:
    """Another replica's published demands; raises ``ValueError`` for anything that is not such a payload
    (a replica of another version, a key written by something else)."""
    try:
        raw = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a demand payload: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("not a demand payload: not an object")
    out: dict[str, Demand] = {}
    for tenant, value in raw.items():
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in value
            )
        ):
            raise ValueError(f"not a demand payload: tenant {tenant!r} has {value!r}")
        out[tenant] = Demand(float(value[0]), float(value[1]))
    return out
