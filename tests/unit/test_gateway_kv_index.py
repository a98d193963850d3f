"""Precise routing's pure parts: the salt-scoped block index fed by vLLM's KV events
(gateway/kv_index.py), the choice it makes within the load bound (``kv/placement.py``: ``select_deepest``)
and what the gateway asks the engine to tokenize (``kv_events.tokenize_request``)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.gateway.kv_events import (
    KvEventFeeds,
    events_address,
    pool_event_addresses,
    tokenize_request,
)
from kvfleet_runtime.gateway.kv_index import (
    Cleared,
    PrefixIndex,
    Removed,
    Stored,
    chain_keys,
    parse_events,
)
from kvfleet_runtime.gateway.metrics import GatewayMetrics
from kvfleet_runtime.kv.placement import build_hash_ring, select_deepest, select_precise, select_replica

BS = 4
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def stored(
    hashes: list[int], tokens: list[int], salt: str | None = "salt-a", parent: int | None = None
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM 0.32 publishes it (msgpack-decoded): the salt in the first block's extra
    keys when the chain starts there."""
    extras: list[Any] = [None] * len(hashes)
    if parent is None and salt is not None:
        extras[0] = [salt]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extras,
        "group_idx": 0,
    }


def batch(*events: dict[str, Any]) -> list[Any]:
    return [1796267798.0, list(events), 0]


TOKENS = list(range(100, 113))  # 3 whole blocks of 4 and one token


def feed(index: PrefixIndex, replica: str, seq: int, *events: dict[str, Any], now: float = 0.0) -> str | None:
    return index.observe(replica, seq, parse_events(batch(*events)), now)


def test_a_stored_chain_matches_the_requests_own_keys() -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12], TOKENS[:8]))
    feed(index, A, 1, stored([13], TOKENS[8:12], parent=12))  # the chain continues in a later batch
    keys = chain_keys("salt-a", TOKENS, BS)
    assert len(keys) == 3  # the partial fourth block has no key
    assert index.match(keys, {A, B}) == {A: 3}
    assert index.knows("salt-a") and index.size == 3


def test_no_tenant_matches_another_tenants_blocks() -> None:
    """The attack: tenant B sends exactly tenant A's prompt to be routed where A's blocks are (and time
    it). B's keys carry B's salt, so A's blocks never match them."""
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12, 13], TOKENS[:12], salt="salt-a"))
    assert index.match(chain_keys("salt-b", TOKENS, BS), {A, B}) == {}
    assert not index.knows("salt-b")


def test_blocks_without_a_salt_or_with_keys_the_gateway_cannot_reproduce_are_not_indexed() -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12], TOKENS[:8], salt=None))
    media = stored([21], TOKENS[:4])
    media["extra_keys"] = [["salt-a", ["image-hash", 0]]]
    feed(index, A, 1, media)
    lora = stored([31], TOKENS[:4])
    lora["lora_name"] = "adapter"
    feed(index, A, 2, lora)
    assert index.size == 0
    # A continuation of a chain the index does not hold is not guessed either.
    feed(index, A, 3, stored([41], TOKENS[4:8], parent=99))
    assert index.size == 0


def test_removed_blocks_and_a_cleared_cache_leave_the_index() -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12, 13], TOKENS[:12]))
    feed(index, B, 0, stored([51, 52, 53], TOKENS[:12]))
    keys = chain_keys("salt-a", TOKENS, BS)
    feed(index, A, 1, {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"})
    assert index.match(keys, {A, B}) == {A: 2, B: 3}
    feed(index, B, 1, {"type": "AllBlocksCleared"})
    assert index.match(keys, {A, B}) == {A: 2}
    feed(index, B, 2, stored([54], TOKENS[:4]))  # the cleared replica goes on with its sequence
    assert index.match(keys, {A, B}) == {A: 2, B: 1}


@pytest.mark.parametrize(("next_seq", "reason"), [(5, "gap"), (0, "restart")])
def test_a_lost_batch_or_a_restarted_engine_forgets_what_it_held(next_seq: int, reason: str) -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12], TOKENS[:8]))
    feed(index, A, 1, stored([13], TOKENS[8:12], parent=12))
    assert feed(index, A, next_seq, stored([61], TOKENS[:4], salt="salt-c")) == reason
    assert index.match(chain_keys("salt-a", TOKENS, BS), {A}) == {}
    assert not index.knows("salt-a") and index.knows("salt-c")


