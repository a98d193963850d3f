"""Per-tenant admission control: what one request may cost, rate limits, concurrency, the KV budget.

Contract (one ``TenantGate`` per tenant, per gateway process):

* **Limits are shared across gateway replicas by division.** ``GateLimits`` carries the tenant's limits
  for the whole ModelDeployment and ``replicas``, the number of gateway replicas (rendered by the
  operator); each replica enforces ``limit / replicas`` of the requests and tokens per minute and
  ``max(1, max_concurrent // replicas)`` concurrent requests. The sum over the replicas never exceeds the
  limit (concurrency: unless it is below the replica count); a tenant whose traffic reaches the replicas
  unevenly (one keep-alive connection lands on one replica) gets less than its limit, down to one
  replica's share. No shared store is involved, so a replica never waits on another.
* **With a shared store** (``--shared-store``, ``gateway.shared_store``) the replicas split the requests
  and tokens per minute by where each tenant's traffic lands instead (``gateway.shares``): the store's
  sync sets each gate's fractions (``TenantGate.set_fractions``) from the demand every replica counts
  (``TenantGate.demand``, which the gate feeds with every request that reaches a bucket), and puts them
  back to ``1 / replicas`` when the store cannot be reached. Concurrency stays split evenly.
* ``requests_per_minute`` and ``tokens_per_minute`` are token buckets holding one minute of the share
  and refilling continuously. A request that finds its bucket short is refused at once with the seconds
  until it would fit (``Throttled.retry_after``, sent as ``Retry-After``).
* **What a request costs is decided before it is admitted** (``plan_request_budget``): it runs
  ``sequences = max(n, best_of)`` sequences (times the prompts of a completions batch) of at most
  ``max_tokens`` tokens each (on chat, ``max_completion_tokens`` when sent: vLLM obeys it over
  ``max_tokens``). A request without a bound gets ``max_tokens`` injected: the most each sequence may
  generate within every bound the gateway knows (the tenant's HBM burst cap, one minute of its token
  share, the model's context length; the gateway's default only when none is known). The engine would
  otherwise generate up to the model's context length, which no estimate made before the answer can
  bound; with the cap in the request, the budget below is exact instead of a guess, and vLLM clamps it
  to the context length anyway.
  A request whose KV footprint (``sequences x ceil((prompt + max_tokens) / block_size)`` blocks) exceeds
  the tenant's burst cap, or whose token estimate exceeds one minute of its token share, can never run
  within its limits and is refused with ``RequestTooLarge`` (a 400), before any bucket is charged.
* Token cost is estimated as ``prompt + sequences x max_tokens`` and reconciled with the engine's
  ``usage`` when the answer is complete (``GateSlot.reconcile_tokens``); it is never larger than one
  minute of the share, so a refused or failed request cannot leave the tenant locked out for longer.
* ``max_concurrent`` requests and a KV budget (sum of the admitted requests' footprints, at most the
  tenant's burst cap in tokens) bound what is in flight. A request that does not fit waits in a FIFO
  queue of bounded length for a bounded time; a full queue or a timed-out wait is a 429.
* **The engines are not over-filled** (``EngineQueue``): a pool admits at most ``limit`` requests to its
  engines at once (per replica, times the pool's replicas). A tenant's admitted request beyond that is
  held at the gateway and released in fair order (``kv.fairness``: strict priority between SLA tiers,
  the Virtual Token Counter within a tier, weighted by the tenant's ``fair_share_weight``; or first come,
  first served within a tier when fair queuing is off), instead of waiting in vLLM's queue where
  arrival order alone decides. A held request counts against its tenant's concurrency while it waits;
  it waits at most ``max_queue_wait_s`` and its tenant holds at most ``max_queue`` of them; either
  limit is a 429 with ``Retry-After`` (reason ``engine_queue``), and a client that goes away while
  held leaves nothing behind.
* Request bodies held in memory are bounded per tenant and per process (``BodyBudget``).
* Nothing is dropped silently: every refusal raises ``Throttled``, ``RequestTooLarge`` or
  ``BodyBudgetExceeded``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvfleet_runtime.kv.fairness import FairQueue, Ticket, TokenCost

Clock = Callable[[], float]


class Throttled(Exception):
    """Admission refused; ``reason`` is one of metrics.THROTTLE_REASONS."""

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.message = message

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds, at least 1 (HTTP wants an integer)."""
        return str(max(1, math.ceil(self.retry_after)))


