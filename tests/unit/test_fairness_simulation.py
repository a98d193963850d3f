"""``kvfleet simulate --fair-queuing``: the fair queue replayed in front of a fleet's slots."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import SlaTier
from kvfleet_runtime.kv.simulate_cli import run_simulate
from kvfleet_runtime.kv.simulator import (
    FairTenant,
    FleetSpec,
    build_fair_workload,
    jain_index,
    simulate_fair_queuing,
    weighted_max_min_shares,
)

FLEET = FleetSpec(replicas=2, unit_tokens=1, hbm_units_per_replica=0, decode_tokens_per_second=40.0)


def test_jain_index() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == 1.0
    assert jain_index([1.0, 0.0]) == 0.5
    assert jain_index([5.0, 1.0]) == pytest.approx(36 / 52)


def test_weighted_max_min_shares_cap_each_tenant_at_its_demand() -> None:
    shares = weighted_max_min_shares({"a": 10.0, "b": 100.0, "c": 100.0}, {"a": 1, "b": 1, "c": 2}, 100.0)
    assert shares["a"] == 10.0  # asks less than a third: gets what it asks
    assert shares["b"] == pytest.approx(30.0) and shares["c"] == pytest.approx(60.0)


def test_vtc_shares_an_overloaded_fleet_where_fifo_follows_the_arrivals() -> None:
    # 2 replicas x 4 slots, about 8 / (0.0125 + 6.4) = 1.25 requests/s; both tenants above their half.
    requests = build_fair_workload({"light": 1.0, "heavy": 5.0}, 400.0, (256, 256), (256, 256), seed=1)
    tenants = [FairTenant("light"), FairTenant("heavy")]
    runs = {
        fair: simulate_fair_queuing(
            requests, FLEET, tenants, slots_per_replica=4, fair=fair, warmup_seconds=60
        )
        for fair in (False, True)
    }
    fifo, vtc = runs[False], runs[True]
    assert fifo.jain_weighted_service < 0.8
    assert vtc.jain_weighted_service > 0.95
    light, heavy = vtc.tenants["light"], vtc.tenants["heavy"]
    assert light.weighted_tokens_per_s == pytest.approx(heavy.weighted_tokens_per_s, rel=0.1)
    # Refused after the wait bound, never dropped: every arrival after the warm-up is served or refused.
    for report in (*fifo.tenants.values(), *vtc.tenants.values()):
        assert report.served + report.refused >= report.arrived


def test_weights_and_tiers_in_the_simulation() -> None:
    requests = build_fair_workload({"w1": 3.0, "w3": 3.0, "vip": 0.3}, 300.0, (256, 256), (256, 256), seed=2)
    tenants = [FairTenant("w1"), FairTenant("w3", weight=3.0), FairTenant("vip", sla=SlaTier.PREMIUM)]
    vtc = simulate_fair_queuing(requests, FLEET, tenants, slots_per_replica=4, fair=True, warmup_seconds=60)
    ratio = vtc.tenants["w3"].weighted_tokens_per_s / vtc.tenants["w1"].weighted_tokens_per_s
    assert 2.6 < ratio < 3.4, ratio
    assert vtc.tenants["vip"].refused == 0
    assert vtc.tenants["vip"].ttft_p99_ms < vtc.tenants["w3"].ttft_p99_ms


def test_cli_runs_both_modes_on_a_scenario() -> None:
    args = build_parser().parse_args(
        [
            "simulate",
            "--fair-queuing",
            "fifo,vtc",
            "--replicas",
            "1",
            "--slots-per-replica",
            "8",
            "--duration",
            "200",
            "--warmup",
            "50",
            "--output",
            "json",
        ]
    )
    out = io.StringIO()
    assert run_simulate(args, out) == 0
    doc = json.loads(out.getvalue())
    assert [r["mode"] for r in doc["results"]] == ["fifo", "vtc"]
    assert doc["results"][1]["jain_weighted_service"] > doc["results"][0]["jain_weighted_service"]


def test_cli_refuses_an_unknown_mode() -> None:
    args = build_parser().parse_args(["simulate", "--fair-queuing", "wfq"])
    err = io.StringIO()
    assert run_simulate(args, io.StringIO(), err) == 2
    assert "fifo, vtc" in err.getvalue()


def _scenario(name: str) -> list[dict[str, Any]]:
    """Both modes of a built-in scenario on 2 replicas x 16 slots (about 5 requests/s), 400 s."""
    argv = ["simulate", "--fair-queuing", "fifo,vtc", "--fair-scenario", name, "--replicas", "2"]
    argv += ["--slots-per-replica", "16", "--duration", "400", "--warmup", "60", "--output", "json"]
    out = io.StringIO()
    assert run_simulate(build_parser().parse_args(argv), out) == 0
    results: list[dict[str, Any]] = json.loads(out.getvalue())["results"]
    return results


def test_gaie_eight_identical_tenants_get_equal_shares_under_vtc() -> None:
    # GAIE #1801 scenario 3: eight tenants of one tier at 0.25 x capacity each (the fleet twice over).
    fifo, vtc = _scenario("gaie-8-tenants")
    tenants = vtc["tenants"]
    assert isinstance(tenants, dict) and len(tenants) == 8
    assert vtc["jain_weighted_service"] >= 0.95
    served = [float(t["weighted_tokens_per_s"]) for t in tenants.values()]
    mean = sum(served) / len(served)
    assert all(abs(s - mean) / mean < 0.1 for s in served), served
    # Symmetric demand: FIFO is also even here; VTC must not cost total service.
    fifo_tenants = fifo["tenants"]
    assert isinstance(fifo_tenants, dict)
    fifo_total = sum(float(t["weighted_tokens_per_s"]) for t in fifo_tenants.values())
    assert sum(served) == pytest.approx(fifo_total, rel=0.05)


def test_gaie_eight_skewed_tenants_get_max_min_shares_under_vtc_not_fifo() -> None:
    fifo, vtc = _scenario("gaie-8-tenants-skewed")
    assert float(vtc["jain_fair_share"]) >= 0.95
    assert float(fifo["jain_fair_share"]) < 0.8
    tenants = vtc["tenants"]
    assert isinstance(tenants, dict)
    # The two tenants under their eighth (0.05 x capacity) are served all they ask, without refusals.
    assert tenants["t1"]["refused"] == 0 and tenants["t2"]["refused"] == 0
    # The heaviest (1.6 x) gets no more than the ones at 0.2 x: both are capped at the same fair share.
    assert tenants["t8"]["weighted_tokens_per_s"] == pytest.approx(
        tenants["t5"]["weighted_tokens_per_s"], rel=0.1
    )


def test_gaie_single_tenant_saturation_vtc_orders_as_fifo() -> None:
    # GAIE #1801 scenario 1 with one tenant: the fair queue has nobody to reorder against, so VTC serves
    # exactly what FIFO serves, request for request; past saturation the queue timeout refuses the excess.
    fifo, vtc = _scenario("gaie-single-saturation")
    assert fifo["tenants"] == vtc["tenants"]
    tenants = vtc["tenants"]
    assert isinstance(tenants, dict)
    assert tenants["only"]["refused"] > 0
