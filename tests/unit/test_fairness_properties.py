"""Properties of the Virtual Token Counter core (kv/fairness.py) over random arrivals and completions.

The harness keeps its own books (what it dispatched, what it charged, who is waiting) and checks the
core against them: the service gap between two continuously backlogged tenants stays within
``service_gap_bound``, a tenant returning from idle is lifted to the floor, weights set the shares, and
tiers are served in strict priority.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, defaultdict
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_runtime.kv.fairness import (
    INPUT_SCALE_SMOOTHING,
    FairQueue,
    Ticket,
    TokenCost,
    service_gap_bound,
)

MAX_INPUT = 40
MAX_OUTPUT = 30
#: ``("arrive", tenant, input, output)`` or ``("complete", "", index, 0)``.
Event = tuple[str, str, int, int]


@dataclass(frozen=True)
class TenantCfg:
    rank: int
    weight: float


@dataclass
class Run:
    """One replayed sequence: service after every event and who was waiting then."""

    snapshots: list[tuple[dict[str, float], frozenset[str]]]
    queue: FairQueue[int]
    order: list[str]


def replay(
    tenants: dict[str, TenantCfg],
    events: list[Event],
    limit: int,
    cost: TokenCost,
    fair: bool = True,
) -> Run:
    """Events: ``("arrive", tenant, input, output)`` or ``("complete", "", index, 0)``."""
    q: FairQueue[int] = FairQueue(limit, cost, fair=fair)
    waiting: Counter[str] = Counter()
    in_flight: list[Ticket[int]] = []
    served: dict[str, float] = defaultdict(float)
    snapshots: list[tuple[dict[str, float], frozenset[str]]] = []
    order: list[str] = []

    def drain() -> None:
        for ticket in q.drain():
            higher = [u for u, cfg in tenants.items() if cfg.rank > ticket.rank and waiting[u] > 0]
            assert not higher, f"{ticket.tenant} (rank {ticket.rank}) served while {higher} wait"
            assert waiting[ticket.tenant] > 0
            waiting[ticket.tenant] -= 1
            served[ticket.tenant] += cost.input_weight * ticket.input_tokens
            in_flight.append(ticket)
            order.append(ticket.tenant)
            assert len(in_flight) <= limit

    for kind, tenant, a, b in events:
        if kind == "arrive":
            cfg = tenants[tenant]
            q.push(tenant, cfg.rank, cfg.weight, a, b)
            waiting[tenant] += 1
        elif in_flight:
            ticket = in_flight.pop(a % len(in_flight))
            q.settle(ticket, ticket.input_tokens, ticket.item)
            served[ticket.tenant] += cost.output_weight * ticket.item
            q.finish(ticket)
        drain()
        snapshots.append((dict(served), frozenset(u for u in tenants if waiting[u] > 0)))
    return Run(snapshots, q, order)


def worst_gap(run: Run, tenants: dict[str, TenantCfg], f: str, g: str) -> float:
    """Largest ``|ΔW_f/φ_f - ΔW_g/φ_g|`` over intervals in which both were backlogged throughout."""
    worst = 0.0
    snaps = run.snapshots
    wf, wg = tenants[f].weight, tenants[g].weight
    i = 0
    while i < len(snaps):
        if not {f, g} <= snaps[i][1]:
            i += 1
            continue
        j = i
        while j + 1 < len(snaps) and {f, g} <= snaps[j + 1][1]:
            j += 1
        # The run i..j: both backlogged after every event in it (so during every event after i, too).
        values = [s[0].get(f, 0.0) / wf - s[0].get(g, 0.0) / wg for s in snaps[i : j + 1]]
        worst = max(worst, max(values) - min(values))
        i = j + 1
    return worst


costs = st.sampled_from([TokenCost(), TokenCost(1.0, 1.0), TokenCost(0.5, 4.0)])
weights = st.sampled_from([0.5, 1.0, 2.0, 3.0])


@st.composite
def scenarios(draw: st.DrawFn, tiers: int = 1) -> tuple[dict[str, TenantCfg], list[Event]]:
    n = draw(st.integers(2, 4))
    tenants = {f"t{i}": TenantCfg(draw(st.integers(0, tiers - 1)), draw(weights)) for i in range(n)}
    names = sorted(tenants)
    # Arrivals outnumber completions, with bursts per tenant: long stretches where several are backlogged.
    event = st.one_of(
        st.tuples(
            st.just("arrive"),
            st.sampled_from(names),
            st.integers(1, MAX_INPUT),
            st.integers(1, MAX_OUTPUT),
        ),
        st.tuples(st.just("complete"), st.just(""), st.integers(0, 100), st.just(0)),
    )
    return tenants, draw(st.lists(event, min_size=10, max_size=160))


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), limit=st.integers(1, 4), cost=costs)
def test_service_gap_of_backlogged_tenants_is_bounded(
    scenario: tuple[dict[str, TenantCfg], list[Event]], limit: int, cost: TokenCost
) -> None:
    tenants, events = scenario
    run = replay(tenants, events, limit, cost)
    for f in tenants:
        for g in tenants:
            if f < g:
                bound = service_gap_bound(
                    cost, MAX_INPUT, MAX_OUTPUT, limit, tenants[f].weight, tenants[g].weight
                )
                assert worst_gap(run, tenants, f, g) <= bound + 1e-9


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(tiers=3), limit=st.integers(1, 4), cost=costs)
def test_tiers_are_served_in_strict_priority(
    scenario: tuple[dict[str, TenantCfg], list[Event]], limit: int, cost: TokenCost
) -> None:
    tenants, events = scenario
    replay(tenants, events, limit, cost)  # the harness asserts the order at every dispatch
    # and FIFO keeps tiers too
    replay(tenants, events, limit, cost, fair=False)


def _always_backlogged(tenants: dict[str, TenantCfg], per_tenant: int, size: tuple[int, int]) -> Run:
    """Every tenant queues ``per_tenant`` requests up front; then one request completes at a time."""
    events: list[Event] = [
        ("arrive", name, size[0], size[1]) for _ in range(per_tenant) for name in sorted(tenants)
    ]
    events += [("complete", "", 0, 0)] * (per_tenant * len(tenants))
    return replay(tenants, events, limit=2, cost=TokenCost())


def test_weights_set_the_shares_while_both_are_backlogged() -> None:
    tenants = {"gold": TenantCfg(0, 3.0), "iron": TenantCfg(0, 1.0)}
    run = _always_backlogged(tenants, 400, (20, 10))
    # Service when "iron" (the lighter-weighted) is still backlogged... both are until gold runs dry.
    last_both = max(i for i, s in enumerate(run.snapshots) if {"gold", "iron"} <= s[1])
    served = run.snapshots[last_both][0]
    ratio = served["gold"] / served["iron"]
    assert 2.8 < ratio < 3.2, ratio
    bound = service_gap_bound(TokenCost(), 20, 10, 2, 3.0, 1.0)
    assert abs(served["gold"] / 3.0 - served["iron"] / 1.0) <= bound


def test_fifo_has_no_such_bound() -> None:
    """The same check fails for first come, first served: the bound is VTC's, not the harness's."""
    tenants = {"heavy": TenantCfg(0, 1.0), "light": TenantCfg(0, 1.0)}
    events: list[Event] = []
    for _ in range(40):
        events += [("arrive", "heavy", 20, 10)] * 5 + [("arrive", "light", 20, 10)]
    events += [("complete", "", 0, 0)] * 240
    bound = service_gap_bound(TokenCost(), 20, 10, 2, 1.0, 1.0)
    fifo = replay(tenants, events, limit=2, cost=TokenCost(), fair=False)
    vtc = replay(tenants, events, limit=2, cost=TokenCost(), fair=True)
    assert worst_gap(fifo, tenants, "heavy", "light") > 5 * bound
    assert worst_gap(vtc, tenants, "heavy", "light") <= bound


def test_a_tenant_back_from_idle_is_lifted_and_banks_no_credit() -> None:
    q: FairQueue[None] = FairQueue(limit=1)
    # "busy" is served alone for a while; "away" has been idle all along.
    busy = [q.push("busy", 0, 1.0, 100, None) for _ in range(20)]
    for ticket in busy[:10]:
        popped = q.pop()
        assert popped is ticket
        q.settle(ticket, 100, 0)
        q.finish(ticket)
    assert q.counters["busy"] == 1000
    q.push("away", 0, 1.0, 100, None)
    for _ in range(9):
        q.push("away", 0, 1.0, 100, None)
    # Lifted to the floor (busy's counter), not left at 0 with 1000 tokens of credit.
    assert q.counters["away"] == 1000
    order = []
    while (ticket := q.pop()) is not None:
        order.append(ticket.tenant)
        q.settle(ticket, 100, 0)
        q.finish(ticket)
    # Taking turns from the start: without lifting "away" would take its 10 in a row.
    assert order[:4] in (["busy", "away", "busy", "away"], ["away", "busy", "away", "busy"])


def test_a_tenant_arriving_at_an_empty_tier_is_lifted_to_the_last_one_to_leave() -> None:
    q: FairQueue[None] = FairQueue(limit=None)
    ticket = q.push("first", 0, 1.0, 50, None)
    assert q.pop() is ticket
    q.settle(ticket, 50, 25)
    q.finish(ticket)
    assert q.counters["first"] == 100  # 50 input + 2 x 25 output
    q.push("later", 0, 1.0, 10, None)
    assert q.counters["later"] == 100


def test_cancelled_tickets_leave_the_queue_and_the_order() -> None:
    q: FairQueue[str] = FairQueue(limit=1)
    a = q.push("a", 0, 1.0, 10, "a1")
    b = q.push("b", 0, 1.0, 10, "b1")
    assert q.cancel(a)
    assert not q.cancel(a)
    assert q.waiting() == 1
    assert q.pop() is b
    assert q.pop() is None  # the limit
    q.undo(b)
    assert q.in_flight == 0
    assert q.counters["b"] == 0


def _state(q: FairQueue[int]) -> tuple[object, ...]:
    tiers = {
        r: (t.floor, t.waiting, t.last_left, sorted(t.backlog)) for r, t in q._tiers.items() if t.backlog
    }
    floors = {r: q.floor(r) for r in q._tiers}
    return (q.in_flight, q.waiting(), dict(q.counters), dict(q.served), tiers, floors)


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(tiers=2), limit=st.integers(1, 4), cost=costs)
def test_dispatch_now_is_push_then_pop(
    scenario: tuple[dict[str, TenantCfg], list[Event]], limit: int, cost: TokenCost
) -> None:
    """The gateway's no-contention fast path leaves exactly the state ``push`` + ``pop`` would, and is
    taken only when nothing waits and the limit has room (else it changes nothing)."""
    tenants, events = scenario
    slow: FairQueue[int] = FairQueue(limit, cost)
    fast: FairQueue[int] = FairQueue(limit, cost)
    in_slow: list[Ticket[int]] = []
    in_fast: list[Ticket[int]] = []
    for kind, tenant, a, b in events:
        if kind == "arrive":
            cfg = tenants[tenant]
            room = slow.waiting() == 0 and slow.in_flight < limit
            before = _state(fast)
            now = fast.dispatch_now(tenant, cfg.rank, cfg.weight, a, b)
            assert (now is not None) == room
            if now is None:
                assert _state(fast) == before
                fast.push(tenant, cfg.rank, cfg.weight, a, b)
            else:
                in_fast.append(now)
            slow.push(tenant, cfg.rank, cfg.weight, a, b)
        elif in_slow:
            i = a % len(in_slow)
            for queue, flight in ((slow, in_slow), (fast, in_fast)):
                ticket = flight.pop(i)
                queue.settle(ticket, ticket.input_tokens, ticket.item)
                queue.finish(ticket)
        in_slow.extend(slow.drain())
        in_fast.extend(fast.drain())
        assert [t.tenant for t in in_slow] == [t.tenant for t in in_fast]
        assert _state(slow) == _state(fast)


def _closed_loop_shares(
    light: int, heavy: int, slots: int, fair: bool, estimate: int = 200, seed: int = 7
) -> dict[str, float]:
    """Closed-loop clients (each sends its next request when its answer ends, as the benchmark's do)
    through a ``FairQueue`` of ``slots``; answers take 1 +- 10% time units and have 200 prompt tokens
    (queued with the gateway's ``estimate`` of them) and 30 output tokens. Weighted service per tenant
    after a warm-up, as a share of the total."""
    rng = random.Random(seed)
    q: FairQueue[str] = FairQueue(slots, fair=fair)
    events: list[tuple[float, int, Ticket[str] | None, str]] = []
    order = itertools.count()
    for tenant, n in (("light", light), ("heavy", heavy)):
        for _ in range(n):
            heapq.heappush(events, (rng.random() * 0.01, next(order), None, tenant))
    served = {"light": 0.0, "heavy": 0.0}
    while events:
        now, _, ticket, tenant = heapq.heappop(events)
        if now > 400:
            break
        if ticket is None:
            q.push(tenant, 0, 1.0, estimate, tenant)
        else:
            q.settle(ticket, 200, 30)
            q.finish(ticket)
            if now > 40:
                served[tenant] += 200 + 2 * 30
            heapq.heappush(events, (now, next(order), None, tenant))  # the client asks again at once
        for dispatched in q.drain():
            done = now + rng.uniform(0.9, 1.1)
            heapq.heappush(events, (done, next(order), dispatched, dispatched.tenant))
    total = sum(served.values())
    return {t: v / total for t, v in served.items()}


def test_closed_loop_clients_of_a_light_tenant_get_its_half() -> None:
    """The fairness benchmark's shape on the core alone: 3 light clients against 15 heavy ones on 4 slots.
    The light tenant's backlog empties whenever all its requests are in flight and it is lifted to the
    floor each time it comes back; still, asking for more than half (3 clients > 2 slots), it gets half
    under VTC, and its share of the clients under FIFO."""
    vtc = _closed_loop_shares(light=3, heavy=15, slots=4, fair=True)
    fifo = _closed_loop_shares(light=3, heavy=15, slots=4, fair=False)
    assert 0.47 <= vtc["light"] <= 0.53, vtc
    assert 0.14 <= fifo["light"] <= 0.19, fifo


def test_closed_loop_light_tenant_keeps_its_half_when_prompt_estimates_are_low() -> None:
    """The gateway's estimate (characters / 4) was 3x below the engine's count in the vLLM benchmark. A
    dispatch charged at the estimate leaves most of each request uncharged while it runs, so the tenant
    with more in flight looks cheaper; charging the learned ratio keeps the light tenant's half (it got
    0.44 when the dispatch charge was the raw estimate)."""
    shares = _closed_loop_shares(light=3, heavy=15, slots=4, fair=True, estimate=70)
    assert 0.47 <= shares["light"] <= 0.53, shares


def test_the_dispatch_charge_learns_the_engines_prompt_count() -> None:
    q: FairQueue[None] = FairQueue(limit=1)
    first = q.push("t", 0, 1.0, 100, None)
    assert q.pop() is first
    assert q.counters["t"] == 100  # nothing learnt yet: the estimate
    q.settle(first, 300, 0)
    q.finish(first)
    assert q.counters["t"] == 300 and q.input_scale["t"] == 3.0
    second = q.push("t", 0, 1.0, 100, None)
    assert q.pop() is second
    assert q.counters["t"] == 600  # charged 3 x the estimate at dispatch
    q.settle(second, 300, 0)  # ... which the engine confirms: no correction
    q.finish(second)
    assert q.counters["t"] == 600
    # One answer that matches its estimate moves the ratio a quarter of the way back.
    third = q.push("t", 0, 1.0, 100, None)
    assert q.pop() is third
    q.settle(third, 100, 0)
    q.finish(third)
    assert q.input_scale["t"] == 3.0 + INPUT_SCALE_SMOOTHING * (1.0 - 3.0)
    # ``undo`` gives back exactly what the dispatch charged.
    fourth = q.push("t", 0, 1.0, 100, None)
    before = q.counters["t"]
    assert q.pop() is fourth
    q.undo(fourth)
    assert q.counters["t"] == before
    assert q.input_scale.get("u") is None  # other tenants are untouched
