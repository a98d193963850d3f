"""Replica placement: prefix affinity on a consistent-hash ring, bounded by load, and the deepest cached
prefix under the same bound.

A request's affinity key is its cache salt plus the first characters of its prompt, so a tenant's
repeated prefixes land on the replica that has them cached, while different tenants' identical prompts
(different salts) spread independently. Plain consistent hashing would pile a hot prefix onto one
replica; *bounded-load* consistent hashing (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", SODA 2018) walks the ring past any replica whose in-flight count is at or above
``ceil(load_factor x (total + 1) / n)`` so no replica exceeds the average by more than ``load_factor``.

Pure: the gateway (``gateway/routing.py``, ``gateway/pipeline.py``) and the simulator
(``kv/simulator.py``) place requests with these same functions.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "HashRing",
    "build_hash_ring",
    "compute_hash",
    "compute_load_cap",
    "select_deepest",
    "select_precise",
    "select_replica",
]


def compute_hash(data: bytes) -> int:
    """A stable 64-bit hash (the same on every gateway replica and across restarts)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class HashRing:
    """Replicas placed at ``vnodes`` points each; ``points`` is sorted by position."""

    points: tuple[tuple[int, str], ...]
    replicas: tuple[str, ...]

    def walk(self, key: bytes) -> list[str]:
        """Distinct replicas in ring order, starting at the key's position."""
        if not self.points:
            return []
        start = bisect.bisect_left(self.points, (compute_hash(key), ""))
        seen: list[str] = []
        n = len(self.points)
        for i in range(n):
            replica = self.points[(start + i) % n][1]
            if replica not in seen:
                seen.append(replica)
                if len(seen) == len(self.replicas):
                    break
        return seen


def build_hash_ring(replicas: Iterable[str], vnodes: int = 64) -> HashRing:
    """A ring over ``replicas`` (duplicates collapse). Adding one replica moves ~1/n of the keys."""
    unique = tuple(dict.fromkeys(replicas))
    points = sorted((compute_hash(f"{r}#{i}".encode()), r) for r in unique for i in range(vnodes))
    return HashRing(tuple(points), unique)


def compute_load_cap(loads: Mapping[str, int], candidates: Sequence[str], load_factor: float) -> int:
    """The most in-flight requests a candidate may hold to accept one more request."""
    total = sum(loads.get(c, 0) for c in candidates) + 1
    return max(1, math.ceil(load_factor * total / len(candidates)))


def select_replica(
    ring: HashRing,
    key: bytes,
    *,
    healthy: set[str],
    loads: Mapping[str, int],
    exclude: set[str] | frozenset[str] = frozenset(),
    load_factor: float = 1.25,
) -> str | None:
    """The first healthy, non-excluded replica clockwise from ``key`` whose load is under the cap.

    ``None`` when no replica is eligible. With ``load_factor > 1`` some candidate is always under the
    cap, so the result is deterministic for a given key, health and load.
    """
    order = [r for r in ring.walk(key) if r in healthy and r not in exclude]
    if not order:
        return None
    cap = compute_load_cap(loads, order, load_factor)
    for replica in order:
        if loads.get(replica, 0) < cap:
            return replica
    return min(order, key=lambda r: loads.get(r, 0))


def select_deepest(
    depths: Mapping[str, int],
    *,
    healthy: set[str],
    loads: Mapping[str, int],
    exclude: set[str] | frozenset[str] = frozenset(),
    load_factor: float = 1.25,
) -> str | None:
    """Precise routing's choice: of the replicas holding the longest cached prefix (``depths``: replica ->
    leading blocks it holds, from ``kv_index.PrefixIndex.match``) and under the same load cap as
    ``select_replica``, the deepest (the least loaded, then the first by name, on ties). ``None`` when
    no replica holding a block is eligible: the caller falls back to affinity."""
    candidates = [r for r in healthy if r not in exclude]
    if not candidates:
        return None
    cap = compute_load_cap(loads, candidates, load_factor)
    eligible = [r for r in candidates if depths.get(r, 0) > 0 and loads.get(r, 0) < cap]
    if not eligible:
        return None
    return min(eligible, key=lambda r: (-depths[r], loads.get(r, 0), r))


def select_precise(
    ring: HashRing,
    key: bytes,
    depths: Mapping[str, int],
    *,
    healthy: set[str],
    loads: Mapping[str, int],
    exclude: set[str] | frozenset[str] = frozenset(),
    load_factor: float = 1.25,
) -> tuple[str | None, bool]:
    """Precise routing: the replica affinity picks (``select_replica``) unless another one under the same
    load cap holds a strictly longer cached prefix (``select_deepest``), and whether the index chose (the
    chosen replica holds some of the prefix). Ties stay with affinity: KV events report what a GPU holds,
    and the affinity replica may hold the rest of the prompt in its own offload tiers (LMCache's CPU and
    disk), of which an equal GPU match says nothing; moving the request would recompute it."""
    chosen = select_replica(ring, key, healthy=healthy, loads=loads, exclude=exclude, load_factor=load_factor)
    deepest = select_deepest(depths, healthy=healthy, loads=loads, exclude=exclude, load_factor=load_factor)
    if deepest is not None and (chosen is None or depths[deepest] > depths.get(chosen, 0)):
        chosen = deepest
    return chosen, chosen is not None and depths.get(chosen, 0) > 0
