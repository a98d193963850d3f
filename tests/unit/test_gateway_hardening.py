"""The pure parts of the gateway's hardening: request budgets, shared rate limits and their headers, the
body budget, JSON and UTF-8 checks, the prepared upstream payload, ambiguous keys. The attacks themselves,
against the real gateway process, are in tests/security."""

from __future__ import annotations

import json
import logging
import math
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_support import MODEL, TenantRow, build_keys, build_table
from kvfleet_runtime.config import KeyFile, hash_api_key
from kvfleet_runtime.gateway.admission import (
    BodyBudget,
    BodyBudgetExceeded,
    BudgetLimits,
    GateLimits,
    RequestTooLarge,
    TenantGate,
    Throttled,
    TokenBucket,
    format_reset,
    plan_request_budget,
)
from kvfleet_runtime.gateway.cli import register
from kvfleet_runtime.gateway.rewrite import (
    MAX_JSON_DEPTH,
    BadRequest,
    Endpoint,
    ModelNotAllowed,
    RequestPolicy,
    check_json_tree,
    compute_prompt_estimate,
    decode_json,
    prepare_request,
)
from kvfleet_runtime.gateway.state import AuthFailure, build_snapshot


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CAPPED = BudgetLimits(kv_burst_blocks=28, block_size=16)


# -- what one request may cost --------------------------------------------------------------------------
def test_missing_max_tokens_is_injected_as_the_room_under_the_tightest_bound() -> None:
    kv = plan_request_budget(6, None, 1, CAPPED)
    assert (kv.max_tokens, kv.injected, kv.kv_blocks) == (28 * 16 - 6, True, 28)
    per_sequence = plan_request_budget(6, None, 4, CAPPED)
    assert per_sequence.max_tokens == 7 * 16 - 6 and per_sequence.kv_blocks == 28
    assert per_sequence.token_estimate == 6 + 4 * (7 * 16 - 6)
    tpm = plan_request_budget(6, None, 2, BudgetLimits(None, 16, tokens_per_minute=1000.9))
    assert tpm.max_tokens == (1000 - 6) // 2 and tpm.token_estimate <= 1000
    context = plan_request_budget(100, None, 1, BudgetLimits(1000, 16, max_model_len=2048))
    assert context.max_tokens == 2048 - 100
    default = plan_request_budget(100, None, 3, BudgetLimits(None, 16, default_max_tokens=77))
    assert default.max_tokens == 77 and default.kv_tokens == 3 * math.ceil(177 / 16) * 16


def test_an_explicit_max_tokens_is_kept_when_it_fits() -> None:
    budget = plan_request_budget(6, 10, 2, CAPPED)
    assert (budget.max_tokens, budget.injected, budget.kv_blocks, budget.token_estimate) == (10, False, 2, 26)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "sequences", "limits", "param", "fragment"),
    [
        (6, None, 128, CAPPED, "n", "KV burst limit of 28 blocks"),  # 28 // 128 = 0 blocks a sequence
        (500, None, 1, CAPPED, "n", "KV burst limit"),  # the prompt alone is over the cap
        (6, 1000, 2, CAPPED, "n", "needs up to 126 KV blocks"),
        (6, 1000, 1, CAPPED, "max_tokens", "burst limit of 28 blocks"),
        (6, 600, 2, BudgetLimits(None, 16, tokens_per_minute=1000), "n", "1000 tokens per minute"),
        (2000, None, 1, BudgetLimits(None, 16, tokens_per_minute=1000), "n", "tokens per minute"),
        (3000, None, 1, BudgetLimits(None, 16, max_model_len=2048), "n", "context length of 2048"),
    ],
)
def test_requests_that_can_never_fit_are_refused_before_anything_is_charged(
    prompt: int, max_tokens: int | None, sequences: int, limits: BudgetLimits, param: str, fragment: str
) -> None:
    with pytest.raises(RequestTooLarge, match=fragment) as info:
        plan_request_budget(prompt, max_tokens, sequences, limits)
    assert info.value.param == param


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(0, 5000),
    max_tokens=st.none() | st.integers(1, 10_000),
    sequences=st.integers(1, 128),
    burst=st.none() | st.integers(1, 2000),
    block=st.sampled_from([16, 32]),
    tpm=st.none() | st.floats(1, 1e6),
    context=st.none() | st.integers(1, 200_000),
)
def test_an_admitted_budget_always_fits_the_cap_and_the_rate(
    prompt: int,
    max_tokens: int | None,
    sequences: int,
    burst: int | None,
    block: int,
    tpm: float | None,
    context: int | None,
) -> None:
    limits = BudgetLimits(burst, block, tokens_per_minute=tpm, max_model_len=context)
    try:
        budget = plan_request_budget(prompt, max_tokens, sequences, limits)
    except RequestTooLarge:
        return
    assert budget.max_tokens >= 1
    assert budget.kv_blocks == sequences * math.ceil((prompt + budget.max_tokens) / block)
    if burst is not None:
        assert budget.kv_blocks <= burst
    if tpm is not None:
        assert budget.token_estimate <= tpm
    if max_tokens is not None:
        assert budget.max_tokens == max_tokens and not budget.injected
    elif context is not None:
        assert prompt + budget.max_tokens <= context


