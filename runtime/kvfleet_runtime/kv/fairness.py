"""Token-weighted fair queuing: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024, as a pure core (no I/O, no clock, no asyncio).

Contract
--------
* ``FairQueue`` holds requests ("tickets") of tenants, each in an SLA tier (``rank``: higher is served
  first) with a weight ``φ > 0``, and dispatches at most ``limit`` of them at once (``None``: no limit).
* **Between tiers: strict priority.** A ticket is dispatched only when no tier of higher rank has a ticket
  waiting, as vLLM's priority scheduling orders tiers today.
* **Within a tier: VTC.** Every tenant has a virtual counter ``c``. Service is charged to it as weighted
  tokens divided by the tenant's weight: ``cost = input_weight x input + output_weight x output``
  (``TokenCost``; 1 and 2 by default, the paper's ``w_p``/``w_q``) and ``c += cost / φ``. The next ticket
  is the oldest one of the backlogged tenant (one with a ticket waiting) whose counter is smallest; ties
  go to the tenant whose oldest ticket arrived first.
* **No banked credit.** A tenant that becomes backlogged (its first waiting ticket) is lifted to the tier's
  floor: ``c = max(c, floor)``, where ``floor`` is the smallest counter of the tier's backlogged tenants,
  or, when none is backlogged, the counter of the last tenant whose backlog emptied, as it is then (the
  paper's Algorithm 2). The floor never decreases.
* **What the gateway can observe, and when it is charged.** The input is charged when a ticket is
  dispatched and corrected with the engine's ``usage.prompt_tokens`` when the answer ends; the output is
  charged when the engine reports ``usage.completion_tokens`` at the end of the answer (streamed answers
  too: the gateway asks for the usage chunk). The paper charges output per decoding step inside the
  engine's scheduler; a gateway sees whole answers, so its counter lags by at most the output of the
  requests in flight, and the bound below accounts for that.
* **The dispatch charge learns the engine's count.** The gateway's prompt estimate (characters / 4) can
  be far from the engine's tokenizer (3x low for hex-like text on the benchmark's tokenizer). What is not
  yet charged for a tenant's requests in flight makes its counter look smaller than its service, so a
  tenant with more requests in flight, the heavy one, looks cheaper and is picked more; the lift of a
  returning tenant to the floor then turns that lag into lost service for the light one. So the input is
  charged at dispatch as the estimate times the tenant's ratio of reported prompt tokens to estimated
  ones (``INPUT_SCALE_SMOOTHING``: an exponential average over its settled answers; 1 before the first).
  When estimates are exact the ratio is 1 and nothing changes.
* **The bound** (``service_gap_bound``): let ``L`` be the largest input, ``M`` the largest output of one
  request and ``C`` the most requests in flight at once (``limit``). After tenant ``f``'s last dispatch
  (at which ``c_f`` was the tier's smallest), ``c_f`` grows by at most that ticket's input and the output
  of the at most ``C`` requests of ``f`` then in flight, so at every moment every backlogged tenant has
  ``floor <= c_f <= floor + U_f`` with ``U_f = (input_weight x L + C x output_weight x M) / φ_f``. For two
  tenants ``f``, ``g`` backlogged throughout an interval, their weighted service ``W`` over it satisfies

      | W_f / φ_f - W_g / φ_g | <= U_f + U_g

  (the paper's ``2 x max(w_p L, w_q M)`` with equal weights, where ``M`` is the output a batch can hold
  per step; here the output of whole answers in flight). With FIFO order (``fair=False``) no such bound
  holds: a tenant's share is its share of the arrivals.
* ``fair=False`` keeps tiers and the hold, and orders a tier by arrival alone (first come, first served).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")

#: Weight of the newest answer in a tenant's average ratio of reported to estimated prompt tokens.
INPUT_SCALE_SMOOTHING = 0.25


@dataclass(frozen=True)
class TokenCost:
    """The weighted cost of served tokens (the paper's ``w_p`` and ``w_q``)."""

    input_weight: float = 1.0
    output_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.input_weight < 0 or self.output_weight < 0 or self.input_weight + self.output_weight == 0:
            raise ValueError("token cost weights must be >= 0 and not both 0")

    def of(self, input_tokens: float, output_tokens: float) -> float:
        return self.input_weight * input_tokens + self.output_weight * output_tokens


def service_gap_bound(
    cost: TokenCost, max_input: int, max_output: int, max_in_flight: int, weight_f: float, weight_g: float
) -> float:
    """``U_f + U_g``: the most ``|W_f/φ_f - W_g/φ_g|`` may reach over an interval in which both tenants are
    backlogged (module docstring)."""
    overshoot = cost.input_weight * max_input + max_in_flight * cost.output_weight * max_output
    return overshoot / weight_f + overshoot / weight_g


class TicketState(Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"


@dataclass(eq=False, slots=True)
class Ticket(Generic[T]):
    """One request in a ``FairQueue``; ``item`` is the caller's (the gateway: a future to wake)."""

    tenant: str
    rank: int
    weight: float
    input_tokens: int
    item: T
    seq: int
    state: TicketState = TicketState.QUEUED
    #: Input tokens charged at dispatch (corrected by ``settle``).
    charged_input: float = 0.0


@dataclass
class _Tier(Generic[T]):
    #: Backlogged tenants of this tier -> their waiting tickets, oldest first.
    backlog: dict[str, deque[Ticket[T]]] = field(default_factory=dict)
    floor: float = 0.0
    waiting: int = 0
    #: The tenant whose backlog emptied last; its counter (which still grows with the output of its
    #: requests in flight) is the floor while the tier has no backlog.
    last_left: str | None = None


class FairQueue(Generic[T]):
    """VTC (or FIFO) order within a tier, strict priority between tiers, at most ``limit`` in flight."""

    def __init__(self, limit: int | None, cost: TokenCost | None = None, fair: bool = True) -> None:
        if limit is not None and limit < 1:
            raise ValueError("limit must be >= 1 (None: no limit)")
        self.limit = limit
        self.cost = cost or TokenCost()
        self.fair = fair
        self.in_flight = 0
        #: Virtual counters (normalised weighted tokens); tenants keep theirs while idle.
        self.counters: dict[str, float] = {}
        #: Weighted tokens served per tenant (not divided by the weight): what fairness is measured on.
        self.served: dict[str, float] = {}
        #: Per tenant: reported prompt tokens per estimated one (module docstring); absent: 1.
        self.input_scale: dict[str, float] = {}
        self._tiers: dict[int, _Tier[T]] = {}
        self._seq = itertools.count()
        #: Tickets waiting in all tiers (``waiting()`` without the sum).
        self._waiting = 0
        #: Dispatched tickets not yet finished, per tenant (``demand``); a tenant with none is absent.
        self._running: dict[str, int] = {}
        #: Tenant -> the requests it may have in flight here before others waiting go first (the gateway
        #: replicas' split of the engines, ``gateway.shares.engine_split``); empty: no caps.
        self.caps: dict[str, int] = {}
        #: Rank and weight of each tenant's latest dispatched request (``demand``, ``profile``).
        self._last: dict[str, tuple[int, float]] = {}

    # -- reading -------------------------------------------------------------------------------------
    def waiting(self, rank: int | None = None) -> int:
        """Tickets waiting (in one tier, or in all)."""
        if rank is not None:
            tier = self._tiers.get(rank)
            return 0 if tier is None else tier.waiting
        return self._waiting

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (0 before it was first served)."""
        return self.counters.get(tenant, 0.0)

    def demand(self) -> dict[str, tuple[int, float, int]]:
        """Tenant -> (rank, weight, requests waiting or in flight) for every tenant with any: what the
        gateway replicas share to split a pool's engines by weight (``gateway.shares.engine_split``).
        Rank and weight are those of the tenant's latest request."""
        out: dict[str, tuple[int, float, int]] = {}
        for rank, tier in self._tiers.items():
            for tenant, queue in tier.backlog.items():
                weight = queue[-1].weight if queue else 1.0
                out[tenant] = (rank, weight, len(queue) + self._running.get(tenant, 0))
        for tenant, (rank, weight) in self._last.items():
            if tenant not in out and self._running.get(tenant):
                out[tenant] = (rank, weight, self._running[tenant])
        return out

    def backlogged(self, rank: int) -> frozenset[str]:
        tier = self._tiers.get(rank)
        return frozenset() if tier is None else frozenset(tier.backlog)

    def floor(self, rank: int) -> float:
        tier = self._tiers.get(rank)
        if tier is None:
            return 0.0
        return self._current_floor(tier)

    # -- changing ------------------------------------------------------------------------------------
    def set_limit(self, limit: int | None) -> None:
        """Change the in-flight limit (a reload); what is in flight stays. Call ``pop`` afterwards."""
        if limit is not None and limit < 1:
            raise ValueError("limit must be >= 1 (None: no limit)")
        self.limit = limit

    def push(self, tenant: str, rank: int, weight: float, input_tokens: int, item: T) -> Ticket[T]:
        """Queue a request; lifts a tenant that was not backlogged to its tier's floor."""
        if weight <= 0:
            raise ValueError("a tenant's weight must be > 0")
        tier = self._tiers.setdefault(rank, _Tier[T]())
        ticket = Ticket(tenant, rank, weight, max(0, input_tokens), item, next(self._seq))
        queue = tier.backlog.get(tenant)
        if queue is None:
            floor = self._current_floor(tier)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            queue = tier.backlog[tenant] = deque()
        queue.append(ticket)
        tier.waiting += 1
        self._waiting += 1
        return ticket

    def dispatch_now(
        self, tenant: str, rank: int, weight: float, input_tokens: int, item: T
    ) -> Ticket[T] | None:
        """``push`` then ``pop`` in one step, when nothing waits in any tier and the limit has room: the
        request runs at once, with the same counters, charge and floor as the two calls would leave.
        ``None`` (and nothing changed) otherwise: ``push`` it. The gateway's path with no contention."""
        if self._waiting or (self.limit is not None and self.in_flight >= self.limit):
            return None
        if weight <= 0:
            raise ValueError("a tenant's weight must be > 0")
        # Written out (no max(), no cost.of()): this runs for every request the gateway admits.
        counters = self.counters
        tier = self._tiers.get(rank)
        if tier is None:
            tier = self._tiers[rank] = _Tier[T]()
        elif tier.last_left is not None:  # what _current_floor does with an empty backlog
            last = counters[tier.last_left]
            tier.floor = max(tier.floor, last)
        input_tokens = max(input_tokens, 0)
        charged = input_tokens * self.input_scale.get(tenant, 1.0)
        ticket = Ticket(
            tenant, rank, weight, input_tokens, item, next(self._seq), TicketState.DISPATCHED, charged
        )
        counter = counters.get(tenant, 0.0)
        counter = max(counter, tier.floor)
        self.in_flight += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self._last[tenant] = (rank, weight)
        weighted = self.cost.input_weight * charged
        self.served[tenant] = self.served.get(tenant, 0.0) + weighted
        counters[tenant] = counter = counter + weighted / weight
        # The backlog it never joined emptied again: it is the last to leave (``_leave``).
        tier.last_left = tenant
        tier.floor = max(tier.floor, counter)
        return ticket

    def pop(self) -> Ticket[T] | None:
        """Dispatch the next ticket when the limit allows (charging its input), else ``None``."""
        if self.limit is not None and self.in_flight >= self.limit:
            return None
        for rank in sorted(self._tiers, reverse=True):
            tier = self._tiers[rank]
            if not tier.backlog:
                continue
            tenant = self._choose(tier)
            queue = tier.backlog[tenant]
            ticket = queue.popleft()
            tier.waiting -= 1
            self._waiting -= 1
            if not queue:
                self._leave(tier, tenant)
            ticket.state = TicketState.DISPATCHED
            self.in_flight += 1
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._last[tenant] = (rank, ticket.weight)
            ticket.charged_input = ticket.input_tokens * self.input_scale.get(tenant, 1.0)
            self._charge(ticket, self.cost.of(ticket.charged_input, 0))
            return ticket
        return None

    def drain(self) -> Iterator[Ticket[T]]:
        """Every ticket ``pop`` dispatches now, in order."""
        while (ticket := self.pop()) is not None:
            yield ticket

    def cancel(self, ticket: Ticket[T]) -> bool:
        """Take a waiting ticket out (its request timed out or went away); ``False`` if it is not waiting."""
        if ticket.state is not TicketState.QUEUED:
            return False
        tier = self._tiers[ticket.rank]
        queue = tier.backlog[ticket.tenant]
        queue.remove(ticket)
        tier.waiting -= 1
        self._waiting -= 1
        ticket.state = TicketState.DONE
        if not queue:
            self._leave(tier, ticket.tenant)
        return True

    def undo(self, ticket: Ticket[T]) -> None:
        """Give back a dispatch whose request was gone before it could start: slot and charge."""
        if ticket.state is not TicketState.DISPATCHED:
            return
        self._charge(ticket, -self.cost.of(ticket.charged_input, 0))
        ticket.charged_input = 0
        ticket.state = TicketState.DONE
        self.in_flight -= 1
        self._stopped(ticket.tenant)

    def settle(self, ticket: Ticket[T], prompt_tokens: int, completion_tokens: int) -> None:
        """Charge what the engine reported: the input corrected to ``prompt_tokens``, the output; and learn
        the tenant's ratio of reported to estimated prompt tokens for its next dispatches."""
        if ticket.state is TicketState.QUEUED:
            return
        prompt = prompt_tokens if prompt_tokens > 0 else 0
        correction = prompt - ticket.charged_input
        ticket.charged_input = prompt
        cost = self.cost
        weighted = cost.input_weight * correction
        if completion_tokens > 0:
            weighted += cost.output_weight * completion_tokens
        tenant = ticket.tenant
        self.served[tenant] = self.served.get(tenant, 0.0) + weighted
        self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted / ticket.weight
        if ticket.input_tokens > 0 and prompt_tokens > 0:
            ratio = prompt_tokens / ticket.input_tokens
            old = self.input_scale.get(ticket.tenant)
            self.input_scale[ticket.tenant] = (
                ratio if old is None else old + INPUT_SCALE_SMOOTHING * (ratio - old)
            )

    def finish(self, ticket: Ticket[T]) -> None:
        """The dispatched request ended: free its slot (idempotent). Call ``pop`` afterwards."""
        if ticket.state is TicketState.DISPATCHED:
            ticket.state = TicketState.DONE
            self.in_flight -= 1
            self._stopped(ticket.tenant)

    def _stopped(self, tenant: str) -> None:
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]

    def profile(self, tenant: str) -> tuple[int, float] | None:
        """Rank and weight of the tenant's latest dispatched request (``None``: none yet)."""
        return self._last.get(tenant)

    def charge_elsewhere(self, tenant: str, weighted_tokens: float, weight: float) -> None:
        """Service another gateway replica gave the tenant on the same engines (``gateway.shared_store``):
        its counter grows as if this queue had served it, so every replica orders by the tenant's whole
        service; ``served`` (this queue's own) does not."""
        if weighted_tokens > 0 and weight > 0:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted_tokens / weight

    # -- inside --------------------------------------------------------------------------------------
    def _charge(self, ticket: Ticket[T], weighted_tokens: float) -> None:
        self.served[ticket.tenant] = self.served.get(ticket.tenant, 0.0) + weighted_tokens
        self.counters[ticket.tenant] = self.counters.get(ticket.tenant, 0.0) + weighted_tokens / ticket.weight

    def _choose(self, tier: _Tier[T]) -> str:
        caps = self.caps
        if caps:
            # Tenants under the part of the engines the replicas' split gives them here come first; when
            # every waiting tenant is at its part, the slot still goes to one of them (never left idle).
            running = self._running
            under = [t for t in tier.backlog if running.get(t, 0) < caps.get(t, 1 << 30)]
            if under and len(under) < len(tier.backlog):
                if self.fair:
                    return min(under, key=lambda t: (self.counters[t], tier.backlog[t][0].seq))
                return min(under, key=lambda t: tier.backlog[t][0].seq)
        if self.fair:
            # Smallest counter; ties to the oldest waiting ticket (a stable, arrival-fair tie break).
            return min(tier.backlog, key=lambda t: (self.counters[t], tier.backlog[t][0].seq))
        return min(tier.backlog, key=lambda t: tier.backlog[t][0].seq)

    def _current_floor(self, tier: _Tier[T]) -> float:
        if tier.backlog:
            tier.floor = max(tier.floor, min(self.counters[t] for t in tier.backlog))
        elif tier.last_left is not None:
            tier.floor = max(tier.floor, self.counters[tier.last_left])
        return tier.floor

    def _leave(self, tier: _Tier[T], tenant: str) -> None:
        """``tenant``'s backlog emptied; the floor remembers the last counter to leave an empty tier."""
        del tier.backlog[tenant]
        tier.last_left = tenant
        self._current_floor(tier)
