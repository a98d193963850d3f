"""The engine plugin's HTTP server: ``/metrics`` (Prometheus) and ``/debug/kv`` (JSON), one per process.

It runs in a daemon thread of vLLM's engine-core process, next to the scheduler; a scrape copies the
pool's counters (``snapshot``) and never blocks the scheduler beyond that copy. ``/debug/kv`` also
counts vLLM's own blocks from its data structures (O(blocks)), for tests and for operators checking
that the plugin's accounting matches vLLM's.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime.engine.metrics import PoolCollector, PoolSnapshot
from kvfleet_runtime.engine.plugin_config import ENGINE_LOGGER

__all__ = ["MetricsSource", "ensure_metrics_server", "start_metrics_server"]

logger = logging.getLogger(ENGINE_LOGGER)  # runs in vLLM's engine core: log where vLLM logs

_LOCK = threading.Lock()
#: The process's server, once started (one per engine-core process).
_SERVERS: list[ThreadingHTTPServer] = []


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


def start_metrics_server(host: str, port: int, source: MetricsSource) -> ThreadingHTTPServer:
    """Serve ``source`` on ``host:port`` from a daemon thread; returns the server (``shutdown()`` stops)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(source.snapshot))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype = generate_latest(registry), CONTENT_TYPE_LATEST
            elif path == "/debug/kv":
                body = json.dumps(build_debug_document(source), sort_keys=True).encode()
                ctype = "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes every few seconds would flood vLLM's log

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="kvfleet-metrics", daemon=True)
    thread.start()
    return server


def ensure_metrics_server(host: str, port: int, source: MetricsSource) -> ThreadingHTTPServer | None:
    """Start the process's metrics server once (port 0 disables it). A port already in use (a second
    engine core on the same host, e.g. data parallel) is logged, not fatal: serving matters more."""
    if port == 0:
        return None
    with _LOCK:
        if _SERVERS:
            return _SERVERS[0]
        try:
            server = start_metrics_server(host, port, source)
        except OSError as exc:
            logger.error("kvfleet: cannot serve engine plugin metrics on %s:%d: %s", host, port, exc)
            return None
        _SERVERS.append(server)
        logger.info("kvfleet: engine plugin metrics on http://%s:%d/metrics", host, port)
        return server
