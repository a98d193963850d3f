"""How a cache salt appears in a metric (engine/salt_labels.py): as a short hash, never itself. The real
engine's and shared tier's pages: tests/security/test_salts_unpublished.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from kvfleet_runtime.config import derive_cache_salt
from kvfleet_runtime.engine.governor_metrics import GovernorMetrics
from kvfleet_runtime.engine.metrics_server import merge_families
from kvfleet_runtime.engine.salt_labels import LMCACHE_SALT_LABEL, SALT_LABEL, hash_salt_labels, salt_hash

SALT = derive_cache_salt(b"k" * 32, "tenant-a")
OTHER = derive_cache_salt(b"k" * 32, "tenant-b")


def test_a_salt_hash_is_short_stable_distinct_and_not_the_salt() -> None:
    assert len(salt_hash(SALT)) == 12 and int(salt_hash(SALT), 16) >= 0
    assert salt_hash(SALT) == salt_hash(SALT)  # every replica, every restart: one series
    assert salt_hash(SALT) != salt_hash(OTHER)
    assert salt_hash(SALT) not in SALT and SALT[:12] != salt_hash(SALT)
    assert salt_hash("") == ""  # an unsalted request or chunk


def test_lmcaches_cache_salt_label_is_hashed_on_re_export() -> None:
    """LMCache's families (``cache_salt``) as the engine pod's metrics port re-exports them."""
    lookups = CounterMetricFamily("lmcache_mp_lookup_requested_tokens", "x", labels=[LMCACHE_SALT_LABEL, "k"])
    lookups.add_metric([SALT, "v"], 5.0)
    lookups.add_metric([OTHER, "w"], 2.0)
    other = GaugeMetricFamily("vllm_thing", "y", labels=["model"])
    other.add_metric(["m"], 1.0)
    merged = merge_families([], [("lmcache", _exposition(lookups, other))])
    samples = {(f.name, tuple(sorted(s.labels.items())), s.value) for f in merged for s in f.samples}
    name = "lmcache_mp_lookup_requested_tokens"
    assert (name, (("k", "v"), (SALT_LABEL, salt_hash(SALT))), 5.0) in samples
    assert (name, (("k", "w"), (SALT_LABEL, salt_hash(OTHER))), 2.0) in samples
    assert ("vllm_thing", (("model", "m"),), 1.0) in samples
    assert not any(SALT in str(s) or OTHER in str(s) for s in samples)
    assert hash_salt_labels(other) is other  # nothing to rewrite: the family as it was


def _exposition(*families: object) -> str:
    class Fixed:
        def collect(self) -> object:
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_governor_series_use_the_hash_only_where_asked() -> None:
    """The shared tier's own series are ``salt_hash``-labelled; LMCache's governed L1 keeps ``cache_salt``
    on its loopback endpoint (the quota sync reads the salts there)."""
    public = GovernorMetrics("kvfleet_test_public", "a test", "Things", hashed=True)
    local = GovernorMetrics("kvfleet_test_local", "a test", "Things")
    assert (public.salt_label, public.label_of(SALT)) == (SALT_LABEL, salt_hash(SALT))
    assert (local.salt_label, local.label_of(SALT)) == (LMCACHE_SALT_LABEL, SALT)
