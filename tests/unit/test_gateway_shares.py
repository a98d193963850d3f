"""The split of a tenant's rate limits between gateway replicas (gateway/shares.py) and how a gate applies
it (``TenantGate.set_fractions``, the demand it records)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.gateway.admission import GateLimits, TenantGate, Throttled
from kvfleet_runtime.gateway.shared_store import SharedStoreSettings
from kvfleet_runtime.gateway.shares import (
    FLOOR,
    Demand,
    DemandMeter,
    EngineDemand,
    ReplicaReport,
    allocate_engine_slots,
    decode_report,
    demand_fraction,
    encode_report,
    engine_split,
)
from kvfleet_runtime.kv.fairness import FairQueue


@given(st.lists(st.floats(min_value=0, max_value=1e9, allow_nan=False), min_size=1, max_size=8))
def test_the_fractions_of_all_replicas_sum_to_one(demands: list[float]) -> None:
    fractions = [demand_fraction(d, demands[:i] + demands[i + 1 :]) for i, d in enumerate(demands)]
    assert math.isclose(sum(fractions), 1.0, rel_tol=1e-9)
    assert all(f >= FLOOR / len(demands) - 1e-12 for f in fractions)


def test_a_tenant_on_one_replica_gets_almost_all_of_its_limit_there() -> None:
    assert demand_fraction(90, [10]) == pytest.approx(FLOOR / 2 + (1 - FLOOR) * 0.9)
    assert demand_fraction(100, [0, 0, 0]) == pytest.approx(FLOOR / 4 + 1 - FLOOR)
    assert demand_fraction(0, [100, 0, 0]) == pytest.approx(FLOOR / 4)


def test_without_demand_anywhere_the_split_is_even() -> None:
    assert demand_fraction(0, [0, 0]) == pytest.approx(1 / 3)
    assert demand_fraction(0, []) == 1.0


def test_demand_decays_with_its_time_constant_and_idle_tenants_are_forgotten() -> None:
    meter = DemandMeter(tau_s=2.0)
    meter.record("a", now=10.0, requests=1, tokens=100)
    meter.record("a", now=12.0, requests=1, tokens=100)
    snap = meter.snapshot(12.0)["a"]
    assert snap.requests == pytest.approx(1 + math.exp(-1))
    assert snap.tokens == pytest.approx(100 + 100 * math.exp(-1))
    assert "a" in meter.snapshot(30.0)
    assert meter.snapshot(200.0) == {}
    assert meter.snapshot(12.0) == {}  # forgotten, not revived by an earlier clock


def test_a_report_round_trips_and_a_foreign_one_is_refused() -> None:
    report = ReplicaReport(
        {"a": Demand(1.5, 300.0), "b": Demand(0.25, 0.0)},
        {"shared": {"a": EngineDemand(1, 4.0, 12.0)}, "bank": {}},
    )
    assert decode_report(encode_report(report)) == report
    for bad in (
        b"not json",
        b"[1, 2]",
        b'{"a": [1, 2]}',
        b'{"rates": {"a": [1]}, "engines": {}}',
        b'{"rates": {"a": [-1, 2]}, "engines": {}}',
        b'{"rates": {"a": [true, 2]}, "engines": {}}',
        b'{"rates": {}, "engines": {"p": {"a": [1, 0, 3]}}}',
        b'{"rates": {}, "engines": {"p": [1]}}',
    ):
        with pytest.raises(ValueError, match="not a replica report"):
            decode_report(bad)


def d(requests: float, weight: float = 1.0, rank: int = 1) -> EngineDemand:
    return EngineDemand(rank, weight, requests)


def test_engine_slots_go_by_weight_among_tenants_that_ask_for_more_than_their_part() -> None:
    assert allocate_engine_slots(20, {"a": d(24), "b": d(24, 4)}) == pytest.approx({"a": 4, "b": 16})
    # One asks less than its weighted part: it gets what it asks, the others share the rest by weight.
    got = allocate_engine_slots(20, {"a": d(2), "b": d(50), "c": d(50, 2)})
    assert got == pytest.approx({"a": 2, "b": 6, "c": 12})
    # A higher SLA rank is served first, whatever the weights below it.
    got = allocate_engine_slots(10, {"p": d(7, rank=2), "b": d(50, 9), "c": d(50)})
    assert got == pytest.approx({"p": 7, "b": 2.7, "c": 0.3})
    assert allocate_engine_slots(10, {"a": d(3)}) == {"a": 3}


@given(
    st.dictionaries(
        st.sampled_from("abcdef"),
        st.tuples(st.integers(0, 2), st.floats(0.1, 10), st.floats(0, 100)),
        max_size=6,
    ),
    st.integers(1, 200),
)
def test_the_engines_are_never_given_more_than_they_hold_nor_a_tenant_more_than_it_asks(
    raw: dict[str, tuple[int, float, float]], capacity: int
) -> None:
    demands = {t: EngineDemand(r, w, n) for t, (r, w, n) in raw.items()}
    got = allocate_engine_slots(capacity, demands)
    assert sum(got.values()) <= capacity + 1e-6
    assert all(got[t] <= demands[t].requests + 1e-9 for t in got)


def test_skewed_ingress_moves_the_engines_to_the_replica_of_the_heavier_weight() -> None:
    """Tenant a (weight 1) only on replica 1, b (weight 4) only on replica 2, each with 24 requests
    waiting or running: of the pool's 2 x 10 slots replica 1 takes 4, replica 2 takes 16."""
    r1, r2 = {"a": d(24)}, {"b": d(24, 4)}
    assert (engine_split(10, r1, [r2])[0], engine_split(10, r2, [r1])[0]) == (4, 16)
    # What nobody asks for is split evenly; a replica with nothing to send keeps at least one slot.
    assert (engine_split(10, {"a": d(3)}, [{}])[0], engine_split(10, {}, [{"a": d(3)}])[0]) == (12, 9)
    assert engine_split(10, {}, [{"a": d(50)}])[0] == 1
    # A tenant on both replicas: its allocation follows where its requests are.
    both1, both2 = {"a": d(30), "b": d(10, 4)}, {"b": d(30, 4)}
    assert engine_split(10, both1, [both2])[0] + engine_split(10, both2, [both1])[0] == 20


