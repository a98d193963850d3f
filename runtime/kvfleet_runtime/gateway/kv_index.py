"""Which engine replica holds which KV blocks, from the engines' own KV events, scoped by cache salt.

vLLM publishes every change of its prefix cache (``--kv-events-config``, ZMQ): ``BlockStored`` (the
blocks' hashes, their parent's, their token ids and, per block, the extra keys that entered the hash; the
first block's hold the request's ``cache_salt``), ``BlockRemoved`` and ``AllBlocksCleared``. vLLM's hashes
cannot be recomputed here (they are seeded per process), so the index keys each block by its own chain
hash: ``key_0 = H(salt)``, ``key_i = H(key_{i-1}, tokens of block i)``, the same function the gateway
applies to a request's tokens (``chain_keys``). The salt is in every key: one tenant's request never
matches another tenant's blocks, even for identical tokens. Blocks stored without a salt, or with keys the
gateway's requests cannot reproduce (multimodal inputs, prompt embeddings, LoRA), are not indexed.

The index heals: a replica whose event sequence skips or restarts (events lost, engine restarted), that
clears its cache, or that leaves the pool is forgotten at once; an entry older than the TTL (a removal
the engine never sent) goes; and a request whose engine reports fewer cached tokens than the index
predicted removes the blocks that were not there (``correct``). Forgetting only costs predictions: the
router falls back to prefix affinity where the index knows nothing.

Everything here is pure (the clock is passed in); ``gateway/kv_events.py`` feeds it from the sockets.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: An engine's own block hash as its events carry it (an int or bytes, per vLLM's hash function).
EngineHash = int | bytes


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def salt_key(salt: str) -> int:
    """The chain's seed for one cache salt."""
    return _h(b"kvfleet-kv\x00" + salt.encode())


