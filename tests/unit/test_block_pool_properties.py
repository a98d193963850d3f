"""Property tests: random request streams through vLLM's real KVCacheManager over the tenant-aware pool.

After every step vLLM's own invariants hold (free-block count and queue, ref counts == holders, hash map
== hashed blocks) and the plugin's accounting equals vLLM's state (policy entries == hashed blocks,
pinned == referenced, per-tenant resident blocks sum to the cached blocks). A final check compares
every request's prefix hit and block count with what vLLM's arithmetic allows, so the plugin can only
have changed *which* cached blocks were evicted.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_pool import (
    BLOCK,
    HAVE_VLLM,
    attribution_for,
    build_engine,
    check_invariants,
    prompt,
    salt_of,
    table_of,
    tenant,
)

from components import missing_component
from kvfleet_runtime.config import Isolation

SALTS = ["salt-a", "salt-b", "pool-salt", None, "forged"]

start_op = st.tuples(
    st.just("start"),
    st.integers(0, len(SALTS) - 1),  # who
    st.integers(0, 5),  # which prefix (small range: repeats hit the cache)
    st.integers(1, 4),  # full blocks
)
finish_op = st.tuples(st.just("finish"), st.integers(0, 10), st.just(0), st.just(0))
tick_op = st.tuples(st.just("tick"), st.integers(1, 40), st.just(0), st.just(0))
ops = st.lists(st.one_of(start_op, start_op, finish_op, tick_op), min_size=1, max_size=60)


@pytest.fixture(autouse=True)
def require_vllm() -> None:
    if not HAVE_VLLM:
        missing_component("vLLM CPU build", "make test (hack/install-engine.sh)")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=ops,
    num_blocks=st.integers(6, 24),
    quotas=st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8)),
    ttl=st.sampled_from([5.0, 30.0, 1000.0]),
)
def test_vllm_invariants_hold_under_random_streams(
    steps: list[tuple[str, int, int, int]],
    num_blocks: int,
    quotas: tuple[int, int, int],
    ttl: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = table_of(
        tenant("a", quotas[0], quotas[0] + 4, ttl=ttl),
        tenant("b", quotas[1], quotas[1] + 2),
        tenant("s1", quotas[2], isolation=Isolation.SHARED),
        tenant("s2", 1, isolation=Isolation.SHARED),
    )
    engine = build_engine(attribution_for(table), num_blocks, monkeypatch)
    for op, x, y, z in steps:
        if op == "start":
            salt_id = SALTS[x]
            salt = None if salt_id is None else salt_of(salt_id)
            tokens = prompt(y, z)
            if len(tokens) > BLOCK * (num_blocks - 1):
                continue
            started = engine.start(tokens, salt)
            if started is not None:
                req, hits = started
                assert hits % BLOCK == 0 and hits < len(tokens)
                blocks = engine.manager.coordinator.single_type_managers[0].req_to_blocks[req.request_id]
                assert len(blocks) == -(-len(tokens) // BLOCK)  # exactly what vLLM allocates
        elif op == "finish" and engine.running:
            running = list(engine.running.values())
            engine.finish(running[x % len(running)])
        elif op == "tick":
            engine.clock.now += x
        check_invariants(engine)
    for req in list(engine.running.values()):
        engine.finish(req)
    check_invariants(engine)
    assert engine.pool.get_num_free_blocks() == num_blocks - 1
