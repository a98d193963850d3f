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
    decode_demands,
    demand_fraction,
    encode_demands,
)


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


def test_a_payload_round_trips_and_a_foreign_one_is_refused() -> None:
    demands = {"a": Demand(1.5, 300.0), "b": Demand(0.25, 0.0)}
    assert decode_demands(encode_demands(demands)) == demands
    for bad in (b"not json", b"[1, 2]", b'{"a": [1]}', b'{"a": [-1, 2]}', b'{"a": [true, 2]}', b'{"a": "x"}'):
        with pytest.raises(ValueError, match="not a demand payload"):
            decode_demands(bad)


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
