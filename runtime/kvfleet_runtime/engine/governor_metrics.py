"""The per-salt Prometheus series of one :class:`L1Governor` (LMCache's L1 in ``lmcache_server`` and the
shared KV tier in ``shared_tier``): resident bytes, quota and burst cap per salt (a salt's gauges removed
once it holds nothing), evictions by salt and reason, and tenant table reloads.

A salt is labelled ``cache_salt`` on LMCache's loopback-only endpoint (the quota sync reads the salts
there; the pod's metrics port hashes the label on re-export), and ``salt_hash`` where the series are served
off loopback (``hashed``: the shared tier's own port). See ``salt_labels``."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from kvfleet_runtime.engine.l1_governance import L1Governor
from kvfleet_runtime.engine.salt_labels import LMCACHE_SALT_LABEL, SALT_LABEL, salt_hash
from kvfleet_runtime.kv.policy import EvictionReason


class GovernorMetrics:
    """Series named ``<prefix>_bytes``, ``_quota_bytes``, ``_burst_bytes``, ``_evictions`` and
    ``_tenant_table_reloads`` in ``registry`` (the default one: the process serves it); ``where`` and
    ``objects`` word the help texts."""

    def __init__(
        self,
        prefix: str,
        where: str,
        objects: str,
        *,
        hashed: bool = False,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.registry = registry
        #: The label a salt goes under, and its value for a salt.
        self.salt_label = SALT_LABEL if hashed else LMCACHE_SALT_LABEL
        self.label_of: Callable[[str], str] = salt_hash if hashed else str
        label = self.salt_label
        self.bytes = Gauge(
            f"{prefix}_bytes", f"Bytes of a salt resident in {where}.", [label], registry=registry
        )
        self.quota = Gauge(f"{prefix}_quota_bytes", f"A salt's {where} quota.", [label], registry=registry)
        self.burst = Gauge(
            f"{prefix}_burst_bytes", f"A salt's {where} burst cap.", [label], registry=registry
        )
        self.evictions = Counter(
            f"{prefix}_evictions",
            f"{objects} evicted by kvfleet's policy, by salt and reason.",
            [label, "reason"],
            registry=registry,
        )
        self.reloads = Counter(
            f"{prefix}_tenant_table_reloads", "Tenant table reloads by result.", ["result"], registry=registry
        )
        self._reported: dict[tuple[str, EvictionReason], int] = {}
        self._salts: set[str] = set()

    def publish(self, governor: L1Governor) -> None:
        """Set the gauges to the governor's usage now; add its evictions since the last publish."""
        usage = governor.usage()
        for salt in self._salts - set(usage):
            for gauge in (self.bytes, self.quota, self.burst):
                gauge.remove(self.label_of(salt))
        self._salts = set(usage)
        for salt, u in usage.items():
            label = self.label_of(salt)
            self.bytes.labels(label).set(u.resident_bytes)
            self.quota.labels(label).set(u.limits.quota)
            self.burst.labels(label).set(u.limits.burst)
            for reason, count in u.evictions.items():
                before = self._reported.get((salt, reason), 0)
                if count > before:
                    self.evictions.labels(label, reason.value).inc(count - before)
                self._reported[(salt, reason)] = max(before, count)
