"""The KV simulator: replays a workload through the policy core over HBM → CPU → NVMe tiers.

Pure (no I/O): :func:`simulate` takes requests, a :class:`FleetSpec`, a :class:`PolicySpec` and the
tenants' :class:`SimulatedTenant`, and returns a :class:`SimulationResult`. ``kvfleet simulate`` is its shell.

Model
-----
* The KV of a token sequence is cut into *units* of ``unit_tokens`` tokens (vLLM hashes 16-token blocks,
  LMCache 256-token chunks; one unit size for all tiers keeps the replay fast, see docs/benchmarks.md).
  A unit's key chains a hash over the tenant's cache salt and every segment piece before it, so prefix
  reuse is exactly vLLM's: a prompt hits the longest run of leading units found in its replica's HBM, or
  failing that in the CPU then NVMe tier; the rest is computed. Only full units are cached; the partial
  last unit of a sequence is always computed.
* A request goes to one replica by its :class:`RoutingSpec`: ``session`` (its session's place on a
  consistent-hash ring, no load bound: an ideal no gateway has for a prompt; the default), ``affinity``
  (the gateway's bounded-load consistent hash of the salted prompt prefix: ``select_replica`` of
  ``kv/placement.py``) or ``precise`` (affinity's replica unless another under the same load bound
  holds a longer run of the prompt's leading units in HBM, what vLLM's KV events report:
  ``select_precise``). The load is the requests in flight per replica. :class:`FleetEvent` adds a
  replica or restarts one (its HBM and own tiers lost).
  At arrival its hit units are pinned in HBM (restored from CPU/NVMe: restores are copies, NVMe restores
  are staged through CPU), its computed units are added to HBM, pinned. At completion (arrival + TTFT +
  output tokens / decode rate, or the trace's ``duration``) the output's full units are added and every
  unit is unpinned tail first, as vLLM's ``free_blocks`` does.
* HBM victims demote to the CPU tier, CPU victims to NVMe, NVMe victims are dropped (write-back: recent
  KV in HBM, then CPU, then NVMe). Each tier of each replica is one
  :class:`~kvfleet_runtime.kv.policy.TierPolicy`; with ``shared_offload`` one CPU and one NVMe tier
  (the replicas' capacities pooled) serve all replicas, like LMCache's distributed mode.
* Ungoverned policies (``lru``, ``lmcache``, ``distributed``) run the same core with every tenant's
  quota set to the tier size, no burst cap and no TTL: pure global LRU. ``kvfleet`` gives each tenant its
  quota share, the burst cap and the TTLs of :class:`SimulatedTenant`.

Metrics per tenant (requests arriving after ``warmup_seconds``): prompt tokens; hit tokens by tier;
*recomputed* tokens (tokens of units that had been computed before somewhere in the fleet but were found
in no tier: the waste caching should avoid) and *new* tokens (first computation, including partial last
units); prefix hit rate = hits / prompt tokens; recompute rate = recomputed / prompt tokens. TTFT is an
estimate without queueing: computed tokens / prefill throughput + CPU restores at PCIe bandwidth (per
GPU shard) + NVMe restores at NVMe bandwidth (the replica's bytes).
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet_runtime.config import DEFAULT_BURST_CAP, SLA_RANK, KVTier, SlaTier, TierTTLs
from kvfleet_runtime.kv.fairness import FairQueue, Ticket, TokenCost
from kvfleet_runtime.kv.limits import TenantLimits, build_limits, burst_units
from kvfleet_runtime.kv.placement import HashRing, build_hash_ring, select_precise, select_replica
from kvfleet_runtime.kv.policy import EvictionReason, TierPolicy, Victim
from kvfleet_runtime.kv.workloads import Request

__all__ = [
    "POLICIES",
    "ROUTINGS",
    "FairQueuingResult",
    "FairRequest",
    "FairTenant",
    "FairTenantReport",
    "FleetEvent",
    "FleetSpec",
    "PolicySpec",
    "RoutingSpec",
    "SimulatedTenant",
    "SimulationResult",
    "TenantReport",
    "build_fair_workload",
    "compute_unit_keys",
    "jain_index",
    "simulate",
    "simulate_fair_queuing",
    "weighted_max_min_shares",
]

_TIERS: tuple[KVTier, ...] = (KVTier.HBM, KVTier.CPU, KVTier.NVME)


@dataclass(frozen=True, slots=True)
class SimulatedTenant:
    """A tenant as the simulator governs it."""

    name: str
    sla: SlaTier = SlaTier.STANDARD
    #: Quota on every tier as a fraction of that tier (``kvfleet`` policy only).
    share: float = 0.0
    ttl: TierTTLs = field(default_factory=TierTTLs)
    burst_cap: float = DEFAULT_BURST_CAP
    #: Cache salt group: tenants with the same salt share prefixes (isolation ``shared``).
    salt: str | None = None
    #: Quota on the CPU / NVMe tier as a fraction of that tier when it differs from ``share``.
    cpu_share: float | None = None
    nvme_share: float | None = None

    def share_of(self, tier: KVTier) -> float:
        if tier is KVTier.CPU and self.cpu_share is not None:
            return self.cpu_share
        if tier is KVTier.NVME and self.nvme_share is not None:
            return self.nvme_share
        return self.share


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Capacities and speeds of a pool of replicas. Capacities in units of ``unit_tokens`` tokens."""

    replicas: int
    unit_tokens: int
    hbm_units_per_replica: int
    cpu_units_per_replica: int = 0
    nvme_units_per_replica: int = 0
    #: KV bytes per token held by one GPU (a CPU restore moves this over each GPU's own PCIe link).
    kv_bytes_per_token_per_gpu: int = 0
    #: KV bytes per token a replica stores in LMCache (an NVMe restore reads this from the drives).
    offload_bytes_per_token: int = 0
    pcie_gbps: float = 40.0
    nvme_gbps: float = 12.0
    prefill_tokens_per_second: float = 20_000.0
    decode_tokens_per_second: float = 40.0