class RequestTooLarge(ValueError):
    """A request that can never run within the tenant's limits; the message is safe to show the client."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses the parse workers' process boundary
        return (type(self), (self.message, self.param))


class TokenBucket:
    """A bucket of ``per_minute`` tokens refilled continuously at ``per_minute / 60`` per second.

    ``per_minute`` may be fractional (a replica's share of a small limit): a bucket smaller than one
    request still admits one whenever it is full, so the long-run rate is exact.

    Every method refills first (``_refill``, written out in the ones the request path calls: they run
    several times per request).
    """

    __slots__ = ("_clock", "_full_text", "_stamp", "capacity", "level", "rate")

    def __init__(self, per_minute: float, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._stamp = clock()
        #: ``header_values``'s remaining tokens of a full bucket.
        self._full_text = str(int(self.capacity))

    def _refill(self) -> None:
        now = self._clock()
        level = self.level + (now - self._stamp) * self.rate
        self.level = level if level < self.capacity else self.capacity
        self._stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` would fit (0: it fits now); takes nothing."""
        now = self._clock()
        capacity = self.capacity
        level = self.level + (now - self._stamp) * self.rate
        level = min(level, capacity)
        self.level = level
        self._stamp = now
        if level >= amount or (amount > capacity and level >= capacity):
            return 0.0
        return ((amount if amount < capacity else capacity) - level) / self.rate

    def try_take(self, amount: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds until it would fit."""
        wait = self.wait_for(amount)
        if wait == 0.0:
            self.level -= amount
        return wait

    def adjust(self, delta: float) -> None:
        """Charge ``delta`` more (negative: refund). The level may go negative (debt), never above full."""
        now = self._clock()
        capacity = self.capacity
        level = self.level + (now - self._stamp) * self.rate
        level = (level if level < capacity else capacity) - delta
        self.level = level if level < capacity else capacity
        self._stamp = now

    def set_per_minute(self, per_minute: float) -> None:
        """Change the rate on a config reload, keeping what is left (capped at the new capacity)."""
        self._refill()
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)
        self._full_text = str(int(self.capacity))

    def seconds_to_full(self) -> float:
        self._refill()
        return max(0.0, (self.capacity - self.level) / self.rate)

    def header_values(self) -> tuple[str, str]:
        """What ``x-ratelimit-remaining-*`` and ``x-ratelimit-reset-*`` say now: the whole tokens left, and
        the time until the bucket is full (``format_reset``)."""
        now = self._clock()
        capacity = self.capacity
        level = self.level + (now - self._stamp) * self.rate
        self._stamp = now
        if level >= capacity:  # a tenant well within its limit: the usual case, nothing to format
            self.level = capacity
            return self._full_text, "0s"
        self.level = level
        left = (capacity - level) / self.rate
        return (
            str(int(level)) if level > 0 else "0",
            f"{round(left, 3):g}s" if left < 60 else format_reset(left),
        )


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``0s``, ``1.5s``, ``6m0s``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


# -- what one request may cost --------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetLimits:
    """The bounds of one tenant's requests (picklable: it travels to the parse workers)."""

    #: The tenant's HBM burst cap in blocks; ``None``: no cap.
    kv_burst_blocks: int | None
    block_size: int
    #: This replica's share of the tenant's tokens per minute; ``None``: unlimited.
    tokens_per_minute: float | None = None
    #: The model's context length when the tenant table knows it.
    max_model_len: int | None = None
    #: ``max_tokens`` injected when the client sends none and no bound above is known.
    default_max_tokens: int = 256


class RequestBudget(NamedTuple):
    """What admission charges for one request (see ``plan_request_budget``). Built for every request: a
    named tuple, which is immutable and costs half as much to build as a frozen dataclass."""

    sequences: int
    prompt_tokens: int
    #: Per sequence: as the client sent it, or as the gateway injects it (``injected``).
    max_tokens: int
    injected: bool
    #: The KV footprint: ``sequences x ceil((prompt + max_tokens) / block_size)`` blocks.
    kv_blocks: int
    #: The footprint in tokens (``kv_blocks x block_size``), what the tenant's KV budget counts.
    kv_tokens: int
    #: Charged to tokens per minute: ``prompt + sequences x max_tokens``.
    token_estimate: int


def plan_request_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    sequences: int,
    limits: BudgetLimits,
    max_tokens_param: str = "max_tokens",
) -> RequestBudget:
    """The request's budget, injecting ``max_tokens`` when it is missing (module docstring, rules).
    ``max_tokens_param`` names the field the client set the bound with (the ``param`` of a refusal).

    Raises ``RequestTooLarge`` when the request cannot run within the tenant's limits.
    """
    bs = limits.block_size
    burst = limits.kv_burst_blocks
    tpm = math.floor(limits.tokens_per_minute) if limits.tokens_per_minute is not None else None
    injected = max_tokens is None
    if max_tokens is None:
        bounds: list[tuple[int, str]] = []
        if burst is not None:
            bounds.append(((burst // sequences) * bs - prompt_tokens, "kv"))
        if tpm is not None:
            bounds.append(((tpm - prompt_tokens) // sequences, "tpm"))
        if limits.max_model_len is not None:
            bounds.append((limits.max_model_len - prompt_tokens, "context"))
        if not bounds:
            bounds.append((limits.default_max_tokens, "default"))
        max_tokens, binding = min(bounds)
        if max_tokens < 1:
            raise RequestTooLarge(_too_large_message(binding, prompt_tokens, sequences, limits), "n")
    blocks = sequences * math.ceil((prompt_tokens + max_tokens) / bs)
    estimate = prompt_tokens + sequences * max_tokens
    param = "n" if sequences > 1 else max_tokens_param
    if burst is not None and blocks > burst:
        raise RequestTooLarge(
            f"this request needs up to {blocks} KV blocks ({sequences} sequence(s) of about "
            f"{prompt_tokens} prompt + {max_tokens} completion tokens, {bs} tokens per block), more than "
            f"this API key's burst limit of {burst} blocks; lower max_tokens or n, or shorten the prompt",
            param,
        )
    if tpm is not None and estimate > tpm:
        raise RequestTooLarge(
            f"this request may use up to {estimate} tokens ({prompt_tokens} prompt + {sequences} x "
            f"{max_tokens} completion), more than the {tpm} tokens per minute this gateway replica admits "
            "for this API key; lower max_tokens or n",
            param,
        )
    return RequestBudget(
        sequences=sequences,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        injected=injected,
        kv_blocks=blocks,
        kv_tokens=blocks * bs,
        token_estimate=estimate,
    )


def _too_large_message(binding: str, prompt_tokens: int, sequences: int, limits: BudgetLimits) -> str:
    what = {
        "kv": f"this API key's KV burst limit of {limits.kv_burst_blocks} blocks",
        "tpm": "the tokens per minute this gateway replica admits for this API key",
        "context": f"the model's context length of {limits.max_model_len} tokens",
        "default": "the gateway's default max_tokens",
    }[binding]
    return (
        f"{sequences} sequence(s) of a prompt of about {prompt_tokens} tokens leave no room to generate "
        f"within {what}; lower n or shorten the prompt"
    )


# -- the gate -------------------------------------------------------------------------------------------
#: OpenAI's rate-limit headers: (limit, remaining, reset) for requests and for tokens.
_REQUEST_HEADERS = tuple(f"x-ratelimit-{what}-requests" for what in ("limit", "remaining", "reset"))
_TOKEN_HEADERS = tuple(f"x-ratelimit-{what}-tokens" for what in ("limit", "remaining", "reset"))


@dataclass(frozen=True)
class GateLimits:
    """The limits of one tenant's gate; ``None`` means unlimited. Rates are the tenant's whole limits:
    the gate enforces ``1 / replicas`` of them (module docstring)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    kv_budget_tokens: int | None = None
    max_queue: int = 64
    max_queue_wait_s: float = 10.0
    replicas: int = 1

    @property
    def requests_share(self) -> float | None:
        """The requests per minute this replica admits."""
        return None if self.requests_per_minute is None else self.requests_per_minute / self.replicas

    @property
    def tokens_share(self) -> float | None:
        """The tokens per minute this replica admits."""
        return None if self.tokens_per_minute is None else self.tokens_per_minute / self.replicas

    @property
    def concurrency_share(self) -> int | None:
        """The concurrent requests this replica admits."""
        return None if self.max_concurrent is None else max(1, self.max_concurrent // self.replicas)

    def describe(self, limit: int, unit: str, shared: bool = False) -> str:
        if self.replicas <= 1 and not shared:
            return f"{limit} {unit}"
        if shared:
            return f"{limit} {unit}, shared by the gateway replicas"
        return f"{limit} {unit} (this gateway replica admits 1/{self.replicas} of it)"


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    kv_tokens: int


class GateSlot:
    """A granted slot in a tenant's gate (what ``TenantGate.acquire`` returns).

    ``release`` exactly once (idempotent) when the request is finished."""

    __slots__ = ("_gate", "_released", "engine", "kv_tokens", "queued_s", "token_estimate")

    def __init__(self, gate: TenantGate, kv_tokens: int, token_estimate: int, queued_s: float) -> None:
        self._gate = gate
        self.kv_tokens = kv_tokens
        self.token_estimate = token_estimate
        self.queued_s = queued_s
        self._released = False
        #: The request's place among the engines' in-flight requests, when the pool limits them.
        self.engine: EngineSlot | None = None

    def reconcile_tokens(self, actual_tokens: int) -> None:
        """Correct the tokens-per-minute charge with the engine's reported usage."""
        if self._gate.tpm is not None:
            self._gate.tpm.adjust(actual_tokens - self.token_estimate)
        self.token_estimate = actual_tokens

    def settle_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The engine's ``usage`` of the finished answer: reconciles tokens per minute and charges the
        tenant's fair-queuing counter (input corrected, output added)."""
        actual = prompt_tokens + completion_tokens
        tpm = self._gate.tpm
        if tpm is not None:
            tpm.adjust(actual - self.token_estimate)
        self.token_estimate = actual
        if self.engine is not None:
            self.engine.settle(prompt_tokens, completion_tokens)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self.engine is not None:
                self.engine.release()
            self._gate.release_slot(self.kv_tokens)


class TenantGate:
    """Admission state of one tenant (see the module docstring for the contract)."""

    def __init__(
        self,
        limits: GateLimits,
        clock: Clock = time.monotonic,
        demand: Callable[[float, float], None] | None = None,
    ) -> None:
        self._clock = clock
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.limits = limits
        #: What each request asked of this replica (requests, tokens), for the shared store's split;
        #: ``None`` without one.
        self.demand = demand
        #: This replica's fractions of the requests and tokens per minute; ``None``: ``1 / replicas``.
        self.fractions: tuple[float, float] | None = None
        self.in_flight = 0
        self.kv_in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._header_plan: tuple[tuple[TokenBucket, tuple[str, ...], str], ...] = ()
        self.update_limits(limits)

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    def update_limits(self, limits: GateLimits) -> None:
        """Apply new limits (hot reload) without losing in-flight accounting or bucket levels."""
        self.limits = limits
        self._concurrency_share = limits.concurrency_share
        self._apply_rates()
        self._wake()

    def set_fractions(self, fractions: tuple[float, float] | None) -> None:
        """This replica's fractions of the tenant's requests and tokens per minute (the shared store's
        split), or ``None`` for the static ``1 / replicas``. Bucket levels are kept (capped)."""
        if fractions != self.fractions:
            self.fractions = fractions
            self._apply_rates()

    def _apply_rates(self) -> None:
        limits = self.limits
        if self.fractions is None:
            rpm, tpm = limits.requests_share, limits.tokens_share
        else:
            rpm_f, tpm_f = self.fractions
            rpm = None if limits.requests_per_minute is None else limits.requests_per_minute * rpm_f
            tpm = None if limits.tokens_per_minute is None else limits.tokens_per_minute * tpm_f
        self.rpm = self._bucket(self.rpm, rpm)
        self.tpm = self._bucket(self.tpm, tpm)
        # What ``rate_limit_headers`` writes for each bucket that is set; the limit's text only changes
        # here, so it is formatted once, not per response.
        self._header_plan = tuple(
            (bucket, names, str(max(1, int(bucket.capacity))))
            for bucket, names in ((self.rpm, _REQUEST_HEADERS), (self.tpm, _TOKEN_HEADERS))
            if bucket is not None
        )

    def _bucket(self, bucket: TokenBucket | None, per_minute: float | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self._clock)
        if bucket.capacity != per_minute:
            bucket.set_per_minute(per_minute)
        return bucket

    def check_request_rate(self) -> None:
        """Raise ``Throttled`` when the requests-per-minute bucket has no room now; takes nothing.

        Called before the body is read, so a tenant over its request rate costs no body read or parse.
        """
        if self.rpm is not None:
            wait = self.rpm.wait_for(1)
            if wait > 0:
                if self.demand is not None:
                    self.demand(1.0, 0.0)
                raise self._rpm_throttled(wait)

    def _rpm_throttled(self, wait: float) -> Throttled:
        assert self.limits.requests_per_minute is not None
        limit = self.limits.describe(
            self.limits.requests_per_minute, "requests per minute", self.fractions is not None
        )
        return Throttled("requests_per_minute", wait, f"rate limit reached: {limit}")

    def rate_limit_headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for this replica's buckets (a trio per limit that is set)."""
        headers: dict[str, str] = {}
        for bucket, (limit, remaining, reset), limit_text in self._header_plan:
            headers[limit] = limit_text
            headers[remaining], headers[reset] = bucket.header_values()
        return headers

    def _blocker(self, kv_tokens: int) -> str | None:
        """Why a request of ``kv_tokens`` cannot start now (``None``: it can)."""
        concurrency = self._concurrency_share
        if concurrency is not None and self.in_flight >= concurrency:
            return "concurrency"
        budget = self.limits.kv_budget_tokens
        if budget is not None and self.in_flight > 0 and self.kv_in_flight + kv_tokens > budget:
            return "kv_budget"
        return None

    def _grant(self, kv_tokens: int) -> None:
        self.in_flight += 1
        self.kv_in_flight += kv_tokens

    def _refund(self, token_estimate: int) -> None:
        if self.rpm is not None:
            self.rpm.adjust(-1)
        if self.tpm is not None:
            self.tpm.adjust(-token_estimate)

    async def acquire(
        self, token_estimate: int, kv_tokens: int, engine: EngineRequest | None = None
    ) -> GateSlot:
        """Admit a request or raise ``Throttled``; may wait in the tenant's queue (bounded), then, with
        ``engine``, for room on the pool's engines (``EngineQueue``, bounded by the same wait).

        A request that finds room in both (nothing waits ahead of it) is admitted without suspending:
        the usual case makes no future and awaits nothing."""
        slot = self._admit_now(token_estimate, kv_tokens)
        if slot is None:
            slot = await self._wait_for_room(token_estimate, kv_tokens)
        if engine is None:
            return slot
        queue = engine.queue
        now = queue.dispatch_now(engine)
        if now is not None:
            slot.engine = now
            return slot
        # One wait bound for both queues: what the tenant's own queue took is not given again.
        wait_s = max(0.0, self.limits.max_queue_wait_s - slot.queued_s)
        try:
            slot.engine = await queue.acquire(engine, wait_s, self.limits.max_queue)
        except BaseException:
            self._refund(token_estimate)
            slot.release()
            raise
        slot.queued_s += slot.engine.queued_s
        return slot

    def _admit_now(self, token_estimate: int, kv_tokens: int) -> GateSlot | None:
        """Charge the rate buckets (``Throttled`` when one is short) and take a slot when one is free and
        nobody waits for it; ``None``: the request must wait (``_wait_for_room``)."""
        if self.demand is not None:
            self.demand(1.0, float(token_estimate))
        if self.rpm is not None:
            wait = self.rpm.try_take(1)
            if wait > 0:
                raise self._rpm_throttled(wait)
        if self.tpm is not None:
            wait = self.tpm.try_take(token_estimate)
            if wait > 0:
                if self.rpm is not None:
                    self.rpm.adjust(-1)
                tpm_limit = self.limits.tokens_per_minute
                assert tpm_limit is not None
                raise Throttled(
                    "tokens_per_minute",
                    wait,
                    "rate limit reached: "
                    f"{self.limits.describe(tpm_limit, 'tokens per minute', self.fractions is not None)} "
                    f"(this request is estimated at {token_estimate} tokens)",
                )
        if not self._waiters and self._blocker(kv_tokens) is None:
            self._grant(kv_tokens)
            return GateSlot(self, kv_tokens, token_estimate, 0.0)
        return None

    async def _wait_for_room(self, token_estimate: int, kv_tokens: int) -> GateSlot:
        """Wait in the tenant's queue (bounded in length and time) for a slot; the buckets are charged."""
        reason = self._blocker(kv_tokens) or "concurrency"
        if self.queued >= self.limits.max_queue:
            self._refund(token_estimate)
            raise Throttled(reason, 1.0, self._queue_message(reason, "the tenant's queue is full"))
        start = self._clock()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(future, kv_tokens))
        try:
            async with asyncio.timeout(self.limits.max_queue_wait_s):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled():
                # Granted in the same loop iteration the timeout fired: keep the slot.
                return GateSlot(self, kv_tokens, token_estimate, self._clock() - start)
            self._refund(token_estimate)
            raise Throttled(
                reason,
                1.0,
                self._queue_message(reason, f"waited {self.limits.max_queue_wait_s:g} s in the queue"),
            ) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release_slot(kv_tokens)
            else:
                future.cancel()
            self._refund(token_estimate)
            raise
        return GateSlot(self, kv_tokens, token_estimate, self._clock() - start)

    def _queue_message(self, reason: str, what: str) -> str:
        if reason == "concurrency":
            assert self.limits.max_concurrent is not None
            limit = self.limits.describe(self.limits.max_concurrent, "concurrent requests")
            return f"too many concurrent requests (limit {limit}); {what}"
        return (
            f"KV budget exhausted ({self.kv_in_flight} of {self.limits.kv_budget_tokens} tokens "
            f"in flight); {what}"
        )

    def release_slot(self, kv_tokens: int) -> None:
        self.in_flight -= 1
        self.kv_in_flight -= kv_tokens
        self._wake()

    def _wake(self) -> None:
        """Grant waiting requests in FIFO order while the head of the queue fits."""
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            if self._blocker(head.kv_tokens) is not None:
                return
            self._waiters.popleft()
            self._grant(head.kv_tokens)
            head.future.set_result(None)


# -- the engines' in-flight limit, in fair order ------------------------------------------------------------
class EngineRequest(NamedTuple):
    """What ``EngineQueue`` needs to know of one request (a named tuple: built for every request)."""

    queue: EngineQueue
    tenant: str
    #: Higher is served first (``config.SLA_RANK`` of the tenant's tier).
    rank: int
    weight: float
    prompt_tokens: int


class EngineSlot:
    """A request's place among a pool's in-flight requests; ``release`` is idempotent."""

    __slots__ = ("_queue", "_ticket", "queued_s")

    def __init__(
        self, queue: EngineQueue, ticket: Ticket[asyncio.Future[None] | None], queued_s: float
    ) -> None:
        self._queue = queue
        self._ticket = ticket
        self.queued_s = queued_s

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._queue.fair.settle(self._ticket, prompt_tokens, completion_tokens)

    def release(self) -> None:
        self._queue.finish(self._ticket)


class EngineQueue:
    """At most ``limit`` requests of one pool on its engines; the rest held in fair order (module
    docstring). ``limit=None``: no limit, nothing is held (requests still charge the counters, so turning
    the limit on later starts from what was served)."""

    def __init__(
        self,
        limit: int | None,
        fair: bool = True,
        cost: TokenCost | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        #: A ticket's item is the future its waiter awaits (``None``: dispatched at once, nobody waits).
        self.fair: FairQueue[asyncio.Future[None] | None] = FairQueue(limit, cost, fair=fair)
        self._clock = clock
        self._held: dict[str, int] = {}
        #: The limit the settings give (``set_limit``); the shared store may steer it (``steer``).
        self.static_limit = limit
        self._steered: int | None = None

    @property
    def limit(self) -> int | None:
        return self.fair.limit

    @property
    def in_flight(self) -> int:
        return self.fair.in_flight

    def held(self, tenant: str | None = None) -> int:
        """Requests waiting for room (of one tenant, or all)."""
        return sum(self._held.values()) if tenant is None else self._held.get(tenant, 0)

    def set_limit(self, limit: int | None) -> None:
        """A reload (replicas or the per-replica limit changed); releases what now fits. A limit the
        shared store steers stays until its next sync."""
        self.static_limit = limit
        self.fair.set_limit(self._steered if self._steered is not None and limit is not None else limit)
        self._dispatch()

    def steer(self, limit: int | None, caps: dict[str, int] | None = None) -> None:
        """This replica's part of the pool's engines and each tenant's part of that, as the shared
        store's split sets them (``gateway.shares.engine_split``); ``None``: back to the static limit and
        no caps. No effect without a limit."""
        if self.static_limit is None:
            return
        self._steered = limit
        self.fair.caps = caps if limit is not None and caps else {}
        self.fair.set_limit(self.static_limit if limit is None else limit)
        self._dispatch()

    def dispatch_now(self, request: EngineRequest) -> EngineSlot | None:
        """Room on the engines now, when nothing waits and the limit has room (the common case: no
        future, no queueing); ``None``: ``acquire`` it."""
        now = self.fair.dispatch_now(
            request.tenant, request.rank, request.weight, request.prompt_tokens, None
        )
        return None if now is None else EngineSlot(self, now, 0.0)

    async def acquire(self, request: EngineRequest, max_wait_s: float, max_held: int) -> EngineSlot:
        """Room on the engines, at once or after waiting at most ``max_wait_s`` behind at most ``max_held``
        other held requests of the same tenant; else ``Throttled`` with reason ``engine_queue``."""
        now = self.dispatch_now(request)
        if now is not None:
            return now
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket = self.fair.push(request.tenant, request.rank, request.weight, request.prompt_tokens, future)
        self._dispatch()
        if future.done():
            return EngineSlot(self, ticket, 0.0)
        if self._held.get(request.tenant, 0) >= max_held:
            self.fair.cancel(ticket)
            raise Throttled(
                "engine_queue",
                1.0,
                f"the engines are saturated and this API key already has {max_held} requests "
                "waiting for them; retry later",
            )
        start = self._clock()
        self._held[request.tenant] = self._held.get(request.tenant, 0) + 1
        try:
            async with asyncio.timeout(max_wait_s):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled():
                # Dispatched in the same loop iteration the timeout fired: keep the slot.
                return EngineSlot(self, ticket, self._clock() - start)
            self.fair.cancel(ticket)
            raise Throttled(
                "engine_queue",
                1.0,
                f"the engines are saturated; waited {max_wait_s:.3g} s for a turn (other "
                "tenants of this tier are served in proportion to their weights); retry later",
            ) from None
        except asyncio.CancelledError:
            if not self.fair.cancel(ticket):  # dispatched already: hand the slot on
                self.fair.undo(ticket)
                self._dispatch()
            raise
        finally:
            left = self._held[request.tenant] - 1
            if left:
                self._held[request.tenant] = left
            else:
                del self._held[request.tenant]
        return EngineSlot(self, ticket, self._clock() - start)

    def finish(self, ticket: Ticket[asyncio.Future[None] | None]) -> None:
        self.fair.finish(ticket)
        self._dispatch()

    def _dispatch(self) -> None:
        if not self.fair.waiting():
            return
        for ticket in self.fair.drain():
            future = ticket.item
            assert future is not None  # only waiting tickets are drained, and each has its future
            if future.done():  # its waiter was cancelled and has not run its handler yet
                self.fair.undo(ticket)
                continue
            future.set_result(None)


# -- request bodies in memory ---------------------------------------------------------------------------
class BodyBudgetExceeded(Exception):
    """No room to hold a request body; ``scope`` is ``tenant`` (its share is full) or ``gateway``."""

    def __init__(self, scope: str, message: str) -> None:
        super().__init__(message)
        self.scope = scope
        self.message = message


class BodyBudget:
    """Bytes of request bodies held at once: at most ``per_tenant`` for one tenant, ``total`` for all.

    A body is reserved before it is read (its ``Content-Length``, or chunk by chunk when it has none)
    and released once it has been sent upstream, so memory held for bodies stays bounded however many
    connections send them, and one tenant's large bodies cannot take every other tenant's room.
    """

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.used = 0
        self.by_tenant: dict[str, int] = {}

    def reserve(self, tenant: str, amount: int) -> BodyReservation:
        reservation = BodyReservation(self, tenant)
        reservation.grow(amount)
        return reservation

    def _take(self, tenant: str, amount: int) -> None:
        held = self.by_tenant.get(tenant, 0)
        if held + amount > self.per_tenant:
            raise BodyBudgetExceeded(
                "tenant",
                f"too much request body in flight for this API key ({held + amount} bytes, limit "
                f"{self.per_tenant}); retry when earlier requests have been sent",
            )
        if self.used + amount > self.total:
            raise BodyBudgetExceeded("gateway", "the gateway is holding as many request bodies as it may")
        self.by_tenant[tenant] = held + amount
        self.used += amount

    def _give_back(self, tenant: str, amount: int) -> None:
        self.used -= amount
        left = self.by_tenant[tenant] - amount
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]


class BodyReservation:
    """Bytes one request holds in a ``BodyBudget``; ``release`` is idempotent."""

    __slots__ = ("_budget", "held", "tenant")

    def __init__(self, budget: BodyBudget, tenant: str) -> None:
        self._budget = budget
        self.tenant = tenant
        self.held = 0

    def grow(self, amount: int) -> None:
        if amount > 0:
            self._budget._take(self.tenant, amount)
            self.held += amount

    def release(self) -> None:
        if self.held:
            self._budget._give_back(self.tenant, self.held)
            self.held = 0
