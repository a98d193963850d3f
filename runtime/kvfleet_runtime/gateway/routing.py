"""The gateway's live view of each pool's replicas: health, in-flight counts and the ring
(the placement itself is pure, ``kv/placement.py``).

Everything here is pure except ``ReplicaState``'s counters, which the server updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet_runtime.kv.placement import HashRing, build_hash_ring, select_replica

__all__ = ["PoolRouter", "ReplicaState", "build_pool_router"]


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