def test_replicas_that_leave_are_forgotten_and_never_matched() -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11], TOKENS[:4]))
    feed(index, B, 0, stored([51], TOKENS[:4]))
    keys = chain_keys("salt-a", TOKENS, BS)
    assert index.match(keys, {A}) == {A: 1}  # only the candidates asked about
    assert index.retain([A]) == [B]
    assert index.match(keys, {A, B}) == {A: 1}


def test_entries_expire_unless_stored_again() -> None:
    index = PrefixIndex(ttl_s=10)
    feed(index, A, 0, stored([11], TOKENS[:4]), now=0)
    feed(index, A, 1, stored([51], TOKENS[:4], salt="salt-b"), now=8)
    feed(index, A, 2, stored([11], TOKENS[:4]), now=9)  # stored again: refreshed
    assert index.expire(now=15) == 0
    assert index.expire(now=19.5) == 2
    assert index.size == 0 and not index.knows("salt-a")


def test_a_prediction_the_engine_contradicts_drops_the_missing_blocks() -> None:
    index = PrefixIndex()
    feed(index, A, 0, stored([11, 12, 13], TOKENS[:12]))
    keys = chain_keys("salt-a", TOKENS, BS)
    assert index.correct(A, keys, cached_blocks=1) == 2
    assert index.match(keys, {A}) == {A: 1}
    assert index.correct(A, keys, cached_blocks=1) == 0


def test_an_unknown_event_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV event type"):
        parse_events(batch({"type": "Something"}))
    with pytest.raises(ValueError, match="not a KV event batch"):
        parse_events({"ts": 1})
    assert parse_events(batch({"type": "AllBlocksCleared"})) == [Cleared()]
    assert parse_events(batch({"type": "BlockRemoved", "block_hashes": [b"\x01"]})) == [Removed((b"\x01",))]


@given(st.lists(st.integers(0, 50_000), max_size=40), st.sampled_from([1, 4, 16]))
def test_keys_cover_whole_blocks_and_depend_on_every_earlier_token(tokens: list[int], size: int) -> None:
    keys = chain_keys("s", tokens, size)
    assert len(keys) == len(tokens) // size
    if len(keys) >= 2:
        changed = [tokens[0] + 1, *tokens[1:]]
        assert set(chain_keys("s", changed, size)).isdisjoint(keys)


def test_index_entries_built_from_events_equal_the_requests_keys() -> None:
    """The index and the request side share one chain: a Stored event rebuilt from any split of the same
    tokens gives the keys ``chain_keys`` gives."""
    index = PrefixIndex()
    feed(index, A, 0, stored([1], TOKENS[:4]))
    feed(index, A, 1, stored([2, 3], TOKENS[4:12], parent=1))
    assert set(index.holders) == set(chain_keys("salt-a", TOKENS, BS))
    event = parse_events(batch(stored([1], TOKENS[:4])))[0]
    assert isinstance(event, Stored) and event.salt == "salt-a" and not event.foreign


def test_the_deepest_replica_under_the_load_bound_wins() -> None:
    depths = {A: 3, B: 1}
    assert select_deepest(depths, healthy={A, B}, loads={A: 0, B: 0}) == A
    # A is over the bound (ceil(1.25 x 11 / 2) = 7): the next deepest.
    assert select_deepest(depths, healthy={A, B}, loads={A: 7, B: 3}) == B
    assert select_deepest(depths, healthy={A, B}, loads={}, exclude={A}) == B
    assert select_deepest(depths, healthy={B}, loads={}) == B
    # No replica that holds a block is eligible: affinity decides.
    assert select_deepest({A: 2}, healthy={A, B}, loads={A: 9, B: 0}) is None
    assert select_deepest({}, healthy={A, B}, loads={}) is None
    assert select_deepest({A: 2, B: 2}, healthy={A, B}, loads={A: 1, B: 0}) == B  # a tie: least loaded


