"""The gateway's pure core: token buckets, tenant gates, the bounded-load ring, the request rewrite."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway_support import TenantRow, build_keys, build_table
from kvfleet_runtime.cli import main
from kvfleet_runtime.config import KeyFile, TenantTable
from kvfleet_runtime.config_watch import describe_error
from kvfleet_runtime.gateway.admission import GateLimits, TenantGate, Throttled, TokenBucket
from kvfleet_runtime.gateway.cli import parse_listen
from kvfleet_runtime.gateway.rewrite import (
    STRIPPED_BODY_FIELDS,
    BadRequest,
    Endpoint,
    build_request_id,
    build_upstream_body,
    compute_prompt_estimate,
    parse_request,
    parse_tenant_from_request_id,
)
from kvfleet_runtime.gateway.routing import build_pool_router
from kvfleet_runtime.gateway.state import AuthFailure, build_snapshot
from kvfleet_runtime.kv.placement import build_hash_ring, compute_load_cap, select_replica


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- token bucket ---------------------------------------------------------------------------------------
def test_bucket_refuses_with_the_wait_until_it_fits_and_refills_continuously() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, clock)  # one per second
    for _ in range(60):
        assert bucket.try_take(1) == 0
    assert bucket.try_take(1) == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.try_take(1) == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.try_take(1) == 0
    clock.now += 3600
    assert bucket.try_take(60) == 0  # a long idle time refills to capacity, never above it
    assert bucket.try_take(1) > 0


def test_bucket_oversize_request_only_when_full_and_leaves_debt() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100, clock)
    assert bucket.try_take(250) == 0  # full: admitted into debt
    assert bucket.level == -150
    assert bucket.try_take(250) == pytest.approx((100 + 150) / (100 / 60))
    bucket.adjust(-1000)  # refunds never exceed capacity
    assert bucket.level == 100


# -- tenant gate ----------------------------------------------------------------------------------------
async def test_gate_tokens_refusal_does_not_spend_a_request() -> None:
    clock = FakeClock()
    gate = TenantGate(GateLimits(requests_per_minute=2, tokens_per_minute=100), clock)
    (await gate.acquire(60, 1)).release()
    with pytest.raises(Throttled) as info:
        await gate.acquire(60, 1)
    assert info.value.reason == "tokens_per_minute"
    assert info.value.retry_after == pytest.approx(20 / (100 / 60))
    assert info.value.retry_after_header == "12"
    assert gate.rpm is not None and gate.rpm.level == pytest.approx(1)


async def test_gate_queues_fifo_and_times_out_with_a_reason() -> None:
    gate = TenantGate(GateLimits(max_concurrent=1, max_queue=2, max_queue_wait_s=0.2))
    first = await gate.acquire(1, 1)
    order: list[int] = []

    async def waiter(i: int) -> None:
        adm = await gate.acquire(1, 1)
        order.append(i)
        await asyncio.sleep(0.01)
        adm.release()

    tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Throttled) as full:
        await gate.acquire(1, 1)
    assert full.value.reason == "concurrency" and "queue is full" in full.value.message
    first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1]
    assert gate.in_flight == 0 and gate.queued == 0
    held = await gate.acquire(1, 1)
    with pytest.raises(Throttled) as late:
        await gate.acquire(1, 1)
    assert "waited 0.2 s" in late.value.message
    held.release()
    assert gate.in_flight == 0


async def test_gate_kv_budget_admits_a_lone_oversize_request_and_blocks_the_next() -> None:
    gate = TenantGate(GateLimits(kv_budget_tokens=100, max_queue_wait_s=0.05))
    big = await gate.acquire(500, 500)  # alone: admitted, it cannot starve
    with pytest.raises(Throttled) as info:
        await gate.acquire(10, 10)
    assert info.value.reason == "kv_budget"
    big.release()
    a = await gate.acquire(60, 60)
    b = await gate.acquire(40, 40)
    assert gate.kv_in_flight == 100
    a.release()
    b.release()
    b.release()  # idempotent
    assert gate.kv_in_flight == 0 and gate.in_flight == 0


async def test_gate_cancelled_waiter_leaves_no_trace() -> None:
    gate = TenantGate(GateLimits(max_concurrent=1, max_queue_wait_s=5))
    held = await gate.acquire(1, 1)
    task = asyncio.create_task(gate.acquire(1, 1))
    await asyncio.sleep(0.01)
    assert gate.queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held.release()
    assert gate.in_flight == 0 and gate.queued == 0


async def test_gate_limits_change_on_reload_and_wake_waiters() -> None:
    gate = TenantGate(GateLimits(max_concurrent=1, max_queue_wait_s=5))
    held = await gate.acquire(1, 1)
    task = asyncio.create_task(gate.acquire(1, 1))
    await asyncio.sleep(0.01)
    gate.update_limits(GateLimits(max_concurrent=2, max_queue_wait_s=5))
    second = await asyncio.wait_for(task, 1)
    assert gate.in_flight == 2
    held.release()
    second.release()


# -- routing --------------------------------------------------------------------------------------------
REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(5)]


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=64),
    loads=st.lists(st.integers(0, 50), min_size=5, max_size=5),
    healthy=st.sets(st.sampled_from(REPLICAS), min_size=1),
)
def test_bounded_load_never_picks_a_replica_over_the_cap(
    key: bytes, loads: list[int], healthy: set[str]
) -> None:
    ring = build_hash_ring(REPLICAS)
    load_map = dict(zip(REPLICAS, loads, strict=True))
    choice = select_replica(ring, key, healthy=healthy, loads=load_map, load_factor=1.25)
    assert choice in healthy
    order = [r for r in ring.walk(key) if r in healthy]
    cap = compute_load_cap(load_map, order, 1.25)
    assert load_map[choice] < cap
    # It is the first under-cap replica in ring order: affinity wins whenever load allows.
    assert choice == next(r for r in order if load_map[r] < cap)


def test_ring_is_stable_and_moves_few_keys_when_a_replica_joins() -> None:
    keys = [f"salt\x00prompt {i}".encode() for i in range(2000)]
    before = build_hash_ring(REPLICAS[:4])
    after = build_hash_ring(REPLICAS)
    zero = dict.fromkeys(REPLICAS, 0)
    pick = lambda ring, k: select_replica(ring, k, healthy=set(REPLICAS), loads=zero)  # noqa: E731
    assert [pick(before, k) for k in keys] == [pick(build_hash_ring(REPLICAS[:4]), k) for k in keys]
    moved = sum(pick(before, k) != pick(after, k) for k in keys)
    assert moved < 2000 * 0.35  # ~1/5 expected; plain modulo hashing would move ~4/5
    counts = {r: sum(pick(after, k) == r for k in keys) for r in REPLICAS}
    assert min(counts.values()) > 2000 / 5 / 2  # reasonably even


def test_no_healthy_candidate_is_none_and_router_keeps_state_across_reloads() -> None:
    ring = build_hash_ring(REPLICAS[:2])
    assert select_replica(ring, b"k", healthy=set(), loads={}) is None
    assert select_replica(ring, b"k", healthy=set(REPLICAS[:2]), loads={}, exclude=set(REPLICAS[:2])) is None
    router = build_pool_router("p", REPLICAS[:2], None)
    router.replicas[REPLICAS[0]].healthy = True
    again = build_pool_router("p", [REPLICAS[0] + "/", REPLICAS[2]], router)
    assert again.replicas[REPLICAS[0]].healthy and not again.replicas[REPLICAS[2]].healthy
    assert set(again.replicas) == {REPLICAS[0], REPLICAS[2]}


# -- rewrite --------------------------------------------------------------------------------------------
def test_upstream_body_strips_every_listed_field_and_sets_the_tenant() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    body.update(dict.fromkeys(STRIPPED_BODY_FIELDS, "client"))
    parsed = parse_request(body, Endpoint.CHAT, 64)
    out = build_upstream_body(parsed, tenant="t", cache_salt="s", priority=7)
    assert out["cache_salt"] == "s" and out["priority"] == 7 and out["vllm_xargs"] == {"kvfleet_tenant": "t"}
    assert not (
        {"request_id", "session_id", "kv_transfer_params", "ec_transfer_params", "data_parallel_rank"}
        & set(out)
    )
    assert out["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "client"  # the client's dict is not mutated


@pytest.mark.parametrize(
    ("body", "endpoint", "fragment"),
    [
        ([], Endpoint.CHAT, "JSON object"),
        ({"messages": [{}]}, Endpoint.CHAT, "'model' is required"),
        ({"model": 3, "messages": [{}]}, Endpoint.CHAT, "'model' must be"),
        ({"model": "m", "messages": []}, Endpoint.CHAT, "'messages'"),
        ({"model": "m", "messages": ["x"]}, Endpoint.CHAT, "each entry"),
        ({"model": "m", "prompt": 5}, Endpoint.COMPLETIONS, "'prompt'"),
        ({"model": "m", "prompt": [1, "a"]}, Endpoint.COMPLETIONS, "'prompt'"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, Endpoint.COMPLETIONS, "'stream'"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, Endpoint.COMPLETIONS, "'max_tokens'"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, Endpoint.COMPLETIONS, "'max_tokens'"),
        ({"model": "m", "prompt": "x", "n": 1000}, Endpoint.COMPLETIONS, "'n'"),
        ({"model": "m", "prompt": "x", "stream_options": 1}, Endpoint.COMPLETIONS, "'stream_options'"),
    ],
)
def test_bad_requests_name_the_problem(body: object, endpoint: Endpoint, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        parse_request(body, endpoint, 64)


def test_prompt_estimate_is_chars_over_four_plus_message_overhead() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 400}, {"role": "system", "content": "y" * 3}]}
    assert compute_prompt_estimate(chat, Endpoint.CHAT) == math.ceil((400 + 3 + 4 + 6) / 4) + 8
    assert compute_prompt_estimate({"prompt": "z" * 10}, Endpoint.COMPLETIONS) == 3
    assert compute_prompt_estimate({"prompt": [1, 2, 3]}, Endpoint.COMPLETIONS) == 3
    assert compute_prompt_estimate({"prompt": [[1, 2], [3]]}, Endpoint.COMPLETIONS) == 3


def test_request_id_round_trips_through_vllm_prefixes() -> None:
    for tenant in ("acme", "team-a.prod", "x"):
        rid = build_request_id(tenant)
        for engine_id in (f"chatcmpl-{rid}-0a1b2c3d", f"cmpl-{rid}-0a1b2c3d", rid, f"chatcmpl-{rid}_1"):
            assert parse_tenant_from_request_id(engine_id) == tenant, engine_id
    assert parse_tenant_from_request_id("chatcmpl-3f2a") is None


# -- snapshot and auth ----------------------------------------------------------------------------------
def test_authenticate_by_hash_with_rotation_and_rejects_everything_else() -> None:
    tenants = [TenantRow("a", keys=2), TenantRow("b")]
    table = build_table(tenants, {"shared": ["http://e:1"]})
    keys, plain = build_keys(tenants)
    snap = build_snapshot(table, keys)
    assert snap.authenticate(f"Bearer {plain['a'][0]}").name == "a"  # type: ignore[union-attr]
    assert snap.authenticate(f"bearer  {plain['a'][1]} ").name == "a"  # type: ignore[union-attr]
    assert snap.authenticate(f"Bearer {plain['b'][0]}").name == "b"  # type: ignore[union-attr]
    for bad, why in (
        (None, AuthFailure.MISSING),
        ("", AuthFailure.MISSING),
        ("Bearer", AuthFailure.MISSING),
        ("Bearer ", AuthFailure.MISSING),
        (plain["a"][0], AuthFailure.MISSING),
        (f"Basic {plain['a'][0]}", AuthFailure.MISSING),
        ("Bearer " + "x" * 5000, AuthFailure.UNKNOWN),
        (f"Bearer {keys.key_hashes['a'][0]}", AuthFailure.UNKNOWN),
        ("Bearer sk-caf\u00e9", AuthFailure.UNKNOWN),  # valid UTF-8, just not a key
        ("Bearer sk-\udcff\udcfe", AuthFailure.MALFORMED),  # how aiohttp hands over invalid UTF-8
    ):
        assert snap.authenticate(bad) is why, bad
    assert snap.tenants["a"].kv_budget_tokens is None


def test_load_errors_are_described_without_input_values() -> None:
    secret = "f" * 63 + "SECRET"
    with pytest.raises(ValidationError) as info:
        KeyFile.model_validate_json(json.dumps({"salt_key_hex": secret, "key_hashes": {"a": [secret]}}))
    text = describe_error(info.value)
    assert "salt_key_hex" in text and "SECRET" not in text
    with pytest.raises(ValidationError) as bad_json:
        TenantTable.model_validate_json(b'{"tenants": SECRET')
    assert "SECRET" not in describe_error(bad_json.value)
    assert "SECRET" not in describe_error(OSError(2, "No such file", "/SECRET"))


# -- command line ---------------------------------------------------------------------------------------
def test_listen_flag_and_bad_config_exit_code(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    assert parse_listen(":8080") == ("0.0.0.0", 8080)
    for bad in ("8080", "host:", "host:99999", "host:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_listen(bad)
    (tmp_path / "tenants.json").write_text('{"tenants": "SECRET"}')
    (tmp_path / "keys.json").write_text("{}")
    code = main(
        [
            "gateway",
            "--config",
            str(tmp_path / "tenants.json"),
            "--keys",
            str(tmp_path / "keys.json"),
            "--listen",
            "127.0.0.1:1",
        ]
    )
    assert code == 2
    assert "cannot start" in caplog.text and "SECRET" not in caplog.text


def test_a_snapshot_keeps_the_tenants_a_reload_left_alone_and_rebuilds_the_rest() -> None:
    """build_snapshot(previous=...): a tenant whose entry is the same object, in an equal pool, under the
    same salt key keeps its TenantRuntime (the gateway then leaves its gate and policy alone); anything
    that changes what the runtime derives builds it again."""
    rows = [TenantRow("a"), TenantRow("b")]
    table = build_table(rows, {"shared": ["http://e0:8000"]})
    keys, _ = build_keys(rows)
    first = build_snapshot(table, keys)
    # The same entries (as TenantTable.reload keeps them): the same runtimes.
    again = build_snapshot(table.model_copy(), keys, previous=first)
    assert again.tenants["a"] is first.tenants["a"] and again.tenants["b"] is first.tenants["b"]
    # An edited entry: rebuilt; the other kept.
    edited = TenantTable.model_validate(
        {
            **dict(table),
            "tenants": {**table.tenants, "b": table.tenants["b"].model_copy(update={"priority": 0})},
        }
    )
    changed = build_snapshot(edited, keys, previous=first)
    assert changed.tenants["a"] is first.tenants["a"]
    assert changed.tenants["b"] is not first.tenants["b"] and changed.tenants["b"].entry.priority == 0
    # A pool whose endpoints changed, or a new salt key: every tenant of it is rebuilt.
    moved = build_table(rows, {"shared": ["http://e0:8000", "http://e1:8000"]})
    moved = TenantTable.model_validate({**dict(moved), "tenants": table.tenants})
    rebuilt = build_snapshot(moved, keys, previous=first)
    assert rebuilt.tenants["a"] is not first.tenants["a"] and len(rebuilt.tenants["a"].pool.endpoints) == 2
    rekeyed = build_snapshot(
        table, KeyFile(salt_key_hex="cd" * 32, key_hashes=keys.key_hashes), previous=first
    )
    assert rekeyed.tenants["a"] is not first.tenants["a"]
    assert rekeyed.tenants["a"].cache_salt != first.tenants["a"].cache_salt