ROUTINGS = ("session", "affinity", "precise")
FLEET_EVENTS = ("add", "restart")


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """How a request picks its replica (the module docstring); the gateway's settings where it has them."""

    mode: str = "session"
    #: Leading prompt tokens in the affinity key: the gateway hashes the salt and the prompt's first
    #: ``--affinity-prefix-chars`` (512) characters, about 128 tokens.
    affinity_tokens: int = 128
    load_factor: float = 1.25
    #: ``precise`` also learns what each replica's own offload tiers hold (LMCache's store events), not
    #: only its GPU blocks (vLLM's): the index kvfleet's gateway does not build yet (docs/benchmarks.md).
    offload_events: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ROUTINGS:
            raise ValueError(f"routing {self.mode!r}: use one of {', '.join(ROUTINGS)}")
        if self.affinity_tokens < 1 or self.load_factor <= 1.0:
            raise ValueError("routing: affinity_tokens must be >= 1 and load_factor > 1")


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """A change of the fleet at ``time``: ``add`` (replica ``replica`` serves nothing before it, as a
    scale-out) or ``restart`` (the replica's HBM and its own CPU/NVMe tiers are lost, a shared tier stays;
    its requests in flight finish without caching anything, as an engine that died)."""

    time: float
    kind: str
    replica: int


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A cache configuration to compare."""

    name: str
    description: str
    governed: bool = False
    cpu: bool = False
    nvme: bool = False
    shared_offload: bool = False


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("lru", "vLLM prefix caching only: HBM, global LRU"),
        PolicySpec("lmcache", "vLLM + LMCache CPU+NVMe per replica, LRU", cpu=True, nvme=True),
        PolicySpec(
            "distributed",
            "LMCache CPU+NVMe shared by all replicas, LRU",
            cpu=True,
            nvme=True,
            shared_offload=True,
        ),
        PolicySpec(
            "kvfleet-local",
            "kvfleet policy core on HBM + per-replica CPU+NVMe",
            governed=True,
            cpu=True,
            nvme=True,
        ),
        PolicySpec(
            "kvfleet",
            "kvfleet policy core on HBM + shared CPU+NVMe",
            governed=True,
            cpu=True,
            nvme=True,
            shared_offload=True,
        ),
    )
}


@dataclass(slots=True)
class TenantReport:
    """One tenant's figures over the measured requests."""

    tenant: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in _TIERS})
    recomputed_tokens: int = 0
    new_tokens: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    #: tier -> reason -> evictions of this tenant's units (after warm-up)
    evictions: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recompute_rate(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": dict(self.hit_tokens),
            "recomputed_tokens": self.recomputed_tokens,
            "new_tokens": self.new_tokens,
            "prefix_hit_rate": round(self.hit_rate, 6),
            "recompute_rate": round(self.recompute_rate, 6),
            "ttft_p50_ms": round(self.ttft_p50_ms, 3),
            "ttft_p99_ms": round(self.ttft_p99_ms, 3),
            "evictions": self.evictions,
        }


