"""Per-tenant admission control: rate limits, concurrency and the KV-footprint budget.

Contract (one ``TenantGate`` per tenant, per gateway process; limits are not shared across gateway
replicas, so N replicas admit up to N times the configured rates):

* ``requests_per_minute`` and ``tokens_per_minute`` are token buckets holding one minute of budget and
  refilling continuously. A request that finds its bucket short is refused at once with the seconds
  until it would fit (``Throttled.retry_after``, sent as ``Retry-After``). A request whose token estimate
  exceeds a whole minute of budget is admitted only when the bucket is full and leaves it in debt, so it
  is never refused forever.
* Token cost is estimated before the engine answers (prompt estimate + ``max_tokens``) and reconciled
  with the engine's ``usage`` when the answer is complete (``GateSlot.reconcile_tokens``).
* ``max_concurrent`` requests and a KV budget (sum of prompt + max_tokens of admitted requests, at most
  the tenant's burst limit ``hbm_burst_blocks x block_size``) bound what is in flight. A request that does
  not fit waits in a FIFO queue of bounded length for a bounded time; a full queue or a timed-out wait is
  a 429. A lone request larger than the whole KV budget is admitted when nothing else of the tenant is
  in flight, so it cannot starve.
* Nothing is dropped silently: every refusal raises ``Throttled``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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


class TokenBucket:
    """A bucket of ``per_minute`` tokens refilled continuously at ``per_minute / 60`` per second."""

    def __init__(self, per_minute: int, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
        self._stamp = now

    def try_take(self, amount: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds until it would fit."""
        self._refill()
        if self.level >= amount or (amount > self.capacity and self.level >= self.capacity):
            self.level -= amount
            return 0.0
        return (min(amount, self.capacity) - self.level) / self.rate

    def adjust(self, delta: float) -> None:
        """Charge ``delta`` more (negative: refund). The level may go negative (debt), never above full."""
        self._refill()
        self.level = min(self.capacity, self.level - delta)

    def set_per_minute(self, per_minute: int) -> None:
        """Change the rate on a config reload, keeping what is left (capped at the new capacity)."""
        self._refill()
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


@dataclass(frozen=True)
class GateLimits:
    """The limits of one tenant's gate; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    kv_budget_tokens: int | None = None
    max_queue: int = 64
    max_queue_wait_s: float = 10.0


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    kv_tokens: int


class GateSlot:
    """A granted slot in a tenant's gate (what ``TenantGate.acquire`` returns).

    ``release`` exactly once (idempotent) when the request is finished."""

    __slots__ = ("_gate", "_released", "kv_tokens", "queued_s", "token_estimate")

    def __init__(self, gate: TenantGate, kv_tokens: int, token_estimate: int, queued_s: float) -> None:
        self._gate = gate
        self.kv_tokens = kv_tokens
        self.token_estimate = token_estimate
        self.queued_s = queued_s
        self._released = False

    def reconcile_tokens(self, actual_tokens: int) -> None:
        """Correct the tokens-per-minute charge with the engine's reported usage."""
        if self._gate.tpm is not None:
            self._gate.tpm.adjust(actual_tokens - self.token_estimate)
        self.token_estimate = actual_tokens

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._gate.release_slot(self.kv_tokens)


class TenantGate:
    """Admission state of one tenant (see the module docstring for the contract)."""

    def __init__(self, limits: GateLimits, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.limits = limits
        self.in_flight = 0
        self.kv_in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self.update_limits(limits)

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    def update_limits(self, limits: GateLimits) -> None:
        """Apply new limits (hot reload) without losing in-flight accounting or bucket levels."""
        self.limits = limits
        self.rpm = self._bucket(self.rpm, limits.requests_per_minute)
        self.tpm = self._bucket(self.tpm, limits.tokens_per_minute)
        self._wake()

    def _bucket(self, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self._clock)
        if bucket.capacity != per_minute:
            bucket.set_per_minute(per_minute)
        return bucket

    def _blocker(self, kv_tokens: int) -> str | None:
        """Why a request of ``kv_tokens`` cannot start now (``None``: it can)."""
        limits = self.limits
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            return "concurrency"
        budget = limits.kv_budget_tokens
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

    async def acquire(self, token_estimate: int, kv_tokens: int) -> GateSlot:
        """Admit a request or raise ``Throttled``; may wait in the tenant's queue (bounded)."""
        if self.rpm is not None:
            wait = self.rpm.try_take(1)
            if wait > 0:
                raise Throttled(
                    "requests_per_minute",
                    wait,
                    f"rate limit reached: {self.limits.requests_per_minute} requests per minute",
                )
        if self.tpm is not None:
            wait = self.tpm.try_take(token_estimate)
            if wait > 0:
                if self.rpm is not None:
                    self.rpm.adjust(-1)
                raise Throttled(
                    "tokens_per_minute",
                    wait,
                    f"rate limit reached: {self.limits.tokens_per_minute} tokens per minute "
                    f"(this request is estimated at {token_estimate} tokens)",
                )
        blocker = self._blocker(kv_tokens)
        if blocker is None and not self._waiters:
            self._grant(kv_tokens)
            return GateSlot(self, kv_tokens, token_estimate, 0.0)
        reason = blocker or "concurrency"
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
            return f"too many concurrent requests (limit {self.limits.max_concurrent}); {what}"
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
