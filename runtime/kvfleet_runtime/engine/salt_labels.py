"""How a cache salt appears in a metric: never as itself.

A tenant's ``cache_salt`` is what confines a request that reaches an engine to that tenant's cache: the
gateway sets it, and anyone who knew it and could reach an engine (a pod the NetworkPolicy lets through, a
future hole) would read and poison that tenant's KV. Metrics are read by many more (Prometheus, its
federation and remote-write targets, Grafana users, whoever may scrape the metrics ports), so no series a
pod serves off loopback labels a salt by its value (issue 23, hole 9). They carry ``salt_hash`` instead:
the first 12 hex digits of SHA-256 over a fixed prefix and the salt. It cannot be turned back into the salt
(a salt is 128 bits of HMAC output), it is the same on every replica and across restarts (a series goes
on), and whoever holds the salt (the operator, a test) computes it to find a salt's series. Per-tenant
figures are labelled by tenant elsewhere (the plugin's series and the quota sync's).

LMCache's own endpoint labels its series by ``cache_salt``; it binds the pod's loopback only, where the
quota sync reads the salts it manages. The plugin's metrics server, the pod's one scraped port, renames that
label on re-export (:func:`hash_salt_labels`), and the shared KV tier labels by ``salt_hash`` itself.
"""

from __future__ import annotations

import hashlib

from prometheus_client.core import Metric

__all__ = ["LMCACHE_SALT_LABEL", "SALT_LABEL", "hash_salt_labels", "salt_hash"]

#: The label every exported per-salt series carries: a salt's :func:`salt_hash`.
SALT_LABEL = "salt_hash"
#: LMCache's label for a salt (its loopback endpoint and kvfleet's governed L1 in the LMCache process).
LMCACHE_SALT_LABEL = "cache_salt"
_PREFIX = b"kvfleet metrics salt label\x00"
_DIGITS = 12


def salt_hash(salt: str) -> str:
    """The label value for ``salt``: 12 hex digits; ``""`` for no salt (an unsalted request or chunk)."""
    if not salt:
        return ""
    return hashlib.sha256(_PREFIX + salt.encode()).hexdigest()[:_DIGITS]


def hash_salt_labels(family: Metric) -> Metric:
    """``family`` with every ``cache_salt`` label replaced by ``salt_hash`` of its value (other labels,
    names and values as they were); the same object when no sample carries one."""
    if not any(LMCACHE_SALT_LABEL in sample.labels for sample in family.samples):
        return family
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = dict(sample.labels)
        if LMCACHE_SALT_LABEL in labels:
            labels[SALT_LABEL] = salt_hash(labels.pop(LMCACHE_SALT_LABEL))
        out.samples.append(sample._replace(labels=labels))
    return out