@dataclass(slots=True)
class SimulationResult:
    """Everything :func:`simulate` measured."""

    policy: str
    tenants: dict[str, TenantReport]
    total: TenantReport
    #: sample times (s)
    times: list[float]
    #: tier -> tenant -> occupancy (units, summed over replicas) at each sample time
    occupancy: dict[str, dict[str, list[int]]]
    #: tier -> capacity (units, summed over replicas)
    capacity: dict[str, int]
    #: tenant -> prefix hit rate of the requests arriving in each sample interval (None: no requests)
    hit_rate_timeline: dict[str, list[float | None]]
    warmup_seconds: float
    #: routing mode -> how each measured request was placed (``precise``, ``affinity`` or ``session``)
    route_decisions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "warmup_seconds": self.warmup_seconds,
            "route_decisions": dict(self.route_decisions),
            "total": self.total.as_dict(),
            "tenants": {name: r.as_dict() for name, r in self.tenants.items()},
            "capacity_units": self.capacity,
            "timeline": {
                "times": self.times,
                "occupancy_units": self.occupancy,
                "hit_rate": self.hit_rate_timeline,
            },
        }


def compute_unit_keys(
    salt: int, segments: Iterable[tuple[int, int]], unit_tokens: int
) -> tuple[list[int], int]:
    """Chained keys of the full units of a token sequence, and the tokens left in its partial last unit."""
    keys: list[int] = []
    prev = salt
    pieces: list[tuple[int, int, int]] = []
    fill = 0
    for seg, length in segments:
        offset = 0
        while offset < length:
            take = min(unit_tokens - fill, length - offset)
            pieces.append((seg, offset, take))
            fill += take
            offset += take
            if fill == unit_tokens:
                prev = hash((prev, tuple(pieces)))
                keys.append(prev)
                pieces = []
                fill = 0
    return keys, fill


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


@dataclass(slots=True)
class _InFlight:
    replica: int
    generation: int
    tenant: str
    prompt_units: int
    keys: list[int]
    held: list[int]


class _Fleet:
    """The tiers of every replica and the replay loop."""

    def __init__(self, fleet: FleetSpec, policy: PolicySpec, tenants: Sequence[SimulatedTenant]) -> None:
        self.spec = fleet
        self.policy = policy
        self.tenants = tenants
        self.hbm = [
            self._tier(KVTier.HBM, fleet.hbm_units_per_replica, tenants) for _ in range(fleet.replicas)
        ]
        self.cpu: list[TierPolicy | None] = self._offload(
            KVTier.CPU, fleet.cpu_units_per_replica, policy.cpu, tenants
        )
        self.nvme: list[TierPolicy | None] = self._offload(
            KVTier.NVME, fleet.nvme_units_per_replica, policy.nvme, tenants
        )
        self.seen: set[int] = set()

    def _offload(
        self, tier: KVTier, units: int, enabled: bool, tenants: Sequence[SimulatedTenant]
    ) -> list[TierPolicy | None]:
        if not enabled or units <= 0:
            return [None] * self.spec.replicas
        if self.policy.shared_offload:
            shared = self._tier(tier, units * self.spec.replicas, tenants)
            return [shared] * self.spec.replicas
        return [self._tier(tier, units, tenants) for _ in range(self.spec.replicas)]

    def _tier(self, tier: KVTier, capacity: int, tenants: Sequence[SimulatedTenant]) -> TierPolicy:
        if not self.policy.governed:
            # Plain LRU through the same core: nobody is ever over quota, over burst or expired.
            everyone = TenantLimits(quota=capacity, burst=sys.maxsize, ttl_seconds=math.inf)
            return TierPolicy(tier, capacity, default_limits=everyone)
        # Quotas are shares of the tier here (no HBM burst of its own): the burst is the pool's cap.
        limits = {
            t.name: build_limits(
                int(t.share_of(tier) * capacity),
                burst_units(capacity, t.burst_cap),
                t.ttl.for_tier(tier),
                t.sla,
            )
            for t in tenants
        }
        return TierPolicy(tier, capacity, limits)

    def restart(self, replica: int) -> None:
        """The replica's HBM and its own offload tiers start empty (a shared tier is not the replica's)."""
        self.hbm[replica] = self._tier(KVTier.HBM, self.spec.hbm_units_per_replica, self.tenants)
        if self.policy.shared_offload:
            return
        for tiers, tier, units in (
            (self.cpu, KVTier.CPU, self.spec.cpu_units_per_replica),
            (self.nvme, KVTier.NVME, self.spec.nvme_units_per_replica),
        ):
            if tiers[replica] is not None:
                tiers[replica] = self._tier(tier, units, self.tenants)

    def depth(self, replica: int, keys: Sequence[int], offload: bool = False) -> int:
        """Leading ``keys`` in the replica's HBM (what precise routing learns from vLLM's KV events), or
        with ``offload`` in any of its tiers, a shared tier excepted (it serves every replica alike)."""
        tiers = [self.hbm[replica]]
        if offload and not self.policy.shared_offload:
            tiers += [t for t in (self.cpu[replica], self.nvme[replica]) if t is not None]
        n = 0
        for key in keys:
            if not any(key in t for t in tiers):
                break
            n += 1
        return n

    def levels(self, replica: int) -> list[TierPolicy | None]:
        return [self.hbm[replica], self.cpu[replica], self.nvme[replica]]

    def all_tiers(self) -> dict[KVTier, list[TierPolicy]]:
        """Distinct tier objects per tier (a shared tier once)."""
        out: dict[KVTier, list[TierPolicy]] = {}
        for tier, objs in ((KVTier.HBM, self.hbm), (KVTier.CPU, self.cpu), (KVTier.NVME, self.nvme)):
            unique: dict[int, TierPolicy] = {}
            for o in objs:
                if o is not None:
                    unique[id(o)] = o
            out[tier] = list(unique.values())
        return out

    def store(self, replica: int, level: int, key: int, tenant: str, now: float, pinned: bool) -> bool:
        """Admit ``key`` at ``level`` of ``replica``'s tiers, demoting victims one level down."""
        tier = self.levels(replica)[level]
        if tier is None:
            return False
        result = tier.admit(key, tenant, now, 1, pinned)
        if result.victims and level + 1 < len(_TIERS):
            self._demote(replica, level + 1, result.victims, now)
        return result.admitted

    def _demote(self, replica: int, level: int, victims: list[Victim], now: float) -> None:
        lower = self.levels(replica)[level]
        if lower is None:
            return
        for victim in victims:
            if isinstance(victim.key, int) and victim.key not in lower:
                self.store(replica, level, victim.key, victim.tenant, now, pinned=False)


