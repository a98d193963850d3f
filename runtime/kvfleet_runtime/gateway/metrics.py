"""The gateway's Prometheus metrics: names (shared with dashboards and tests) and their collectors.

Every name is a module constant so dashboards, alert rules and tests import it instead of repeating the
string. Labels are bounded by construction: ``tenant`` and ``model`` only ever take values from the loaded
tenant table (unauthenticated requests use ``UNAUTHENTICATED``, unknown models ``UNKNOWN_MODEL``), and at
most ``MAX_TENANT_LABELS`` tenants get a ``tenant`` value of their own (tenants first seen after that
share ``OTHER_TENANTS``, see ``GatewayMetrics.tenant_label``); ``model_deployment`` is the table's one
ModelDeployment; ``sla_tier``, ``outcome``, ``reason`` and ``kind`` come from fixed enumerations below,
``code`` is a three-digit HTTP status, and ``pool``/``replica`` come from the table's pools. No prompt,
completion, key or client-chosen string ever becomes a label value.

Metering (what ``kvfleet usage`` bills from, see ``gateway.usage``) reads the series labelled
``model_deployment`` and ``tenant``: ``RESPONSES_TOTAL`` (requests by HTTP status), the three token
counters (``usage`` exactly as the engine reported it) and ``THROTTLED_TOTAL``. ``namespace`` is not
exported by the gateway: Prometheus adds it to every series it scrapes through a ServiceMonitor.

The series every request touches (``RequestSeries``: requests by outcome, answers by status, tokens,
latencies, in-flight gauges) are ``LocalFamily`` objects: plain numbers a request updates with one
attribute write, exposed by ``LocalCollector`` at scrape time. A ``prometheus_client`` child takes a lock
and several calls per update (with a dozen updates, 6% of the instructions of a request); these
are written and read on the event loop's thread only (``/metrics`` is served there), so they need no
lock. The exposition is the same but for the ``_created`` samples, which they do not have.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Final, cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Names ---------------------------------------------------------------------------------------------------
REQUESTS_TOTAL: Final = "kvfleet_gateway_requests_total"
PROMPT_TOKENS_TOTAL: Final = "kvfleet_gateway_prompt_tokens_total"
COMPLETION_TOKENS_TOTAL: Final = "kvfleet_gateway_completion_tokens_total"
CACHED_PROMPT_TOKENS_TOTAL: Final = "kvfleet_gateway_cached_prompt_tokens_total"
TTFT_SECONDS: Final = "kvfleet_gateway_time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS: Final = "kvfleet_gateway_inter_token_latency_seconds"  # noqa: S105 - a name
REQUEST_DURATION_SECONDS: Final = "kvfleet_gateway_request_duration_seconds"
QUEUE_TIME_SECONDS: Final = "kvfleet_gateway_queue_time_seconds"
THROTTLED_TOTAL: Final = "kvfleet_gateway_throttled_total"
REJECTED_TOTAL: Final = "kvfleet_gateway_rejected_total"
UPSTREAM_ERRORS_TOTAL: Final = "kvfleet_gateway_upstream_errors_total"
IN_FLIGHT_REQUESTS: Final = "kvfleet_gateway_in_flight_requests"
KV_IN_FLIGHT_TOKENS: Final = "kvfleet_gateway_kv_in_flight_tokens"
CONFIG_RELOADS_TOTAL: Final = "kvfleet_gateway_config_reloads_total"
CONFIG_RELOAD_FAILURES_TOTAL: Final = "kvfleet_gateway_config_reload_failures_total"
REPLICA_HEALTHY: Final = "kvfleet_gateway_replica_healthy"
OPEN_CONNECTIONS: Final = "kvfleet_gateway_open_connections"
ENGINE_QUEUE_DEPTH: Final = "kvfleet_gateway_engine_queue_depth"
FAIR_VIRTUAL_TOKENS: Final = "kvfleet_gateway_fair_virtual_tokens"
SHARED_STORE_UP: Final = "kvfleet_gateway_shared_store_up"
SHARED_STORE_REPLICAS: Final = "kvfleet_gateway_shared_store_replicas"
SHARED_STORE_SYNCS_TOTAL: Final = "kvfleet_gateway_shared_store_syncs_total"
KV_INDEX_BLOCKS: Final = "kvfleet_gateway_kv_index_blocks"
KV_EVENTS_TOTAL: Final = "kvfleet_gateway_kv_events_total"
KV_INDEX_RESETS_TOTAL: Final = "kvfleet_gateway_kv_index_resets_total"
ROUTE_DECISIONS_TOTAL: Final = "kvfleet_gateway_route_decisions_total"
ROUTE_PREDICTED_CACHED_TOKENS_TOTAL: Final = "kvfleet_gateway_route_predicted_cached_tokens_total"
ROUTE_REPORTED_CACHED_TOKENS_TOTAL: Final = "kvfleet_gateway_route_reported_cached_tokens_total"
CONNECTIONS_CLOSED_TOTAL: Final = "kvfleet_gateway_connections_closed_total"
RESPONSES_TOTAL: Final = "kvfleet_gateway_responses_total"

# Label names and values -------------------------------------------------------------------------------------
#: The tenant's SLA tier (``premium``, ``standard``, ``basic``). Never plain ``tier``: the engine's and
#: LMCache's series carry the memory tier a KV entry lives in as ``kv_tier``.
SLA_TIER_LABEL: Final = "sla_tier"
#: The ModelDeployment a gateway serves (the tenant table's ``model_deployment``), on the metering series.
MODEL_DEPLOYMENT_LABEL: Final = "model_deployment"
#: Distinct tenants one gateway process labels by name. A table holds what the operator admitted, but each
#: tenant adds a few dozen series (the histograms ~15 buckets each); past this many, tenants first seen
#: later share the ``OTHER_TENANTS`` label, so a ModelDeployment with thousands of tenants cannot blow up
#: Prometheus. Their requests and tokens are still counted, under that label.
MAX_TENANT_LABELS: Final = 500
OTHER_TENANTS: Final = "_other"
UNAUTHENTICATED: Final = "_unauthenticated"
UNKNOWN_MODEL: Final = "_unknown"
NO_TIER: Final = "_none"

#: ``outcome`` of ``kvfleet_gateway_requests_total``.
OUTCOMES: Final = (
    "ok",  # upstream answered 2xx and the whole answer reached the client
    "client_error",  # rejected by the gateway or the engine with a 4xx (bad input, auth, model)
    "throttled",  # 429 from admission (rate, concurrency or KV budget)
    "upstream_error",  # engine 5xx, connection lost mid-answer, or all replicas refused the connection
    "unavailable",  # no healthy replica in the tenant's pool (503)
    "cancelled",  # the client went away; the upstream request was cancelled
)
#: ``reason`` of ``kvfleet_gateway_throttled_total``.
THROTTLE_REASONS: Final = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrency",
    "kv_budget",
    "body_bytes",
    "engine_queue",  # held for room on saturated engines (fair queuing) too long, or too many held
)
#: ``reason`` of ``kvfleet_gateway_rejected_total``.
REJECT_REASONS: Final = (
    "unauthenticated",
    "ambiguous_api_key",  # the key is listed by more than one tenant
    "model_not_allowed",
    "bad_request",
    "request_too_large",  # can never run within the tenant's KV burst cap or tokens per minute
    "body_too_large",
    "body_timeout",
    "gateway_busy",  # the process holds as many request bodies as it may
    "no_healthy_replica",
)
#: ``reason`` of ``kvfleet_gateway_connections_closed_total``.
CONNECTION_CLOSE_REASONS: Final = ("over_limit", "over_source_limit", "header_timeout")
#: ``kind`` of ``kvfleet_gateway_upstream_errors_total``.
UPSTREAM_ERROR_KINDS: Final = ("connect", "status_5xx", "disconnect", "timeout")


#: ``prometheus_client``'s formatting of a bucket bound (it leaves the function untyped).
_format_bound = cast(Callable[[float], str], floatToGoString)


# Request-path families --------------------------------------------------------------------------------------
class LocalValue:
    """One counter or gauge sample of a ``LocalFamily``: a plain number (see the module docstring)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class LocalHistogram:
    """One histogram sample of a ``LocalFamily``: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        #: ``counts[i]``: observations in ``(bounds[i - 1], bounds[i]]``; the last one: above every bound.
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


class LocalFamily:
    """A labelled counter, gauge or histogram whose samples are ``LocalValue``s or ``LocalHistogram``s
    (``kind`` is ``counter``, ``gauge`` or ``histogram``); ``name`` is the exposed family name, without a
    counter's ``_total``."""

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.buckets = buckets
        #: The ``le`` label of each bucket, as ``prometheus_client`` writes it.
        self._le = (*(_format_bound(b) for b in buckets), "+Inf")
        self.values: dict[tuple[str, ...], LocalValue] = {}
        self.histograms: dict[tuple[str, ...], LocalHistogram] = {}

    def labels(self, *values: str) -> LocalValue:
        """The counter or gauge sample of these label values (created at 0)."""
        assert self.kind != "histogram" and len(values) == len(self.labelnames)
        found = self.values.get(values)
        if found is None:
            found = self.values[values] = LocalValue()
        return found

    def histogram(self, *values: str) -> LocalHistogram:
        """The histogram sample of these label values (created empty)."""
        assert self.kind == "histogram" and len(values) == len(self.labelnames)
        found = self.histograms.get(values)
        if found is None:
            found = self.histograms[values] = LocalHistogram(self.buckets)
        return found

    def collect(self) -> Metric:
        labels = list(self.labelnames)
        if self.kind == "histogram":
            histograms = HistogramMetricFamily(self.name, self.documentation, labels=labels)
            for values, sample in self.histograms.items():
                cumulative, total = [], 0
                for bound, count in zip(self._le, sample.counts, strict=True):
                    total += count
                    cumulative.append((bound, float(total)))
                histograms.add_metric(list(values), cumulative, sample.sum)
            return histograms
        family: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(self.name, self.documentation, labels=labels)
            if self.kind == "counter"
            else GaugeMetricFamily(self.name, self.documentation, labels=labels)
        )
        for values, value in self.values.items():
            family.add_metric(list(values), value.value)
        return family


