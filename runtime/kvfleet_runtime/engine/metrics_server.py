"""The engine plugin's HTTP servers: the pod's one metrics port, and ``/debug/kv`` on loopback only.

They run in daemon threads of vLLM's engine-core process, next to the scheduler; a scrape copies the
pool's counters (``snapshot``) and never blocks the scheduler beyond that copy (reading the upstreams
below is network I/O in the scrape's own thread).

**``/metrics``** (``plugin_metrics_port``) serves, in one exposition:

1. the plugin's per-tenant series (``engine.metrics``);
2. each upstream's (``KVFLEET_PLUGIN_METRICS_UPSTREAMS``, which the launcher sets: vLLM's own
   ``/metrics``, the LMCache server's per-salt series, the quota sync's per-tenant series), each read
   over the pod's loopback at scrape time;
3. ``kvfleet_engine_metrics_upstream_up{upstream}``: whether that read succeeded.

So Prometheus scrapes one port per engine pod, and that port serves no inference API: ``GET /metrics``
only (other paths 404, other methods 405). The engine's NetworkPolicy can then admit scrapers here and
never to vLLM's OpenAI port, and LMCache's and the sync's ports can bind loopback.

Why vLLM's series are read from its ``/metrics`` over loopback, not from prometheus_client's
multiprocess directory: in vLLM v1 the engine core (where this server runs) holds none of them. The stat
loggers live in the API-server process (``AsyncLLM``), and only when vLLM runs several API servers do
they write a ``PROMETHEUS_MULTIPROC_DIR``, whose files are vLLM's private state (created, aggregated and
cleaned up by vLLM, with per-release gauge modes). ``/metrics`` is vLLM's public interface: the same
names, labels and values Prometheus read before, with any number of API servers, and a failed read says
so (``up`` 0) instead of serving stale files.

Merging: families keep their names, labels and values, but for LMCache's ``cache_salt`` label, which
becomes ``salt_hash`` (``engine.salt_labels``: a salt is never published). A family name already served
(the plugin's first, then the upstreams in order) is dropped from a later upstream, so the exposition never
repeats a family (``process_*``/``python_*`` are those of the first upstream that has them: vLLM's API
server). An upstream that does not answer within ``UPSTREAM_TIMEOUT_S``, answers more than
``MAX_UPSTREAM_BYTES`` or does not parse contributes nothing but ``up`` 0; everything else is still served.

**``/debug/kv``** (the plugin's snapshot and vLLM's own block counts, counted from its data structures in
O(blocks); for tests and operators) is routed only on sockets bound to a loopback address: the metrics
socket itself when it binds loopback (tests, benchmarks), otherwise a second server on
``127.0.0.1:debug_port``. No other pod can reach it; ``kubectl port-forward`` can (it dials the pod's
loopback).
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvfleet_runtime.engine.metrics import METRICS_UPSTREAM_UP, PoolSnapshot, build_metric_families
from kvfleet_runtime.engine.plugin_config import ENGINE_LOGGER, MetricsUpstream, is_loopback_host
from kvfleet_runtime.engine.salt_labels import hash_salt_labels

__all__ = [
    "LOOPBACK",
    "MetricsSource",
    "PodMetricsCollector",
    "ensure_metrics_server",
    "fetch_metrics_text",
    "merge_families",
    "start_debug_server",
    "start_metrics_server",
]

logger = logging.getLogger(ENGINE_LOGGER)  # runs in vLLM's engine core: log where vLLM logs

#: Where the debug endpoint binds when the metrics do not bind loopback.
LOOPBACK = "127.0.0.1"
#: A scrape waits at most this long for each upstream (Prometheus' default scrape timeout is 10 s).
UPSTREAM_TIMEOUT_S = 3.0
#: An upstream answering more than this is treated as down (a scrape must not take the engine's memory).
MAX_UPSTREAM_BYTES = 32 << 20
DEBUG_PATH = "/debug/kv"
METRICS_PATH = "/metrics"

_LOCK = threading.Lock()
#: The process's servers, once started (one metrics server per engine-core process, maybe a debug one).
_SERVERS: list[ThreadingHTTPServer] = []

#: A route: () -> (body, content type).
Route = Callable[[], tuple[bytes, str]]
#: Reads one upstream: url -> its text, or ``None`` when it could not be read.
Fetch = Callable[[str], str | None]


class MetricsSource(Protocol):
    def snapshot(self) -> PoolSnapshot: ...

    def count_vllm_blocks(self) -> dict[str, int]: ...


def build_debug_document(source: MetricsSource) -> dict[str, object]:
    """The ``/debug/kv`` JSON: the plugin's snapshot and vLLM's own block counts."""
    snap = source.snapshot()
    return {
        "plugin": {
            "total_blocks": snap.total_blocks,
            "used_blocks": snap.used_blocks,
            "cached_blocks": snap.cached_blocks,
            "tenants": {name: asdict(t) for name, t in sorted(snap.tenants.items())},
            "queries": dict(snap.queries),
            "queried_tokens": dict(snap.queried_tokens),
            "hit_tokens": dict(snap.hit_tokens),
            "hit_blocks": dict(snap.hit_blocks),
            "evictions": [
                {"tenant": t, "reason": r, "count": n} for (t, r), n in sorted(snap.evictions.items())
            ],
            "reloads": dict(snap.reloads),
        },
        "vllm": source.count_vllm_blocks(),
    }


def _parse(text: str | None) -> list[Metric] | None:
    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text))
    except Exception:  # noqa: BLE001 - whatever makes an upstream unparsable, it is down, not fatal
        return None


def merge_families(own: Iterable[Metric], upstreams: Sequence[tuple[str, str | None]]) -> list[Metric]:
    """One exposition's families: ``own`` first, then each upstream's (``(name, text or None)``) in order,
    a family name served once only, ``cache_salt`` labels hashed (``salt_labels.hash_salt_labels``); plus
    ``kvfleet_engine_metrics_upstream_up`` when there are upstreams (1: its text parsed, 0: it could not be
    read or parsed). Pure."""
    out = list(own)
    seen = {family.name for family in out} | {METRICS_UPSTREAM_UP}
    up = GaugeMetricFamily(
        METRICS_UPSTREAM_UP,
        "Whether this scrape read the in-pod /metrics this port re-exports (vLLM, LMCache, the quota sync).",
        labels=["upstream"],
    )
    for name, text in upstreams:
        families = _parse(text)
        up.add_metric([name], 0.0 if families is None else 1.0)
        for family in families or []:
            if family.name not in seen:
                seen.add(family.name)
                out.append(hash_salt_labels(family))  # LMCache's cache_salt: never the salt itself
    if upstreams:
        out.append(up)
    return out


#: Never through a proxy (``HTTP_PROXY`` in the pod's environment): the upstreams are on loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch_metrics_text(url: str, timeout: float = UPSTREAM_TIMEOUT_S) -> str | None:
    """The body of ``GET url`` when it answers 200 within ``timeout`` and ``MAX_UPSTREAM_BYTES``; else
    ``None``."""
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            body: bytes = resp.read(MAX_UPSTREAM_BYTES + 1)
    except (OSError, ValueError, http.client.HTTPException):
        return None  # refused, timed out, an HTTP error status, a broken answer
    if len(body) > MAX_UPSTREAM_BYTES:
        return None
    return body.decode("utf-8", errors="replace")


class PodMetricsCollector(Collector):
    """The pool's families and the upstreams', read at every scrape (see the module docstring)."""

    def __init__(
        self,
        snapshot: Callable[[], PoolSnapshot],
        upstreams: Sequence[MetricsUpstream] = (),
        fetch: Fetch = fetch_metrics_text,
    ) -> None:
        self._snapshot = snapshot
        self._upstreams = tuple(upstreams)
        self._fetch = fetch

    def collect(self) -> Iterator[Metric]:
        own = build_metric_families(self._snapshot())
        texts = [(u.name, self._fetch(u.url)) for u in self._upstreams]
        yield from merge_families(own, texts)


def _handler(routes: Mapping[str, Route]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def do_GET(self) -> None:
            route = routes.get(self._path())
            if route is None:
                self.send_error(404)
                return
            body, ctype = route()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self) -> None:
            # No inference API here, whatever the method: nothing but GET of the routes above.
            self.send_error(405 if self._path() in routes else 404)

        do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _refuse

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes every few seconds would flood vLLM's log

    return Handler


def _serve(host: str, port: int, routes: Mapping[str, Route], name: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _handler(routes))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def _debug_route(source: MetricsSource) -> Route:
    return lambda: (json.dumps(build_debug_document(source), sort_keys=True).encode(), "application/json")


def start_metrics_server(
    host: str, port: int, source: MetricsSource, upstreams: Sequence[MetricsUpstream] = ()
) -> ThreadingHTTPServer:
    """Serve ``/metrics`` (the pool's series and ``upstreams``') on ``host:port`` from a daemon thread,
    and ``/debug/kv`` too when ``host`` is a loopback address; returns the server (``shutdown()``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodMetricsCollector(source.snapshot, upstreams))
    routes: dict[str, Route] = {METRICS_PATH: lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)}
    if is_loopback_host(host):
        routes[DEBUG_PATH] = _debug_route(source)
    return _serve(host, port, routes, "kvfleet-metrics")