_KEY_MASK = (1 << 64) - 1


class _Router:
    """Replica choice and the requests in flight per replica, through the gateway's own pure functions."""

    def __init__(self, spec: RoutingSpec, replicas: int, unit_tokens: int, absent: set[int]) -> None:
        self.spec = spec
        self.active = [r for r in range(replicas) if r not in absent]
        self.loads = [0] * replicas
        self.key_units = max(1, math.ceil(spec.affinity_tokens / unit_tokens))
        self.ring = self._ring()

    def _ring(self) -> HashRing:
        return build_hash_ring(str(r) for r in self.active)

    def add(self, replica: int) -> None:
        if replica not in self.active:
            self.active = sorted([*self.active, replica])
            self.ring = self._ring()

    def choose(self, state: _Fleet, request: Request, salt: int, keys: Sequence[int]) -> tuple[int, str]:
        """The replica for a request and how it was chosen."""
        if self.spec.mode == "session":
            return int(self.ring.walk(request.session.encode())[0]), "session"
        healthy = {str(r) for r in self.active}
        loads = {str(r): self.loads[r] for r in self.active}
        # The salted prefix: the chain key of the unit holding the prompt's first affinity tokens.
        if keys:
            anchor = keys[min(self.key_units, len(keys)) - 1]
        else:
            anchor = hash((salt, request.segments[0][0] if request.segments else 0))
        key = (anchor & _KEY_MASK).to_bytes(8, "big")
        factor = self.spec.load_factor
        if self.spec.mode == "precise":
            depths = {str(r): state.depth(r, keys, self.spec.offload_events) for r in self.active}
            picked, indexed = select_precise(
                self.ring, key, depths, healthy=healthy, loads=loads, load_factor=factor
            )
            assert picked is not None  # some replica is always active
            return int(picked), "precise" if indexed else "affinity"
        picked = select_replica(self.ring, key, healthy=healthy, loads=loads, load_factor=factor)
        assert picked is not None
        return int(picked), "affinity"


def _check_events(events: Sequence[FleetEvent], replicas: int) -> None:
    for event in events:
        if event.kind not in FLEET_EVENTS or not 0 <= event.replica < replicas:
            raise ValueError(
                f"fleet event {event}: kind must be one of {', '.join(FLEET_EVENTS)} and the replica "
                f"in 0..{replicas - 1}"
            )
    added = [e.replica for e in events if e.kind == "add"]
    if len(set(added)) != len(added) or len(added) >= replicas:
        raise ValueError("fleet events: add each replica at most once, and keep one replica from the start")


