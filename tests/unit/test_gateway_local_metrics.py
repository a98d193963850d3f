"""The gateway's request-path series (``metrics.LocalFamily``): exposed exactly as ``prometheus_client``
exposes the same counter, gauge and histogram (bar the ``_created`` samples), and request ids that stay
unique without a system call per request."""

from __future__ import annotations

import random
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.samples import Sample

from kvfleet_runtime.gateway.metrics import LocalCollector, LocalFamily
from kvfleet_runtime.gateway.rewrite import _REQUEST_ID_RE, build_request_id, parse_tenant_from_request_id

BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> list[Sample]:
    return sorted(
        (s for family in registry.collect() for s in family.samples if not s.name.endswith("_created")),
        key=lambda s: (s.name, sorted(s.labels.items())),
    )


def test_local_families_expose_what_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    labels = ("tenant", "sla_tier")
    counter = LocalFamily("counter", "x_requests", "Requests.", labels)
    gauge = LocalFamily("gauge", "x_in_flight", "In flight.", labels)
    histogram = LocalFamily("histogram", "x_seconds", "Latency.", labels, BUCKETS)
    ours.register(LocalCollector([counter, gauge, histogram]))
    ref_counter = Counter("x_requests", "Requests.", labels, registry=theirs)
    ref_gauge = Gauge("x_in_flight", "In flight.", labels, registry=theirs)
    ref_histogram = Histogram("x_seconds", "Latency.", labels, buckets=BUCKETS, registry=theirs)
    rnd = random.Random(7)
    for _ in range(2000):
        who = (rnd.choice(["acme", "beta", "gamma"]), rnd.choice(["premium", "basic"]))
        # Values on the bounds, between them, below the first and past the last.
        value = rnd.choice([*BUCKETS, -1.0, 1e-4, 0.03, 3.0, 99.0, rnd.random() * 12])
        amount = rnd.choice([1, 3, 250])
        counter.labels(*who).inc(amount)
        ref_counter.labels(*who).inc(amount)
        histogram.histogram(*who).observe(value)
        ref_histogram.labels(*who).observe(value)
        step = rnd.choice(["inc", "dec", "set"])
        if step == "set":
            gauge.labels(*who).set(amount)
            ref_gauge.labels(*who).set(amount)
        else:
            getattr(gauge.labels(*who), step)()
            getattr(ref_gauge.labels(*who), step)()
    exposed = _samples(ours)
    assert exposed == _samples(theirs)
    names = {s.name for s in exposed}
    assert names >= {"x_requests_total", "x_seconds_bucket", "x_seconds_count", "x_in_flight"}


def test_a_family_without_samples_is_still_exposed() -> None:
    registry = CollectorRegistry()
    registry.register(LocalCollector([LocalFamily("counter", "x_requests", "Requests.", ("tenant",))]))
    families = list(registry.collect())
    assert [(f.name, f.type, f.samples) for f in families] == [("x_requests", "counter", [])]


def test_request_ids_are_unique_and_carry_their_tenant() -> None:
    ids = [build_request_id("team-a.prod") for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(_REQUEST_ID_RE.search(i) for i in ids)
    assert {parse_tenant_from_request_id(f"chatcmpl-{i}-0a1b2c3d") for i in ids[:100]} == {"team-a.prod"}
    assert re.fullmatch(r"kvf_team-a\.prod_[0-9a-f]{32}", ids[-1])
