"""Replica selection: prefix affinity on a consistent-hash ring, bounded by load.

A request's affinity key is its cache salt plus the first characters of its prompt, so a tenant's
repeated prefixes land on the replica that has them cached, while different tenants' identical prompts
(different salts) spread independently. Plain consistent hashing would pile a hot prefix onto one
replica; *bounded-load* consistent hashing (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", SODA 2018) walks the ring past any replica whose in-flight count is at or above
``ceil(load_factor x (total + 1) / n)`` so no replica exceeds the average by more than ``load_factor``.

Everything here is pure except ``ReplicaState``'s counters, which the server updates.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


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


@dataclass
class ReplicaState:
    """What the gateway knows about one engine replica."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    last_error: str = ""
    checked: bool = False


@dataclass
class PoolRouter:
    """Replicas of one pool, their ring and their live state."""

    name: str
    ring: HashRing
    replicas: dict[str, ReplicaState] = field(default_factory=dict)

    @property
    def healthy(self) -> set[str]:
        return {url for url, state in self.replicas.items() if state.healthy}

    def loads(self) -> dict[str, int]:
        return {url: state.in_flight for url, state in self.replicas.items()}

    def choose(self, key: bytes, exclude: set[str], load_factor: float) -> ReplicaState | None:
        """``select_replica`` over the live state; a pool of one replica skips the ring and the load cap,
        which cannot change the answer (the only candidate is under its cap or the least loaded)."""
        if len(self.replicas) == 1:
            (only,) = self.replicas.values()
            return only if only.healthy and only.url not in exclude else None
        url = select_replica(
            self.ring, key, healthy=self.healthy, loads=self.loads(), exclude=exclude, load_factor=load_factor
        )
        return None if url is None else self.replicas[url]


def build_pool_router(
    name: str, endpoints: Sequence[str], previous: PoolRouter | None, vnodes: int = 64
) -> PoolRouter:
    """A router for ``endpoints``, keeping health and load of replicas that were already known."""
    urls = [e.rstrip("/") for e in endpoints]
    old = previous.replicas if previous is not None else {}
    replicas = {url: old.get(url) or ReplicaState(url) for url in dict.fromkeys(urls)}
    return PoolRouter(name, build_hash_ring(urls, vnodes), replicas)
