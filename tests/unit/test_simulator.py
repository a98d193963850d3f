"""Simulator tests: the replay model, the tiers, the policies compared, the workloads, the CLI, the charts."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import (
    Isolation,
    KVQuota,
    KVTier,
    SlaTier,
    TenantEntry,
    TierTTLs,
)
from kvfleet_runtime.kv.placement import build_hash_ring
from kvfleet_runtime.kv.simulate_cli import build_table_tenants, run_simulate
from kvfleet_runtime.kv.simulator import (
    POLICIES,
    FleetEvent,
    FleetSpec,
    RoutingSpec,
    SimulatedTenant,
    TenantReport,
    compute_unit_keys,
    simulate,
)
from kvfleet_runtime.kv.workloads import (
    Request,
    TenantLoad,
    build_multi_round_qa,
    build_noisy_neighbour,
    build_rag_chat,
    read_jsonl_trace,
    write_jsonl_trace,
)

UNIT = 16


def req(t: float, tenant: str, segments: list[tuple[int, int]], out: int = 0, session: str = "s") -> Request:
    return Request(t, tenant, session, tuple(segments), out, 10_000 + int(t * 1000))


def test_unit_keys_chain_over_segments_and_salt() -> None:
    a, tail_a = compute_unit_keys(1, [(7, 40)], UNIT)
    b, tail_b = compute_unit_keys(1, [(7, 32), (9, 8)], UNIT)
    c, _ = compute_unit_keys(2, [(7, 40)], UNIT)
    assert len(a) == 2
    assert tail_a == tail_b == 8
    assert a == b[:2]  # same first 32 tokens -> same two units, whatever follows
    assert not set(a) & set(c)  # another salt never shares a unit


def test_repeated_prompt_hits_after_the_first_request_and_classifies_tokens() -> None:
    fleet = FleetSpec(replicas=1, unit_tokens=UNIT, hbm_units_per_replica=100, prefill_tokens_per_second=1000)
    reqs = [req(0.0, "a", [(1, 64)]), req(10.0, "a", [(1, 64), (2, 20)])]
    result = simulate(reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")])
    report = result.tenants["a"]
    assert report.prompt_tokens == 148
    assert report.hit_tokens["hbm"] == 64
    assert report.new_tokens == 84  # 64 first time + 20 (one unit of 16 and a partial 4)
    assert report.recomputed_tokens == 0
    assert report.ttft_p99_ms == pytest.approx(64.0)  # 64 computed tokens at 1000 tok/s


def test_evicted_prefix_counts_as_recompute_and_offload_tier_recovers_it() -> None:
    fleet = FleetSpec(replicas=1, unit_tokens=UNIT, hbm_units_per_replica=4, cpu_units_per_replica=8)
    reqs = [
        req(0.0, "a", [(1, 64)]),  # fills HBM
        req(10.0, "a", [(2, 64)]),  # evicts it
        req(20.0, "a", [(1, 64)]),
    ]
    only_hbm = simulate(reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")]).tenants["a"]
    assert only_hbm.recomputed_tokens == 64
    with_cpu = simulate(reqs, fleet, POLICIES["lmcache"], [SimulatedTenant("a")]).tenants["a"]
    assert with_cpu.recomputed_tokens == 0
    assert with_cpu.hit_tokens["cpu"] == 64
    assert with_cpu.evictions["hbm"]["lru"] >= 4


def test_nvme_catches_what_cpu_drops() -> None:
    fleet = FleetSpec(
        replicas=1,
        unit_tokens=UNIT,
        hbm_units_per_replica=4,
        cpu_units_per_replica=4,
        nvme_units_per_replica=16,
    )
    reqs = [req(float(i * 10), "a", [(i + 1, 64)]) for i in range(3)] + [req(40.0, "a", [(1, 64)])]
    report = simulate(reqs, fleet, POLICIES["lmcache"], [SimulatedTenant("a")]).tenants["a"]
    assert report.hit_tokens["nvme"] == 64
    assert report.recomputed_tokens == 0


def test_session_affinity_spreads_sessions_and_distributed_tier_is_shared() -> None:
    fleet = FleetSpec(replicas=2, unit_tokens=UNIT, hbm_units_per_replica=4, cpu_units_per_replica=4)
    result = simulate([], fleet, POLICIES["distributed"], [SimulatedTenant("a")])
    assert result.capacity == {"hbm": 8, "cpu": 8, "nvme": 0}
    local = simulate([], fleet, POLICIES["lmcache"], [SimulatedTenant("a")])
    assert local.capacity == {"hbm": 8, "cpu": 8, "nvme": 0}


def test_kvfleet_protects_a_quiet_tenant_from_a_flood_where_lru_does_not() -> None:
    # Noisy requests in flight pin ~10 qps x 1.8 s x 16 units = 288 of the 1024 units; the quiet tenant's
    # 10 prompts of 16 units are within its quota of 512.
    fleet = FleetSpec(replicas=1, unit_tokens=256, hbm_units_per_replica=1024)
    quiet = [TenantLoad("quiet", 10)]
    reqs = build_noisy_neighbour(quiet, "noisy", 300.0, quiet_interval_seconds=1.0, noisy_qps=10.0)
    specs = [SimulatedTenant("quiet", share=0.5), SimulatedTenant("noisy", SlaTier.BASIC, share=0.2)]
    lru = simulate(reqs, fleet, POLICIES["lru"], specs, warmup_seconds=60).tenants["quiet"]
    kvfleet = simulate(reqs, fleet, POLICIES["kvfleet"], specs, warmup_seconds=60)
    assert lru.hit_rate < 0.1
    assert kvfleet.tenants["quiet"].hit_rate > 0.95
    assert kvfleet.tenants["noisy"].evictions["hbm"].get("over_quota", 0) > 0
    assert "hbm" not in kvfleet.tenants["quiet"].evictions


def test_governed_tiers_evict_idle_entries_by_ttl() -> None:
    fleet = FleetSpec(replicas=1, unit_tokens=UNIT, hbm_units_per_replica=4)
    spec = SimulatedTenant("a", share=1.0)
    reqs = [req(0.0, "a", [(1, 64)]), req(100.0, "a", [(2, 64)])]
    result = simulate(reqs, fleet, POLICIES["kvfleet"], [spec])
    assert result.tenants["a"].evictions["hbm"] == {"ttl": 4}


def test_occupancy_and_hit_rate_timelines_are_sampled() -> None:
    fleet = FleetSpec(replicas=1, unit_tokens=UNIT, hbm_units_per_replica=100)
    reqs = [req(float(t), "a", [(1, 64)]) for t in range(0, 300, 10)]
    result = simulate(reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")], sample_seconds=60)
    assert result.times[:3] == [0.0, 60.0, 120.0]
    assert result.occupancy["hbm"]["a"][-1] == 4
    timeline = result.hit_rate_timeline["a"]
    assert timeline[0] is not None
    assert timeline[0] < timeline[-1]  # the first request of the run misses


def test_rag_chat_workload_has_the_design_doc_shape() -> None:
    reqs = build_rag_chat([TenantLoad("t", 3, think_seconds=30.0)], duration_seconds=2000.0, seed=4)
    assert reqs == sorted(reqs, key=lambda r: (r.time, r.tenant, r.session))
    first_turns = [r for r in reqs if len(r.segments) == 3]
    assert first_turns
    assert all(r.prompt_tokens == 1536 + 8192 + 200 for r in first_turns)
    by_session: dict[str, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert max(len(v) for v in by_session.values()) == 6
    second = next(v[1] for v in by_session.values() if len(v) > 1)
    assert second.segments[:3] == by_session[second.session][0].segments
    assert second.segments[3] == (by_session[second.session][0].output_segment, 250)
    assert build_rag_chat([TenantLoad("t", 3, 30.0)], 2000.0, seed=4) == reqs


def test_multi_round_qa_grows_history_and_shares_the_system_prompt() -> None:
    reqs = build_multi_round_qa([TenantLoad("t", 4)], rounds=3, qps=1.0)
    assert len(reqs) == 12
    assert len({r.segments[0] for r in reqs}) == 1
    user = [r for r in reqs if r.session == "t/0"]
    assert [len(r.segments) for r in user] == [3, 5, 7]


def test_jsonl_trace_round_trips_and_reports_bad_lines(tmp_path: Path) -> None:
    reqs = build_rag_chat([TenantLoad("t", 2, 20.0)], duration_seconds=200.0)
    path = tmp_path / "trace.jsonl"
    write_jsonl_trace(reqs, path)
    assert read_jsonl_trace(path, unit_tokens=256) == reqs
    blocks = tmp_path / "blocks.jsonl"
    blocks.write_text('{"time": 1, "tenant": "x", "blocks": ["h1", "h2"]}\n')
    (only,) = read_jsonl_trace(blocks, unit_tokens=16)
    assert only.prompt_tokens == 32
    assert only.session == "x"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"time": 1, "tenant": "x", "segments": [["a", 0]]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_jsonl_trace(bad, unit_tokens=16)


def _run(argv: list[str]) -> tuple[int, str, str]:
    args = build_parser().parse_args(["simulate", *argv])
    out, err = io.StringIO(), io.StringIO()
    return run_simulate(args, out, err), out.getvalue(), err.getvalue()


def test_cli_uses_the_planner_and_prints_json(tmp_path: Path) -> None:
    code, out, err = _run(
        [
            "--preset", "qwen2.5-72b", "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--gpus", "8",
            "--gpus-per-replica", "2", "--tensor-parallel", "2", "--gpu-memory", "141GB",
            "--cpu-tier", "64GiB", "--nvme-tier", "512GiB", "--workload", "noisy-neighbour",
            "--tenant", "a:standard:0.4:5", "--duration", "120", "--warmup", "30", "--policy", "all",
            "--output", "json", "--plot", str(tmp_path / "charts"),
        ]
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["fleet"]["replicas"] == 4
    # FP8 Qwen2.5-72B: 80 layers x 8 KV heads x 128 x 2 x 1 byte = 160 KiB per token per replica
    assert doc["fleet"]["offload_bytes_per_token"] == 163_840
    assert doc["fleet"]["cpu_units_per_replica"] == 64 * 2**30 // (163_840 * 256)
    assert [r["policy"] for r in doc["results"]] == list(POLICIES)
    assert set(doc["results"][0]["tenants"]) == {"a", "noisy"}
    charts = sorted(p.name for p in (tmp_path / "charts").iterdir())
    assert "kvfleet-hit-rate.png" in charts
    assert "lru-occupancy.png" in charts
    assert (tmp_path / "charts" / "lru-occupancy.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_table_with_direct_capacities() -> None:
    code, out, _ = _run(
        ["--hbm-tokens", "64K", "--workload", "multi-round-qa", "--tenant", "x:premium:1:4", "--rounds", "3"]
    )
    assert code == 0
    assert "policy lru" in out
    assert "policy kvfleet" in out
    assert out.count("\nx ") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "rag-chat"], "no capacity"),
        (["--hbm-tokens", "1M", "--policy", "magic"], "unknown"),
        (["--hbm-tokens", "1M", "--tenant", "a:gold:0.5:3"], "a:gold"),
        (["--hbm-tokens", "1M", "--tenant", "a:premium:2:3"], "SHARE"),
        (["--preset", "qwen2.5-72b", "--gpus", "8", "--gpus-per-replica", "3"], "multiple"),
    ],
)
def test_cli_rejects_bad_input_with_exit_code_2(argv: list[str], message: str) -> None:
    code, _, err = _run(argv)
    assert code == 2
    assert message in err
    assert err.startswith("kvfleet simulate: error:")


def test_cli_takes_capacities_and_tenants_from_a_rendered_tenant_table(tmp_path: Path) -> None:
    def tenant(name: str, tier: SlaTier, quota: KVQuota, isolation: Isolation, salt_id: str) -> TenantEntry:
        return tenant_entry(
            name,
            tier=tier,
            priority=0,
            isolation=isolation,
            salt_id=salt_id,
            quota=quota,
            ttl=TierTTLs(hbm_seconds=15.0),
        )

    table = tenant_table(
        tenant(
            "bank",
            SlaTier.PREMIUM,
            KVQuota(hbm_blocks=1024, hbm_burst_blocks=2048, cpu_bytes=2**28),
            Isolation.SALTED,
            "bank",
        ),
        tenant(
            "shop", SlaTier.BASIC, KVQuota(hbm_blocks=512, hbm_burst_blocks=512), Isolation.SHARED, "pool"
        ),
        pools=[
            pool_entry(
                endpoints=["http://a:8000", "http://b:8000"],
                hbm_blocks=4096,
                cpu_bytes_per_replica=2**30,
                burst_cap=0.4,
            )
        ],
        model_deployment="md",
    )
    path = tmp_path / "tenants.json"
    path.write_text(table.model_dump_json())
    common = ["--tenant-table", str(path), "--unit-tokens", "64", "--duration", "300", "--warmup", "60"]
    code, _, err = _run(common)
    assert code == 2
    assert "--kv-bytes-per-token" in err
    code, out, err = _run(
        [*common, "--kv-bytes-per-token", "4096", "--sessions-per-tenant", "3", "--output", "json"]
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["fleet"]["replicas"] == 2
    assert doc["fleet"]["hbm_units_per_replica"] == 4096 * 16 // 64
    assert doc["fleet"]["cpu_units_per_replica"] == 2**30 // (4096 * 64)
    assert set(doc["results"][0]["tenants"]) == {"bank", "shop"}
    specs = {s.name: s for s in build_table_tenants(build_parser().parse_args(["simulate", *common]))}
    assert specs["bank"].share == 0.25
    assert specs["bank"].share_of(KVTier.CPU) == 0.25
    assert specs["shop"].share_of(KVTier.CPU) == 0.0
    assert specs["shop"].salt == "pool"
    assert specs["bank"].ttl.hbm_seconds == 15.0
    assert specs["bank"].burst_cap == 0.4


def _spilled_session_comes_back(routing: RoutingSpec) -> TenantReport:
    """Three sessions of one tenant share a system prompt (its affinity key); the third arrives while the
    affinity replica is at the load bound and spills to the other one; its second turn comes back when
    the fleet is idle."""
    fleet = FleetSpec(replicas=2, unit_tokens=UNIT, hbm_units_per_replica=1000)
    system = (1, 64)
    reqs = [
        Request(0.0, "a", "s1", (system, (11, 64)), 0, 101, duration=8.0),
        Request(1.0, "a", "s2", (system, (12, 64)), 0, 102, duration=8.0),
        Request(2.0, "a", "s3", (system, (13, 64)), 0, 103, duration=1.0),
        Request(10.0, "a", "s3", (system, (13, 64), (14, 16)), 0, 104, duration=1.0),
    ]
    return simulate(reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")], routing=routing).tenants["a"]


def test_affinity_routes_by_the_salted_prefix_and_precise_follows_what_a_gpu_holds() -> None:
    # Both: the spilled first turn computes the system prompt again on the other replica (64).
    affinity = _spilled_session_comes_back(RoutingSpec("affinity", affinity_tokens=UNIT))
    # Back on the affinity replica: the session's document is on the other one, computed again.
    assert affinity.recomputed_tokens == 64 + 64
    assert affinity.hit_tokens["hbm"] == 64 + 64  # s2's and the second turn's system prompt
    precise = _spilled_session_comes_back(RoutingSpec("precise", affinity_tokens=UNIT))
    # The replica holding system prompt + document (8 units against 4) wins: all 128 tokens hit.
    assert precise.recomputed_tokens == 64
    assert precise.hit_tokens["hbm"] == 64 + 128


def test_fleet_events_restart_a_replica_and_add_one() -> None:
    fleet = FleetSpec(replicas=2, unit_tokens=UNIT, hbm_units_per_replica=100)
    # Session routing on the replicas present: a session hashed to replica 1 goes to 0 before 1 joins.
    ring = build_hash_ring(["0", "1"])
    late = next(s for s in (f"s{i}" for i in range(100)) if ring.walk(s.encode())[0] == "1")
    reqs = [req(0.0, "a", [(1, 64)], session=late), req(10.0, "a", [(1, 64)], session=late)]
    steady = simulate(reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")]).tenants["a"]
    assert steady.recomputed_tokens == 0 and steady.hit_tokens["hbm"] == 64
    added = simulate(
        reqs, fleet, POLICIES["lru"], [SimulatedTenant("a")], events=[FleetEvent(5.0, "add", 1)]
    ).tenants["a"]
    assert added.recomputed_tokens == 64  # moved to the new replica, which holds nothing
    restarted = simulate(
        reqs, fleet, POLICIES["lmcache"], [SimulatedTenant("a")], events=[FleetEvent(5.0, "restart", 1)]
    ).tenants["a"]
    assert restarted.recomputed_tokens == 64  # its GPU and its own CPU tier are gone
    shared = FleetSpec(replicas=2, unit_tokens=UNIT, hbm_units_per_replica=4, cpu_units_per_replica=8)
    evicted = [req(0.0, "a", [(1, 64)], session=late), req(1.0, "a", [(2, 64)], session=late)]
    survived = simulate(
        [*evicted, req(10.0, "a", [(1, 64)], session=late)],
        shared,
        POLICIES["distributed"],
        [SimulatedTenant("a")],
        events=[FleetEvent(5.0, "restart", 1)],
    ).tenants["a"]
    assert survived.recomputed_tokens == 0 and survived.hit_tokens["cpu"] == 64  # a shared tier stays


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([FleetEvent(1.0, "reboot", 0)], "kind must be one of add, restart"),
        ([FleetEvent(1.0, "restart", 2)], "replica in 0..1"),
        ([FleetEvent(1.0, "add", 0), FleetEvent(2.0, "add", 1)], "keep one replica from the start"),
    ],
)
def test_bad_fleet_events_and_routings_are_refused(events: list[FleetEvent], message: str) -> None:
    fleet = FleetSpec(replicas=2, unit_tokens=UNIT, hbm_units_per_replica=10)
    with pytest.raises(ValueError, match=message):
        simulate([], fleet, POLICIES["lru"], [SimulatedTenant("a")], events=events)
    with pytest.raises(ValueError, match="use one of session, affinity, precise"):
        RoutingSpec("nearest")
