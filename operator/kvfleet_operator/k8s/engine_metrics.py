"""Reads the KV blocks each engine pod allocated from its metrics port. The only HTTP the operator does
outside the API server; the decisions are ``reconcile/capacity.py``'s.

vLLM allocates its KV cache once, at start, so a pod's figure is a fact for the pod's whole life: it is read
once per pod UID and remembered (a new pod, a restarted one, has a new UID; a restarted container keeps its
pod's UID but reallocates the same cache from the same settings). A pod that does not answer (still
starting, a network that does not route to it) is asked again after ``retry_s``, never on every resync.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import aiohttp

from kvfleet_operator.reconcile.capacity import MetricsTarget
from kvfleet_runtime.kv.reported_capacity import parse_reported_blocks

log = logging.getLogger(__name__)

#: An engine page names every tenant (a few MiB with thousands of them); anything larger is not an engine.
MAX_METRICS_BYTES = 32 << 20
#: How many pods' figures are remembered (across all ModelDeployments); the oldest are forgotten first.
MAX_REMEMBERED = 16384


class EngineCapacityReader:
    """``read(targets)`` -> pod name -> KV blocks, for the targets that answer with a figure."""

    def __init__(
        self, timeout_s: float = 3.0, retry_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(1.0, timeout_s))
        self._retry_s = retry_s
        self._clock = clock
        self._known: OrderedDict[str, int] = OrderedDict()
        self._failed: dict[str, float] = {}

    async def read(self, targets: Sequence[MetricsTarget]) -> dict[str, int]:
        now = self._clock()
        due = [
            t
            for t in targets
            if t.uid not in self._known and now - self._failed.get(t.uid, -self._retry_s) >= self._retry_s
        ]
        if due:
            async with aiohttp.ClientSession(timeout=self._timeout) as session:
                figures = await asyncio.gather(*(self._read_one(session, t) for t in due))
            for target, blocks in zip(due, figures, strict=True):
                if blocks is None:
                    self._failed[target.uid] = now
                else:
                    self._failed.pop(target.uid, None)
                    self._known[target.uid] = blocks
            while len(self._known) > MAX_REMEMBERED:
                self._known.popitem(last=False)
            if len(self._failed) > MAX_REMEMBERED:
                self._failed.clear()
        return {t.pod: self._known[t.uid] for t in targets if t.uid in self._known}

    async def _read_one(self, session: aiohttp.ClientSession, target: MetricsTarget) -> int | None:
        try:
            async with session.get(target.url) as resp:
                if resp.status != 200:
                    log.info("engine %s: metrics answered %d", target.pod, resp.status)
                    return None
                body = await resp.content.read(MAX_METRICS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("engine %s: metrics not read (%s)", target.pod, exc.__class__.__name__)
            return None
        if len(body) > MAX_METRICS_BYTES:
            log.warning("engine %s: metrics page over %d bytes, ignored", target.pod, MAX_METRICS_BYTES)
            return None
        try:
            return parse_reported_blocks(body.decode("utf-8", errors="replace"))
        except ValueError as exc:  # prometheus_client's parser on a page that is not an exposition
            log.info("engine %s: metrics do not parse (%s)", target.pod, exc)
            return None