class LocalCollector(Collector):
    """Exposes ``families`` on a registry (every family, with or without samples, as the wrappers do)."""

    def __init__(self, families: list[LocalFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_QUEUE_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    """All gateway collectors, registered on one registry (one per gateway app, so tests stay isolated)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        self._tenant_labels: set[str] = set()
        self._responses: dict[tuple[str, int], LocalValue] = {}
        #: The tenant table's ModelDeployment (``set_model_deployment``); one value per gateway.
        self.model_deployment = ""
        r = self.registry
        lat = ("tenant", "model", SLA_TIER_LABEL)
        req = (MODEL_DEPLOYMENT_LABEL, *lat)
        self.requests = LocalFamily(
            "counter",
            REQUESTS_TOTAL.removesuffix("_total"),
            "Requests the gateway finished, by outcome.",
            (*req, "outcome"),
        )
        self.responses = LocalFamily(
            "counter",
            RESPONSES_TOTAL.removesuffix("_total"),
            "Answers on the API paths (/v1/...) by HTTP status, as the client received it (a stream that "
            "breaks after its headers went out counts as the 200 it started with).",
            (MODEL_DEPLOYMENT_LABEL, "tenant", "code"),
        )
        self.prompt_tokens = LocalFamily(
            "counter",
            PROMPT_TOKENS_TOTAL.removesuffix("_total"),
            "Prompt tokens reported by the engine (usage.prompt_tokens).",
            req,
        )
        self.completion_tokens = LocalFamily(
            "counter",
            COMPLETION_TOKENS_TOTAL.removesuffix("_total"),
            "Completion tokens reported by the engine (usage.completion_tokens).",
            req,
        )
        self.cached_prompt_tokens = LocalFamily(
            "counter",
            CACHED_PROMPT_TOKENS_TOTAL.removesuffix("_total"),
            "Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens).",
            req,
        )
        self.ttft = LocalFamily(
            "histogram",
            TTFT_SECONDS,
            "Time from request arrival at the gateway to the first streamed token (streaming requests).",
            lat,
            _LATENCY_BUCKETS,
        )
        self.itl = LocalFamily(
            "histogram",
            INTER_TOKEN_LATENCY_SECONDS,
            "Time between consecutive streamed chunks after the first.",
            lat,
            _ITL_BUCKETS,
        )
        self.duration = LocalFamily(
            "histogram",
            REQUEST_DURATION_SECONDS,
            "Time from request arrival to the last byte of the answer.",
            lat,
            _LATENCY_BUCKETS,
        )
        self.queue_time = LocalFamily(
            "histogram",
            QUEUE_TIME_SECONDS,
            "Time a request waited in its tenant's admission queue (0 when admitted at once).",
            ("tenant", SLA_TIER_LABEL),
            _QUEUE_BUCKETS,
        )
        self.throttled = Counter(
            THROTTLED_TOTAL.removesuffix("_total"),
            "Requests answered 429 by admission control.",
            (MODEL_DEPLOYMENT_LABEL, "tenant", SLA_TIER_LABEL, "reason"),
            registry=r,
        )
        self.rejected = Counter(
            REJECTED_TOTAL.removesuffix("_total"),
            "Requests the gateway refused before admission (auth, model, bad input, no replica).",
            ("tenant", "reason"),
            registry=r,
        )
        self.upstream_errors = Counter(
            UPSTREAM_ERRORS_TOTAL.removesuffix("_total"),
            "Failures talking to an engine replica.",
            ("pool", "kind"),
            registry=r,
        )
        self.engine_queue_depth = Gauge(
            ENGINE_QUEUE_DEPTH,
            "Requests held at the gateway for room on the pool's saturated engines, by SLA tier.",
            ("pool", SLA_TIER_LABEL),
            registry=r,
        )
        self.fair_virtual_tokens = Gauge(
            FAIR_VIRTUAL_TOKENS,
            "The tenant's fair-queuing virtual counter: weighted tokens served divided by its weight "
            "(lifted to its tier's smallest when it returns from idle).",
            ("tenant",),
            registry=r,
        )
        self.shared_store_up = Gauge(
            SHARED_STORE_UP,
            "1 while this replica splits the rate limits with the other gateway replicas through the shared "
            "store; 0 while it enforces its static share (1/replicas): no store configured, or unreachable.",
            registry=r,
        )
        self.shared_store_replicas = Gauge(
            SHARED_STORE_REPLICAS,
            "Gateway replicas (this one included) the last successful sync with the shared store saw.",
            registry=r,
        )
        self.shared_store_syncs = Counter(
            SHARED_STORE_SYNCS_TOTAL.removesuffix("_total"),
            "Syncs with the shared store, by outcome (ok, error).",
            ("outcome",),
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            KV_INDEX_BLOCKS,
            "KV blocks the precise-routing index knows the pool's replicas hold (from their KV events).",
            ("pool",),
            registry=r,
        )
        self.kv_events = Counter(
            KV_EVENTS_TOTAL.removesuffix("_total"),
            "KV events received from the pool's engines, by kind (stored, removed, cleared, undecodable).",
            ("pool", "kind"),
            registry=r,
        )
        self.kv_index_resets = Counter(
            KV_INDEX_RESETS_TOTAL.removesuffix("_total"),
            "Times a replica's entries were dropped from the index, by reason (gap: events lost; restart: "
            "the engine's sequence began again; cleared: its cache was reset; left: it left the pool; "
            "expired and corrected count entries, not replicas).",
            ("pool", "reason"),
            registry=r,
        )
        self.route_decisions = Counter(
            ROUTE_DECISIONS_TOTAL.removesuffix("_total"),
            "Replica choices, by how (precise: the longest prefix the index knows within the load bound; "
            "affinity: the salted prefix hash, when the index knows nothing useful).",
            ("pool", "how"),
            registry=r,
        )
        self.route_predicted_cached = Counter(
            ROUTE_PREDICTED_CACHED_TOKENS_TOTAL.removesuffix("_total"),
            "Prompt tokens the index predicted cached on the replica it routed to (precise decisions).",
            ("pool",),
            registry=r,
        )
        self.route_reported_cached = Counter(
            ROUTE_REPORTED_CACHED_TOKENS_TOTAL.removesuffix("_total"),
            "Cached prompt tokens the engine reported for the same requests (to compare with the above).",
            ("pool",),
            registry=r,
        )
        self.in_flight = LocalFamily(
            "gauge",
            IN_FLIGHT_REQUESTS,
            "Requests admitted and not yet finished.",
            ("tenant", SLA_TIER_LABEL),
        )
        self.kv_in_flight = LocalFamily(
            "gauge",
            KV_IN_FLIGHT_TOKENS,
            "Estimated KV footprint (prompt + max_tokens) of the tenant's admitted requests.",
            ("tenant",),
        )
        self.reloads = Counter(
            CONFIG_RELOADS_TOTAL.removesuffix("_total"),
            "Tenant table / key file reloads that took effect.",
            registry=r,
        )
        self.reload_failures = Counter(
            CONFIG_RELOAD_FAILURES_TOTAL.removesuffix("_total"),
            "Reloads rejected because a file was unreadable or invalid (the last good config stays).",
            ("file",),
            registry=r,
        )
        self.replica_healthy = Gauge(
            REPLICA_HEALTHY,
            "1 when the replica's last health check passed.",
            ("pool", "replica"),
            registry=r,
        )
        self.open_connections = Gauge(
            OPEN_CONNECTIONS, "Client connections open on the public port.", registry=r
        )
        self.connections_closed = Counter(
            CONNECTIONS_CLOSED_TOTAL.removesuffix("_total"),
            "Client connections the gateway closed itself: over the connection bound or the bound per "
            "source address (refused at once with a 503) or headers not received within the header "
            "timeout (408).",
            ("reason",),
            registry=r,
        )

        r.register(
            LocalCollector(
                [
                    self.requests,
                    self.responses,
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.cached_prompt_tokens,
                    self.ttft,
                    self.itl,
                    self.duration,
                    self.queue_time,
                    self.in_flight,
                    self.kv_in_flight,
                ]
            )
        )

    def set_model_deployment(self, name: str) -> None:
        """The ModelDeployment every metering series is labelled with (from the tenant table)."""
        if name != self.model_deployment:
            self.model_deployment = name
            self._series.clear()
            self._responses.clear()

    def tenant_label(self, tenant: str) -> str:
        """The ``tenant`` label value for ``tenant``: its name for the first ``MAX_TENANT_LABELS``
        tenants this process labels (and for the fixed ``_``-prefixed values), ``OTHER_TENANTS`` after."""
        labels = self._tenant_labels
        if tenant in labels or tenant.startswith("_"):
            return tenant
        if len(labels) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        labels.add(tenant)
        return tenant

    def series(self, tenant: str, model: str, tier: str) -> RequestSeries:
        """The per-request children for one (tenant, model, SLA tier), resolved once and cached.

        The request path updates a dozen of them, so they are looked up once per label set (bounded, see
        the module docstring).
        """
        key = (tenant, model, tier)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = RequestSeries(self, self.tenant_label(tenant), model, tier)
        return found

    def count_request(self, tenant: str, model: str, tier: str, outcome: str) -> None:
        """One finished request outside the admitted path (refused before admission)."""
        self.requests.labels(self.model_deployment, self.tenant_label(tenant), model, tier, outcome).inc()

    def count_rejected(self, tenant: str, reason: str) -> None:
        self.rejected.labels(self.tenant_label(tenant), reason).inc()

    def count_throttled(self, tenant: str, model: str, tier: str, reason: str) -> None:
        """A 429 from admission: the throttle reason and the request's ``throttled`` outcome."""
        self.throttled.labels(self.model_deployment, self.tenant_label(tenant), tier, reason).inc()
        self.series(tenant, model, tier).outcomes["throttled"].inc()

    def count_response(self, tenant: str, status: int) -> None:
        """One answer with HTTP ``status`` to ``tenant`` (``UNAUTHENTICATED`` when no key matched)."""
        key = (tenant, status)
        child = self._responses.get(key)
        if child is None:
            code = str(status) if 100 <= status <= 599 else "other"
            child = self._responses[key] = self.responses.labels(
                self.model_deployment, self.tenant_label(tenant), code
            )
        child.inc()


class RequestSeries:
    """The children of the request-path metrics for one (tenant label, model, SLA tier)."""

    __slots__ = (
        "cached_prompt_tokens",
        "completion_tokens",
        "duration",
        "in_flight",
        "itl",
        "kv_in_flight",
        "outcomes",
        "prompt_tokens",
        "queue_time",
        "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, tenant: str, model: str, tier: str) -> None:
        labels = (tenant, model, tier)
        metered = (metrics.model_deployment, *labels)
        self.outcomes = {o: metrics.requests.labels(*metered, o) for o in OUTCOMES}
        self.prompt_tokens = metrics.prompt_tokens.labels(*metered)
        self.completion_tokens = metrics.completion_tokens.labels(*metered)
        self.cached_prompt_tokens = metrics.cached_prompt_tokens.labels(*metered)
        self.ttft = metrics.ttft.histogram(*labels)
        self.itl = metrics.itl.histogram(*labels)
        self.duration = metrics.duration.histogram(*labels)
        self.queue_time = metrics.queue_time.histogram(tenant, tier)
        self.in_flight = metrics.in_flight.labels(tenant, tier)
        self.kv_in_flight = metrics.kv_in_flight.labels(tenant)