def start_debug_server(port: int, source: MetricsSource) -> ThreadingHTTPServer:
    """Serve ``/debug/kv`` on ``127.0.0.1:port`` only, from a daemon thread."""
    return _serve(LOOPBACK, port, {DEBUG_PATH: _debug_route(source)}, "kvfleet-debug")


def ensure_metrics_server(
    host: str,
    port: int,
    source: MetricsSource,
    *,
    upstreams: Sequence[MetricsUpstream] = (),
    debug_port: int = 0,
) -> ThreadingHTTPServer | None:
    """Start the process's metrics server once (port 0 disables it), and, when ``host`` is not loopback,
    its debug server on ``127.0.0.1:debug_port`` (0: none). A port already in use (a second engine core on
    the same host, e.g. data parallel) is logged, not fatal: serving matters more."""
    if port == 0:
        return None
    with _LOCK:
        if _SERVERS:
            return _SERVERS[0]
        try:
            server = start_metrics_server(host, port, source, upstreams)
        except OSError as exc:
            logger.error("kvfleet: cannot serve engine plugin metrics on %s:%d: %s", host, port, exc)
            return None
        _SERVERS.append(server)
        logger.info(
            "kvfleet: engine plugin metrics on http://%s:%d/metrics (re-exporting %s)",
            host,
            port,
            ", ".join(u.name for u in upstreams) or "nothing else",
        )
        if debug_port and not is_loopback_host(host):
            try:
                _SERVERS.append(start_debug_server(debug_port, source))
                logger.info(
                    "kvfleet: engine plugin debug endpoint on http://%s:%d%s",
                    LOOPBACK,
                    debug_port,
                    DEBUG_PATH,
                )
            except OSError as exc:
                logger.error(
                    "kvfleet: cannot serve the debug endpoint on %s:%d: %s", LOOPBACK, debug_port, exc
                )
        return server