def test_precise_routing_moves_a_request_only_to_a_replica_holding_strictly_more() -> None:
    """Affinity's replica keeps the request unless another one under the load bound holds a longer
    prefix on its GPU: on a tie the affinity replica may hold the rest in its own offload tiers."""
    ring = build_hash_ring([A, B])
    key = b"salt\x00prompt"
    home = select_replica(ring, key, healthy={A, B}, loads={})
    other = B if home == A else A
    assert select_precise(ring, key, {}, healthy={A, B}, loads={}) == (home, False)
    assert select_precise(ring, key, {home: 2, other: 2}, healthy={A, B}, loads={}) == (home, True)
    assert select_precise(ring, key, {other: 2}, healthy={A, B}, loads={}) == (other, True)
    assert select_precise(ring, key, {home: 1, other: 3}, healthy={A, B}, loads={}) == (other, True)
    assert select_precise(ring, key, {home: 3, other: 1}, healthy={A, B}, loads={}) == (home, True)
    # The deeper one is over the bound (ceil(1.25 x 10 / 2) = 7): affinity's, which holds nothing.
    assert select_precise(ring, key, {other: 3}, healthy={A, B}, loads={other: 7, home: 2}) == (home, False)
    assert select_precise(ring, key, {other: 3}, healthy={A, B}, loads={}, exclude={A, B}) == (None, False)


def test_what_the_engine_is_asked_to_tokenize() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 3}
    assert tokenize_request(chat) == {"model": "m", "messages": chat["messages"], "tools": []}
    assert tokenize_request({"model": "m", "prompt": "hello"}) == {"model": "m", "prompt": "hello"}
    assert tokenize_request({"model": "m", "prompt": ["hello"]}) == {"model": "m", "prompt": "hello"}
    assert tokenize_request({"model": "m", "prompt": [1, 2, 3]}) == [1, 2, 3]  # already tokens
    assert tokenize_request({"model": "m", "prompt": ["a", "b"]}) is None  # a batch: affinity
    image = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert tokenize_request({"model": "m", "messages": [{"role": "user", "content": image}]}) is None


def test_the_events_address_of_a_replica() -> None:
    assert (
        events_address("http://m-engine-0.m-engine.ns.svc:8000", 5557)
        == "tcp://m-engine-0.m-engine.ns.svc:5557"
    )
    assert events_address("http://[fd00::1]:8000", 5557) == "tcp://[fd00::1]:5557"


def test_where_each_replica_is_followed() -> None:
    """The table's ``kv_events_endpoints`` where it lists one (engines sharing a host), else the flag's
    port on the replica's host, else nowhere (affinity only)."""
    endpoints = [A + "/", B]
    assert pool_event_addresses(endpoints, [], 5557) == {A: "tcp://10.0.0.1:5557", B: "tcp://10.0.0.2:5557"}
    assert pool_event_addresses(endpoints, ["tcp://10.0.0.1:7001"], 5557) == {
        A: "tcp://10.0.0.1:7001",
        B: "tcp://10.0.0.2:5557",
    }
    assert pool_event_addresses(endpoints, ["", "tcp://10.0.0.2:7002"], None) == {B: "tcp://10.0.0.2:7002"}
    assert pool_event_addresses(endpoints, [], None) == {}


async def test_the_feeds_decode_vllms_frames_and_forget_a_replica_followed_elsewhere() -> None:
    """``KvEventFeeds`` takes vLLM's frames (topic, 8-byte sequence, msgpack batch) into the pool's index,
    counts them by kind, forgets a replica whose frames it cannot decode, and forgets what a replica held
    when the table moves its events elsewhere (another engine answers there now)."""
    metrics = GatewayMetrics()
    feeds = KvEventFeeds(metrics)
    try:
        feeds.sync({"pool": {A: "tcp://127.0.0.1:1"}})
        index = feeds.indexes["pool"]

        def frame(seq: int, *events: dict[str, Any]) -> list[bytes]:
            return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch(*events))]

        feeds._take("pool", A, frame(0, stored([11, 12], TOKENS[:8])))
        assert index.match(chain_keys("salt-a", TOKENS, BS), {A}) == {A: 2}
        sample = metrics.registry.get_sample_value
        assert sample("kvfleet_gateway_kv_events_total", {"pool": "pool", "kind": "stored"}) == 1
        feeds._take("pool", A, [b"kv", b"\x00" * 8, b"not msgpack"])
        assert index.size == 0
        assert sample("kvfleet_gateway_kv_events_total", {"pool": "pool", "kind": "undecodable"}) == 1
        feeds._take("pool", A, frame(1, stored([11], TOKENS[:4])))
        assert index.size == 1
        feeds.sync({"pool": {A: "tcp://127.0.0.1:2"}})
        assert index.size == 0
        feeds.sync({})  # the pool is gone
        assert feeds.indexes == {}
    finally:
        await feeds.close()