def simulate(
    requests: Sequence[Request],
    fleet: FleetSpec,
    policy: PolicySpec,
    tenants: Sequence[SimulatedTenant],
    warmup_seconds: float = 0.0,
    sample_seconds: float = 60.0,
    routing: RoutingSpec | None = None,
    events: Sequence[FleetEvent] = (),
) -> SimulationResult:
    """Replay ``requests`` (sorted by time) and measure; see the module docstring for the model."""
    _check_events(events, fleet.replicas)
    state = _Fleet(fleet, policy, tenants)
    late = {e.replica for e in events if e.kind == "add"}
    router = _Router(routing or RoutingSpec(), fleet.replicas, fleet.unit_tokens, late)
    pending = sorted(events, key=lambda e: e.time)
    generation = [0] * fleet.replicas
    decisions: dict[str, int] = {}
    unit = fleet.unit_tokens
    specs = {t.name: t for t in tenants}
    salts: dict[str, int] = {}
    names = list(dict.fromkeys([*(t.name for t in tenants), *(r.tenant for r in requests)]))
    reports = {name: TenantReport(name) for name in names}
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    end = max((r.time for r in requests), default=0.0)
    buckets = max(1, math.ceil((end + 1e-9) / sample_seconds))
    bucket_prompt = {name: [0] * buckets for name in names}
    bucket_hit = {name: [0] * buckets for name in names}
    times: list[float] = []
    occupancy: dict[str, dict[str, list[int]]] = {t.value: {n: [] for n in names} for t in _TIERS}
    evictions_at_warmup: dict[KVTier, dict[tuple[str, EvictionReason], int]] | None = None
    gpu_bytes = fleet.kv_bytes_per_token_per_gpu
    off_bytes = fleet.offload_bytes_per_token

    def salt_of(tenant: str) -> int:
        if tenant not in salts:
            spec = specs.get(tenant)
            group = spec.salt if spec is not None and spec.salt is not None else f"tenant:{tenant}"
            salts[tenant] = zlib.crc32(group.encode()) | (1 << 40)
        return salts[tenant]

    def snapshot_evictions() -> dict[KVTier, dict[tuple[str, EvictionReason], int]]:
        out: dict[KVTier, dict[tuple[str, EvictionReason], int]] = {}
        for tier, objs in state.all_tiers().items():
            merged: dict[tuple[str, EvictionReason], int] = {}
            for o in objs:
                for k, v in o.evictions.items():
                    merged[k] = merged.get(k, 0) + v
            out[tier] = merged
        return out

    def sample(t: float) -> None:
        times.append(t)
        tiers = state.all_tiers()
        for tier in _TIERS:
            for name in names:
                occupancy[tier.value][name].append(sum(o.usage(name).size for o in tiers[tier]))

    completions: list[tuple[float, int, _InFlight]] = []
    seq = 0
    next_sample = 0.0

    def complete(now: float, job: _InFlight) -> None:
        router.loads[job.replica] -= 1
        if job.generation != generation[job.replica]:
            return  # its replica restarted: the KV it held is gone, nothing is cached
        hbm = state.hbm[job.replica]
        for key in job.keys[job.prompt_units :]:
            state.seen.add(key)
            if key in hbm:
                hbm.touch(key, now)
                hbm.pin(key)
                job.held.append(key)
            elif state.store(job.replica, 0, key, job.tenant, now, pinned=True):
                job.held.append(key)
        for key in reversed(job.held):
            hbm.unpin(key, now)

    for request in requests:
        now = request.time
        while completions and completions[0][0] <= now:
            t_done, _, job = heapq.heappop(completions)
            complete(t_done, job)
        while next_sample <= now:
            sample(next_sample)
            next_sample += sample_seconds
        if evictions_at_warmup is None and now >= warmup_seconds:
            evictions_at_warmup = snapshot_evictions()
        while pending and pending[0].time <= now:
            event = pending.pop(0)
            if event.kind == "add":
                router.add(event.replica)
            else:
                generation[event.replica] += 1
                state.restart(event.replica)

        tenant = request.tenant
        salt = salt_of(tenant)
        # One pass over prompt + output: the prompt's units are a prefix of the sequence's units.
        segments = request.segments
        if request.output_tokens:
            segments = (*segments, (request.output_segment, request.output_tokens))
        all_keys, _ = compute_unit_keys(salt, segments, unit)
        prompt = request.prompt_tokens
        prompt_units = prompt // unit
        tail = prompt - prompt_units * unit
        keys = all_keys[:prompt_units]
        replica, how = router.choose(state, request, salt, keys)
        router.loads[replica] += 1
        hbm, cpu, nvme = state.levels(replica)
        assert hbm is not None
        held: list[int] = []
        hits = [0, 0, 0]
        matched = 0
        for key in keys:
            if key in hbm:
                hbm.touch(key, now)
                hbm.pin(key)
                held.append(key)
                hits[0] += 1
            elif cpu is not None and key in cpu:
                cpu.touch(key, now)
                if state.store(replica, 0, key, tenant, now, pinned=True):
                    held.append(key)
                hits[1] += 1
            elif nvme is not None and key in nvme:
                nvme.touch(key, now)
                if cpu is not None and key not in cpu:
                    state.store(replica, 1, key, tenant, now, pinned=False)
                if state.store(replica, 0, key, tenant, now, pinned=True):
                    held.append(key)
                hits[2] += 1
            else:
                break
            matched += 1
        recomputed = 0
        for key in keys[matched:]:
            if key in state.seen:
                recomputed += 1
            else:
                state.seen.add(key)
            if key in hbm:  # cached further down the prefix, but prefix matching stopped earlier
                hbm.touch(key, now)
                hbm.pin(key)
                held.append(key)
            elif state.store(replica, 0, key, tenant, now, pinned=True):
                held.append(key)
        computed_tokens = (len(keys) - matched) * unit + tail
        ttft = (
            computed_tokens / fleet.prefill_tokens_per_second
            + hits[1] * unit * gpu_bytes / (fleet.pcie_gbps * 1e9)
            + hits[2] * unit * off_bytes / (fleet.nvme_gbps * 1e9)
        )
        if request.duration is not None:
            done = now + request.duration
        else:
            done = now + ttft + request.output_tokens / fleet.decode_tokens_per_second
        job = _InFlight(replica, generation[replica], tenant, prompt_units, all_keys, held)
        seq += 1
        heapq.heappush(completions, (done, seq, job))

        bucket = min(buckets - 1, int(now // sample_seconds))
        bucket_prompt[tenant][bucket] += prompt
        bucket_hit[tenant][bucket] += matched * unit
        if now < warmup_seconds:
            continue
        decisions[how] = decisions.get(how, 0) + 1
        report = reports[tenant]
        report.requests += 1
        report.prompt_tokens += prompt
        for tier, count in zip(_TIERS, hits, strict=True):
            report.hit_tokens[tier.value] += count * unit
        report.recomputed_tokens += recomputed * unit
        report.new_tokens += computed_tokens - recomputed * unit
        ttfts[tenant].append(ttft)

    while completions:
        t_done, _, job = heapq.heappop(completions)
        complete(t_done, job)
    sample(max(next_sample, end))

    baseline = evictions_at_warmup or {}
    final = snapshot_evictions()
    for tier, counts in final.items():
        for (name, reason), value in counts.items():
            delta = value - baseline.get(tier, {}).get((name, reason), 0)
            if delta and name in reports:
                reports[name].evictions.setdefault(tier.value, {}).setdefault(reason.value, 0)
                reports[name].evictions[tier.value][reason.value] += delta

    total = TenantReport("total")
    all_ttfts: list[float] = []
    for name, report in reports.items():
        values = sorted(ttfts[name])
        all_ttfts.extend(values)
        report.ttft_p50_ms = _percentile(values, 0.5) * 1000
        report.ttft_p99_ms = _percentile(values, 0.99) * 1000
        total.requests += report.requests
        total.prompt_tokens += report.prompt_tokens
        for k, v in report.hit_tokens.items():
            total.hit_tokens[k] += v
        total.recomputed_tokens += report.recomputed_tokens
        total.new_tokens += report.new_tokens
        for tier_name, reasons in report.evictions.items():
            for reason_name, v in reasons.items():
                total.evictions.setdefault(tier_name, {}).setdefault(reason_name, 0)
                total.evictions[tier_name][reason_name] += v
    all_ttfts.sort()
    total.ttft_p50_ms = _percentile(all_ttfts, 0.5) * 1000
    total.ttft_p99_ms = _percentile(all_ttfts, 0.99) * 1000

    capacity = {tier.value: sum(o.capacity for o in objs) for tier, objs in state.all_tiers().items()}
    timeline = {
        name: [
            (bucket_hit[name][b] / bucket_prompt[name][b]) if bucket_prompt[name][b] else None
            for b in range(buckets)
        ]
        for name in names
    }
    return SimulationResult(
        policy=policy.name,
        tenants=reports,
        total=total,
        times=times,
        occupancy=occupancy,
        capacity=capacity,
        hit_rate_timeline=timeline,
        warmup_seconds=warmup_seconds,
        route_decisions=decisions,
    )


# -- fair queuing at the gateway (``kvfleet simulate --fair-queuing``) ------------------------------------
@dataclass(frozen=True, slots=True)
class FairTenant:
    """A tenant as the gateway's fair queue sees it."""

    name: str
    sla: SlaTier = SlaTier.STANDARD
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class FairRequest:
    """One request of a fair-queuing workload."""

    time: float
    tenant: str
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class FairTenantReport:
    """What one tenant got in the measured window (``warmup_seconds`` to the end of the arrivals)."""

    tenant: str
    weight: float
    arrived: int = 0
    served: int = 0
    #: Tokens computed in the window (prefill at dispatch, decode as it runs), per second.
    tokens_per_s: float = 0.0
    #: The same, weighted by the cost (input + output_weight x output), per second: what VTC shares.
    weighted_tokens_per_s: float = 0.0
    #: What the tenant asked for in the window, weighted, per second.
    demand_weighted_tokens_per_s: float = 0.0
    #: Its weighted max-min fair share of what the fleet served (capped by its demand).
    fair_share_weighted_tokens_per_s: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    #: Requests refused after waiting ``max_wait_s`` at the gateway (its 429).
    refused: int = 0

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class FairQueuingResult:
    mode: str
    tenants: dict[str, FairTenantReport]
    #: Jain's index of ``weighted service / weight`` over the tenants (1: equal weighted service).
    jain_weighted_service: float
    #: Jain's index of ``weighted service / weighted max-min fair share`` (1: every tenant got its fair
    #: share, or all it asked for when that is less; Jain's original, normalised form).
    jain_fair_share: float
    measured_seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "jain_weighted_service": self.jain_weighted_service,
            "jain_fair_share": self.jain_fair_share,
            "measured_seconds": self.measured_seconds,
            "tenants": {name: r.as_dict() for name, r in self.tenants.items()},
        }


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index ``(Σx)² / (n Σx²)``: 1 when all equal, ``1/n`` when one has everything."""
    if not values:
        return 1.0
    square_sum = sum(x * x for x in values)
    return 1.0 if square_sum == 0 else sum(values) ** 2 / (len(values) * square_sum)


def weighted_max_min_shares(
    demands: dict[str, float], weights: dict[str, float], capacity: float
) -> dict[str, float]:
    """Water-filling: each tenant gets ``capacity x weight / Σweights`` of what is left, or its demand when
    that is less, repeated until nothing is left or every demand is met."""
    shares = dict.fromkeys(demands, 0.0)
    active = {t for t, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-12:
        total_weight = sum(weights[t] for t in active)
        offer = {t: left * weights[t] / total_weight for t in active}
        met = {t for t in active if demands[t] - shares[t] <= offer[t]}
        if not met:
            for t in active:
                shares[t] += offer[t]
            break
        for t in met:
            left -= demands[t] - shares[t]
            shares[t] = demands[t]
        active -= met
    return shares


def build_fair_workload(
    rates: dict[str, float],
    duration: float,
    prompt_tokens: tuple[int, int] = (128, 384),
    output_tokens: tuple[int, int] = (128, 384),
    seed: int = 0,
) -> list[FairRequest]:
    """Poisson arrivals at ``rates`` (requests/s per tenant), lengths uniform in the given ranges (the
    synthetic workloads of the VTC paper: fixed-rate clients, some above their share)."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    out: list[FairRequest] = []
    for tenant, rate in sorted(rates.items()):
        t = rng.expovariate(rate) if rate > 0 else duration
        while t < duration:
            out.append(FairRequest(t, tenant, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
            t += rng.expovariate(rate)
    out.sort(key=lambda r: (r.time, r.tenant))
    return out


def simulate_fair_queuing(
    requests: Sequence[FairRequest],
    fleet: FleetSpec,
    tenants: Sequence[FairTenant],
    *,
    slots_per_replica: int,
    fair: bool,
    cost: TokenCost | None = None,
    warmup_seconds: float = 0.0,
    max_wait_s: float | None = 10.0,
) -> FairQueuingResult:
    """Replay ``requests`` (sorted by time) through the gateway's fair queue (``kv.fairness.FairQueue``,
    the very core the gateway runs) in front of ``fleet.replicas x slots_per_replica`` engine slots.

    Model: a dispatched request holds one slot for ``prompt / prefill_tokens_per_second`` (its TTFT
    after the wait) plus ``output / decode_tokens_per_second``; slots are independent (continuous
    batching at a fixed per-sequence decode rate, no KV limit). Service is measured from
    ``warmup_seconds`` to the last arrival: prefill tokens when dispatched, output tokens as decoded.
    The queue is charged as the gateway charges it (input at dispatch, output when the answer ends).
    A request held longer than ``max_wait_s`` is refused (the gateway's 429 after ``--queue-timeout``;
    ``None``: held until served). After the last arrival the replay runs on until every request is
    served or refused, so TTFT percentiles cover every request that arrived after the warm-up.
    """
    cost = cost or TokenCost()
    spec = {t.name: t for t in tenants}
    for r in requests:
        if r.tenant not in spec:
            spec[r.tenant] = FairTenant(r.tenant)
    queue: FairQueue[FairRequest] = FairQueue(fleet.replicas * slots_per_replica, cost, fair=fair)
    end = max((r.time for r in requests), default=0.0)
    window = max(1e-9, end - warmup_seconds)
    served_in = dict.fromkeys(spec, 0.0)
    served_out = dict.fromkeys(spec, 0.0)
    demand = dict.fromkeys(spec, 0.0)
    ttfts: dict[str, list[float]] = {name: [] for name in spec}
    reports = {name: FairTenantReport(name, s.weight) for name, s in spec.items()}
    completions: list[tuple[float, int, Ticket[FairRequest]]] = []
    deadlines: list[tuple[float, int, Ticket[FairRequest]]] = []
    seq = 0

    def in_window(a: float, b: float) -> float:
        return max(0.0, min(b, end) - max(a, warmup_seconds))

    def dispatch(now: float) -> None:
        nonlocal seq
        for ticket in queue.drain():
            r = ticket.item
            prefill = r.prompt_tokens / fleet.prefill_tokens_per_second
            decode = r.output_tokens / fleet.decode_tokens_per_second
            if warmup_seconds <= now <= end:
                served_in[r.tenant] += r.prompt_tokens
            if decode > 0:
                served_out[r.tenant] += (
                    r.output_tokens * in_window(now + prefill, now + prefill + decode) / decode
                )
            if r.time >= warmup_seconds:
                ttfts[r.tenant].append(now - r.time + prefill)
            seq += 1
            heapq.heappush(completions, (now + prefill + decode, seq, ticket))

    def complete_until(limit: float) -> None:
        while completions or deadlines:
            done = completions[0][0] if completions else math.inf
            due = deadlines[0][0] if deadlines else math.inf
            if min(done, due) > limit:
                return
            if due < done:
                _, _, ticket = heapq.heappop(deadlines)
                if queue.cancel(ticket) and ticket.item.time >= warmup_seconds:
                    reports[ticket.tenant].refused += 1
                continue
            _, _, ticket = heapq.heappop(completions)
            queue.settle(ticket, ticket.item.prompt_tokens, ticket.item.output_tokens)
            queue.finish(ticket)
            dispatch(done)

    for r in requests:
        complete_until(r.time)
        sla = spec[r.tenant].sla
        ticket = queue.push(r.tenant, SLA_RANK[sla], spec[r.tenant].weight, r.prompt_tokens, r)
        if max_wait_s is not None:
            seq += 1
            heapq.heappush(deadlines, (r.time + max_wait_s, seq, ticket))
        if r.time >= warmup_seconds:
            reports[r.tenant].arrived += 1
            demand[r.tenant] += cost.of(r.prompt_tokens, r.output_tokens)
        dispatch(r.time)
    complete_until(math.inf)
    dispatched = {name: len(values) for name, values in ttfts.items()}
    weighted = {name: cost.of(served_in[name], served_out[name]) / window for name in spec}
    shares = weighted_max_min_shares(
        {name: demand[name] / window for name in spec},
        {name: s.weight for name, s in spec.items()},
        sum(weighted.values()),
    )
    for name, report in reports.items():
        values = sorted(ttfts[name])
        report.served = dispatched[name]
        report.tokens_per_s = (served_in[name] + served_out[name]) / window
        report.weighted_tokens_per_s = weighted[name]
        report.demand_weighted_tokens_per_s = demand[name] / window
        report.fair_share_weighted_tokens_per_s = shares[name]
        report.ttft_p50_ms = _percentile(values, 0.5) * 1000
        report.ttft_p99_ms = _percentile(values, 0.99) * 1000
    active = [name for name in spec if demand[name] > 0]
    return FairQueuingResult(
        mode="vtc" if fair else "fifo",
        tenants=reports,
        jain_weighted_service=jain_index([weighted[n] / spec[n].weight for n in active]),
        jain_fair_share=jain_index([weighted[n] / shares[n] for n in active if shares[n] > 0]),
        measured_seconds=window,
    )