def test_the_queue_reports_each_tenants_requests_waiting_and_running() -> None:
    queue: FairQueue[None] = FairQueue(2)
    running = [queue.dispatch_now("a", 1, 2.0, 10, None), queue.dispatch_now("b", 0, 1.0, 10, None)]
    queue.push("a", 1, 2.0, 10, None)
    queue.push("c", 1, 3.0, 10, None)
    assert queue.demand() == {"a": (1, 2.0, 2), "b": (0, 1.0, 1), "c": (1, 3.0, 1)}
    for ticket in running:
        assert ticket is not None
        queue.finish(ticket)
    assert queue.demand() == {"a": (1, 2.0, 1), "c": (1, 3.0, 1)}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_gate_enforces_its_fraction_of_the_limit_and_its_static_share_without_one() -> None:
    clock = Clock()
    asked: list[tuple[float, float]] = []
    gate = TenantGate(
        GateLimits(requests_per_minute=600, tokens_per_minute=60_000, replicas=2),
        clock=clock,
        demand=lambda r, t: asked.append((r, t)),
    )
    assert gate.rpm is not None and gate.tpm is not None
    assert (gate.rpm.capacity, gate.tpm.capacity) == (300, 30_000)
    gate.set_fractions((0.9, 0.5))
    assert (gate.rpm.capacity, gate.tpm.capacity) == pytest.approx((540, 30_000))
    assert gate.rpm.rate == pytest.approx(9.0)
    gate.set_fractions(None)
    assert (gate.rpm.capacity, gate.tpm.capacity) == (300, 30_000)
    # Every request that reaches the buckets is demand, admitted or not; one refused before its body
    # was read counts as a request without tokens.
    assert gate._admit_now(100, 10) is not None
    gate.set_fractions((0.001, 0.5))  # 0.6 requests per minute: the full bucket still admits one
    assert gate._admit_now(100, 10) is not None
    clock.now += 0.001
    with pytest.raises(Throttled, match="shared by the gateway replicas"):
        gate.check_request_rate()
    assert asked == [(1.0, 100.0), (1.0, 100.0), (1.0, 0.0)]


def test_store_settings_refuse_what_cannot_fall_back_within_a_second() -> None:
    with pytest.raises(ValueError, match="redis://"):
        SharedStoreSettings(url="http://store:6379")
    with pytest.raises(ValueError, match="at most a third of the fallback delay"):
        SharedStoreSettings(url="redis://store:6379", sync_interval_s=0.5)


def test_each_tenants_part_caps_it_while_another_under_its_part_waits() -> None:
    """``engine_split`` gives each tenant here its part of the replica's limit; the queue serves a tenant
    under its part before one at it, and never leaves a slot idle when all are at theirs."""
    limit, parts = engine_split(10, {"a": d(18), "b": d(2, 4)}, [{"a": d(2), "b": d(18, 4)}])
    assert (limit, parts) == (5, {"a": 4, "b": 2})  # 3.6 and 1.6, each rounded half up
    queue: FairQueue[None] = FairQueue(2)
    queue.caps = {"a": 1}
    first = queue.dispatch_now("a", 1, 1.0, 10, None)
    assert first is not None
    queue.push("a", 1, 1.0, 1, None)  # the oldest waiting ticket, and a has the smaller counter...
    queue.push("b", 1, 1.0, 100, None)
    ticket = queue.pop()
    assert ticket is not None and ticket.tenant == "b"  # ...but a is at its part
    queue.finish(ticket)
    ticket = queue.pop()
    assert ticket is not None and ticket.tenant == "a"  # everyone left is at its part: no idle slot
