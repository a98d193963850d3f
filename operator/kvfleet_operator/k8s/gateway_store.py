"""Asks the gateways' shared store (``build/gateway_store.py``) whether it serves: an authenticated PING,
at most once per ``ttl_s`` for every ModelDeployment together (they share one store). The only traffic
the operator sends to it; what the answer means is ``reconcile/status.py``'s (``SharedStoreUnreachable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from kvfleet_operator.build.gateway_store import GatewayStore
from kvfleet_runtime.config import without_credentials


class GatewayStoreProbe:
    """``await problem()`` -> ``None`` while the store answers, else why not (for a condition message)."""

    def __init__(
        self,
        store: GatewayStore,
        ttl_s: float = 10.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._checked_at: float | None = None
        self._problem: str | None = None
        self._lock = asyncio.Lock()

    def _client(self) -> aioredis.Redis:
        kwargs: dict[str, Any] = {
            "password": self.store.password,
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
        }
        if self.store.url.startswith("rediss://") and self.store.ca_pem is not None:
            kwargs["ssl_ca_data"] = self.store.ca_pem
        return aioredis.Redis.from_url(self.store.url, **kwargs)

    async def problem(self) -> str | None:
        async with self._lock:
            now = self._clock()
            if self._checked_at is None or now - self._checked_at >= self._ttl_s:
                self._problem = await self._ask()
                self._checked_at = self._clock()
            return self._problem

    async def _ask(self) -> str | None:
        where = without_credentials(self.store.url)
        client = self._client()
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                await client.ping()
        except Exception as exc:  # noqa: BLE001 - every failure is the same condition, its text the message
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return (
                f"the gateways' shared store {where} does not answer the operator ({error}); each gateway "
                "replica enforces its static 1/replicas share of every tenant's rate limits until it does"
            )
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await client.aclose()
        return None