# -- rate limits shared across replicas, and their headers ------------------------------------------------
def test_each_replica_enforces_its_share_of_every_limit() -> None:
    limits = GateLimits(requests_per_minute=60, tokens_per_minute=1000, max_concurrent=5, replicas=2)
    assert (limits.requests_share, limits.tokens_share, limits.concurrency_share) == (30, 500, 2)
    assert GateLimits(max_concurrent=1, replicas=3).concurrency_share == 1  # never 0
    clock = FakeClock()
    gate = TenantGate(limits, clock)
    assert gate.rpm is not None and gate.rpm.capacity == 30


async def test_a_share_below_one_request_still_admits_at_its_rate() -> None:
    clock = FakeClock()
    gate = TenantGate(GateLimits(requests_per_minute=1, replicas=2), clock)  # half a request a minute
    (await gate.acquire(1, 1)).release()
    with pytest.raises(Throttled) as info:
        await gate.acquire(1, 1)
    assert info.value.retry_after == pytest.approx(120)  # two minutes to refill half a request
    assert "1/2" in info.value.message
    clock.now += 120
    (await gate.acquire(1, 1)).release()


async def test_rate_limit_headers_report_this_replicas_buckets() -> None:
    clock = FakeClock()
    gate = TenantGate(GateLimits(requests_per_minute=120, tokens_per_minute=60_000, replicas=2), clock)
    (await gate.acquire(1000, 1)).release()
    headers = gate.rate_limit_headers()
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "30000",
        "x-ratelimit-remaining-tokens": "29000",
        "x-ratelimit-reset-tokens": "2s",
    }
    assert TenantGate(GateLimits(max_concurrent=3)).rate_limit_headers() == {}


def test_reset_durations_are_written_as_openai_does() -> None:
    assert [format_reset(s) for s in (0, 0.25, 1, 59.5, 60, 361.2, -3)] == [
        "0s",
        "0.25s",
        "1s",
        "59.5s",
        "1m0s",
        "6m1s",
        "0s",
    ]


def test_the_request_rate_check_before_the_body_takes_nothing() -> None:
    clock = FakeClock()
    gate = TenantGate(GateLimits(requests_per_minute=1), clock)
    gate.check_request_rate()
    gate.check_request_rate()
    assert gate.rpm is not None and gate.rpm.level == 1
    gate.rpm.try_take(1)
    with pytest.raises(Throttled) as info:
        gate.check_request_rate()
    assert info.value.reason == "requests_per_minute"


def test_a_fractional_bucket_refills_exactly() -> None:
    clock = FakeClock()
    bucket = TokenBucket(0.5, clock)
    assert bucket.try_take(1) == 0 and bucket.level == -0.5
    assert bucket.wait_for(1) == pytest.approx(120)
    assert bucket.seconds_to_full() == pytest.approx(120)


# -- request bodies in memory ---------------------------------------------------------------------------
def test_body_budget_bounds_each_tenant_and_the_process() -> None:
    budget = BodyBudget(total=100, per_tenant=60)
    a = budget.reserve("a", 50)
    with pytest.raises(BodyBudgetExceeded) as tenant_full:
        budget.reserve("a", 20)
    assert tenant_full.value.scope == "tenant"
    b = budget.reserve("b", 40)
    with pytest.raises(BodyBudgetExceeded) as process_full:
        budget.reserve("c", 20)
    assert process_full.value.scope == "gateway"
    b.grow(10)  # a body without a length grows as it arrives
    with pytest.raises(BodyBudgetExceeded):
        b.grow(1)
    a.release()
    a.release()  # idempotent
    b.release()
    assert budget.used == 0 and budget.by_tenant == {}


# -- JSON, UTF-8 and the prepared payload ------------------------------------------------------------------
def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth - 1):
        value = [value]
    return value