def next_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of a block of ``tokens`` after a block keyed ``parent``."""
    return _h(parent.to_bytes(8, "big") + array("q", tokens).tobytes())


def chain_keys(salt: str, tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys of a request's whole blocks (a partial last block is never cached)."""
    keys: list[int] = []
    key = salt_key(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = next_key(key, tokens[start : start + block_size])
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: ``hashes[i]`` holds ``tokens[i*block_size:(i+1)*block_size]``."""

    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    tokens: tuple[int, ...]
    block_size: int
    #: The first block's salt when it starts a chain (``parent is None``); ``None``: no salt.
    salt: str | None
    #: Some block's hash holds keys the gateway cannot reproduce (LoRA, media, embeddings).
    foreign: bool


@dataclass(frozen=True)
class Removed:
    hashes: tuple[EngineHash, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _salt_of(extra: Any) -> tuple[str | None, bool]:
    """The salt among a block's published extra keys, and whether any other key entered its hash."""
    if not extra:
        return None, False
    strings = [k for k in extra if isinstance(k, str)]
    foreign = len(strings) != len(extra) or len(strings) > 1
    return (strings[0] if strings else None), foreign


def parse_events(batch: Any) -> list[Event]:
    """vLLM's ``KVEventBatch`` as msgpack decodes it (``[ts, [event, ...], dp_rank]``, each event a map
    with a ``type``). Raises ``ValueError`` on a shape it does not know."""
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise ValueError("not a KV event batch")
    out: list[Event] = []
    for raw in batch[1]:
        if not isinstance(raw, Mapping):
            raise ValueError("a KV event that is not a map")
        kind = raw.get("type")
        if kind == "BlockStored":
            extras = raw.get("extra_keys") or []
            salt, foreign = _salt_of(extras[0] if extras else None)
            foreign = foreign or raw.get("lora_name") is not None or any(extras[1:])
            out.append(
                Stored(
                    tuple(raw["block_hashes"]),
                    raw.get("parent_block_hash"),
                    tuple(raw["token_ids"]),
                    int(raw["block_size"]),
                    salt,
                    foreign,
                )
            )
        elif kind == "BlockRemoved":
            out.append(Removed(tuple(raw["block_hashes"])))
        elif kind == "AllBlocksCleared":
            out.append(Cleared())
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
    return out


@dataclass
class _Entry:
    key: int
    salt: str
    seen: float


@dataclass
class _Replica:
    blocks: dict[EngineHash, _Entry] = field(default_factory=dict)
    by_key: dict[int, EngineHash] = field(default_factory=dict)
    #: The last event batch's sequence number; ``None`` before the first.
    seq: int | None = None


@dataclass
class PrefixIndex:
    """Blocks by replica, and replicas by block key. ``ttl_s``: how long an entry lives without being
    stored again (a safety net for a removal that was never published)."""

    ttl_s: float = 3600.0
    replicas: dict[str, _Replica] = field(default_factory=dict)
    holders: dict[int, set[str]] = field(default_factory=dict)
    #: Indexed blocks per salt, over every replica: a salt with none is not worth tokenizing for.
    per_salt: Counter[str] = field(default_factory=Counter)

    @property
    def size(self) -> int:
        return sum(len(r.blocks) for r in self.replicas.values())

    def knows(self, salt: str) -> bool:
        return self.per_salt[salt] > 0

    # -- feeding ------------------------------------------------------------------------------------
    def observe(self, replica: str, seq: int, events: Iterable[Event], now: float) -> str | None:
        """Apply one batch. Returns why the replica's earlier entries were dropped first (``"gap"``: a
        batch was missed; ``"restart"``: the sequence went back), else ``None``."""
        state = self.replicas.setdefault(replica, _Replica())
        reset: str | None = None
        if state.seq is not None and seq != state.seq + 1:
            reset = "restart" if seq <= state.seq else "gap"
            self.forget(replica)
            state = self.replicas.setdefault(replica, _Replica())
        state.seq = seq
        for event in events:
            if isinstance(event, Stored):
                self._store(replica, state, event, now)
            elif isinstance(event, Removed):
                for h in event.hashes:
                    self._drop(replica, state, h)
            else:
                self.forget(replica, keep_seq=True)
                state = self.replicas[replica]
        return reset

    def _store(self, replica: str, state: _Replica, event: Stored, now: float) -> None:
        if event.foreign:
            return
        if event.parent is None:
            if event.salt is None:
                return
            salt, key = event.salt, salt_key(event.salt)
        else:
            parent = state.blocks.get(event.parent)
            if parent is None:  # its chain is not indexed (no salt, foreign, or from before a reset)
                return
            salt, key = parent.salt, parent.key
        size = event.block_size
        for i, h in enumerate(event.hashes):
            key = next_key(key, event.tokens[i * size : (i + 1) * size])
            old = state.blocks.get(h)
            if old is not None:
                old.seen = now
                continue
            state.blocks[h] = _Entry(key, salt, now)
            state.by_key[key] = h
            self.holders.setdefault(key, set()).add(replica)
            self.per_salt[salt] += 1

    def _drop(self, replica: str, state: _Replica, h: EngineHash) -> None:
        entry = state.blocks.pop(h, None)
        if entry is None:
            return
        state.by_key.pop(entry.key, None)
        holders = self.holders.get(entry.key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[entry.key]
        self.per_salt[entry.salt] -= 1
        if self.per_salt[entry.salt] <= 0:
            del self.per_salt[entry.salt]

    def forget(self, replica: str, keep_seq: bool = False) -> None:
        """Drop everything known about ``replica`` (it left, restarted, cleared, or events were lost)."""
        state = self.replicas.pop(replica, None)
        if state is None:
            return
        for h in list(state.blocks):
            self._drop(replica, state, h)
        if keep_seq:
            self.replicas[replica] = _Replica(seq=state.seq)

    def retain(self, replicas: Iterable[str]) -> list[str]:
        """Forget the replicas not in ``replicas`` (they left the pool); returns those forgotten."""
        keep = set(replicas)
        gone = [r for r in self.replicas if r not in keep]
        for replica in gone:
            self.forget(replica)
        return gone

    def expire(self, now: float) -> int:
        """Drop entries not stored again for ``ttl_s``; returns how many."""
        dropped = 0
        for replica, state in list(self.replicas.items()):
            for h in [h for h, e in state.blocks.items() if now - e.seen > self.ttl_s]:
                self._drop(replica, state, h)
                dropped += 1
        return dropped

    def correct(self, replica: str, keys: Sequence[int], cached_blocks: int) -> int:
        """The engine reported ``cached_blocks`` of a request whose ``keys`` the index matched further on
        ``replica``: the blocks beyond are not there. Returns how many entries went."""
        state = self.replicas.get(replica)
        if state is None:
            return 0
        dropped = 0
        for key in keys[max(0, cached_blocks) :]:
            h = state.by_key.get(key)
            if h is None:
                break
            self._drop(replica, state, h)
            dropped += 1
        return dropped

    # -- asking -------------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate holding at least the first block: how many leading blocks it holds."""
        alive = set(candidates)
        depth: dict[str, int] = {}
        for i, key in enumerate(keys):
            alive &= self.holders.get(key, set())
            if not alive:
                break
            for replica in alive:
                depth[replica] = i + 1
        return depth