def test_json_deeper_than_the_bound_is_refused_iteratively() -> None:
    check_json_tree(_nested(MAX_JSON_DEPTH + 1))  # a string at the bottom: the lists are 64 deep
    with pytest.raises(BadRequest, match="deeper than 64"):
        check_json_tree(_nested(MAX_JSON_DEPTH + 2))
    with pytest.raises(BadRequest, match="deeper than 64"):
        check_json_tree({"a": _nested(100_000)})  # no recursion: no RecursionError


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b'{"a": "\\ud800"}', "not valid UTF-8"),
        (b'{"\\udfff": 1}', "not valid UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "not valid UTF-8"),
        (b"[" * 5000 + b"]" * 5000, "deeper than"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"a": ', "not valid JSON"),
    ],
)
def test_undecodable_bodies_are_bad_requests(raw: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        decode_json(raw)


def test_non_ascii_text_counts_a_token_per_character() -> None:
    assert compute_prompt_estimate({"prompt": "a" * 40}, Endpoint.COMPLETIONS) == 10
    assert compute_prompt_estimate({"prompt": "数" * 40}, Endpoint.COMPLETIONS) == 40
    assert compute_prompt_estimate({"prompt": "ab数数"}, Endpoint.COMPLETIONS) == 1 + 2


POLICY = RequestPolicy(
    tenant="acme",
    cache_salt="s" * 32,
    priority=10,
    models=frozenset({MODEL}),
    affinity_chars=64,
    budget=CAPPED,
)


def _chat(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "héllo"}], **extra}).encode()


def test_prepared_payload_carries_the_tenant_and_an_injected_max_tokens_only_when_missing() -> None:
    prepared = prepare_request(_chat(n=2, best_of=4), Endpoint.CHAT, POLICY)
    body = json.loads(prepared.payload)
    assert prepared.budget.sequences == 4  # best_of counts
    assert body["max_tokens"] == (28 // 4) * 16 - prepared.budget.prompt_tokens and prepared.budget.injected
    assert body["cache_salt"] == "s" * 32 and body["priority"] == 10
    assert "héllo".encode() in prepared.payload  # UTF-8, not \\u escapes
    kept = json.loads(prepare_request(_chat(max_completion_tokens=9), Endpoint.CHAT, POLICY).payload)
    assert "max_tokens" not in kept and kept["max_completion_tokens"] == 9
    with pytest.raises(ModelNotAllowed):
        prepare_request(_chat(model="other"), Endpoint.CHAT, POLICY)
    with pytest.raises(BadRequest, match="'best_of'"):
        prepare_request(_chat(best_of=129), Endpoint.CHAT, POLICY)


def test_refusals_survive_the_trip_back_from_a_parse_worker() -> None:
    for exc in (
        BadRequest("m", "p"),
        ModelNotAllowed("m", "model"),
        RequestTooLarge("too big", "n"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert getattr(back, "param", None) == getattr(exc, "param", None)


# -- keys -----------------------------------------------------------------------------------------------
def test_a_key_listed_by_two_tenants_is_refused_for_both_and_logged_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenants = [TenantRow("a", keys=2), TenantRow("b"), TenantRow("c")]
    table = build_table(tenants, {"shared": ["http://e:1"]})
    keys, plain = build_keys(tenants)
    shared = plain["a"][0]
    hashes = {**keys.key_hashes, "b": [hash_api_key(shared)], "gone": [hash_api_key(plain["c"][0])]}
    caplog.set_level(logging.WARNING, logger="kvfleet.gateway")
    snap = build_snapshot(table, KeyFile(salt_key_hex=keys.salt_key_hex, key_hashes=hashes))
    assert snap.authenticate(f"Bearer {shared}") is AuthFailure.AMBIGUOUS
    # A tenant the table does not have still makes its key ambiguous: c's key is refused too.
    assert snap.authenticate(f"Bearer {plain['c'][0]}") is AuthFailure.AMBIGUOUS
    assert snap.authenticate(f"Bearer {plain['a'][1]}").name == "a"  # type: ignore[union-attr]
    warnings = [r.getMessage() for r in caplog.records if "listed by tenants" in r.getMessage()]
    tail = "; it is refused for all of them until it is listed by one"
    assert sorted(warnings) == [
        "one API key is listed by tenants 'a', 'b'" + tail,
        "one API key is listed by tenants 'c', 'gone'" + tail,
    ]
    for secret in (shared, hash_api_key(shared)):
        assert secret not in caplog.text


def test_one_tenant_listing_a_key_twice_is_not_ambiguous() -> None:
    tenants = [TenantRow("a")]
    keys, plain = build_keys(tenants)
    digest = keys.key_hashes["a"][0]
    snap = build_snapshot(
        build_table(tenants, {"shared": ["http://e:1"]}),
        KeyFile(salt_key_hex=keys.salt_key_hex, key_hashes={"a": [digest, digest]}),
    )
    assert snap.authenticate(f"Bearer {plain['a'][0]}").name == "a"  # type: ignore[union-attr]


# -- command line ---------------------------------------------------------------------------------------
def test_replicas_come_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse  # noqa: PLC0415

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        return parser.parse_args(["gateway", "--config", "c", "--keys", "k", *argv])

    assert parse().replicas == 1
    assert parse().metrics_listen == ("0.0.0.0", 8081)
    assert parse("--replicas", "3").replicas == 3
    monkeypatch.setenv("KVFLEET_GATEWAY_REPLICAS", "4")
    assert parse().replicas == 4
    with pytest.raises(SystemExit):
        parse("--replicas", "0")
