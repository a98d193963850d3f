"""``kvfleet gateway``: run the tenant-aware OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from kvfleet_runtime.config import GATEWAY_METRICS_PORT, GATEWAY_PORT, parse_media_hosts
from kvfleet_runtime.config_watch import describe_error
from kvfleet_runtime.gateway.server import GatewaySettings, serve
from kvfleet_runtime.gateway.state import load_snapshot


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"wants host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - a server in a pod listens on all


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {value!r}")
    return int(value)


def _non_negative_int(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"wants an integer of 0 or more, got {value!r}")
    return int(value)


def _host_list(value: str) -> frozenset[str]:
    """``--allowed-media-domains``: comma-separated host names (``config.parse_media_hosts``)."""
    try:
        return frozenset(parse_media_hosts(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _replicas(value: str) -> int:
    """``--replicas``: a count, or empty (an unset environment variable) for 1."""
    return _positive_int(value) if value else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="Run the tenant-aware OpenAI-compatible gateway.",
        description="Authenticate tenants, apply their limits, salt and prioritise their requests, and "
        "route them to vLLM replicas with prefix affinity. Reloads the tenant table and key file when "
        "they change.",
    )
    p.add_argument("--config", type=Path, required=True, help="tenant table (tenants.json)")
    p.add_argument("--keys", type=Path, required=True, help="key file (keys.json: key hashes, salt key)")
    p.add_argument(
        "--listen",
        type=parse_listen,
        default=("0.0.0.0", GATEWAY_PORT),  # noqa: S104
        help=f"host:port of the OpenAI API (0.0.0.0:{GATEWAY_PORT})",
    )
    p.add_argument(
        "--metrics-listen",
        type=parse_listen,
        default=("0.0.0.0", GATEWAY_METRICS_PORT),  # noqa: S104
        help=f"host:port of /metrics, which the API port does not serve (0.0.0.0:{GATEWAY_METRICS_PORT})",
    )
    p.add_argument(
        "--replicas",
        type=_replicas,
        default=_replicas(os.environ.get("KVFLEET_GATEWAY_REPLICAS", "")),
        help="gateway replicas sharing each tenant's rate limits; this one enforces 1/N of them "
        "(default: $KVFLEET_GATEWAY_REPLICAS, else 1)",
    )
    p.add_argument("--reload-interval", type=float, default=1.0, help="seconds between config polls")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between replica health checks")
    p.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds to receive a request's headers (else 408)"
    )
    p.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds a keep-alive connection may idle"
    )
    p.add_argument(
        "--max-connections", type=_positive_int, default=4096, help="open client connections; more get 503"
    )
    p.add_argument(
        "--max-connections-per-source",
        type=_non_negative_int,
        default=None,
        help="open client connections from one source address; more get 503 (default: a quarter of "
        "--max-connections; 0: no bound). Behind a proxy or load balancer that hides client addresses "
        "every client shares one address: raise it or set 0 there",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument("--body-timeout", type=float, default=10.0, help="seconds to receive a body (else 408)")
    p.add_argument(
        "--tenant-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="request bodies one tenant may have in memory at once (more: 429)",
    )
    p.add_argument(
        "--total-body-bytes",
        type=int,
        default=128 * 1024 * 1024,
        help="request bodies the process may have in memory at once (more: 503)",
    )
    p.add_argument(
        "--parse-workers",
        type=int,
        default=2,
        help="processes that parse bodies larger than --inline-parse-bytes (0: all on the event loop)",
    )
    p.add_argument(
        "--inline-parse-bytes", type=int, default=16 * 1024, help="bodies up to this size parse inline"
    )
    p.add_argument("--max-queue", type=int, default=64, help="per-tenant admission queue length")
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a request may wait queued")
    p.add_argument(
        "--engine-in-flight-per-replica",
        type=int,
        default=256,
        help="requests each engine replica is given at once; more wait at the gateway in fair order "
        "(0: no limit, nothing held)",
    )
    p.add_argument(
        "--fair-queuing",
        choices=("vtc", "fifo"),
        default="vtc",
        help="order of held requests within an SLA tier: vtc (token-weighted fair) or fifo",
    )
    p.add_argument("--fair-input-weight", type=float, default=1.0, help="fair-queuing cost of an input token")
    p.add_argument("--fair-output-weight", type=float, default=2.0, help="fair-queuing cost of an output one")
    p.add_argument("--affinity-prefix-chars", type=int, default=512, help="prompt chars in the affinity key")
    p.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor (> 1)")
    p.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=256,
        help="max_tokens injected into a request that sends none when the tenant table gives no bound "
        "(no KV burst cap, tokens per minute or context length)",
    )
    p.add_argument(
        "--allowed-media-domains",
        type=_host_list,
        default=frozenset(),
        help="comma-separated hosts whose http(s) URLs image_url/audio_url/video_url parts may carry (exact "
        "names); by default only data: URLs: the engine would fetch any other URL from inside the cluster",
    )
    p.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to a replica")
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        help="seconds the engine may send nothing (before a buffered answer, or between two reads of a "
        "stream); then 504, or an error event in a stream already started (600)",
    )
    p.add_argument(
        "--health-timeout", type=float, default=1.0, help="seconds a replica's /health may take (1)"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM: seconds in-flight requests may take to finish before they are cut (60)",
    )
    p.add_argument("--log-level", default="INFO", help="Python logging level")
    p.set_defaults(func=run)


def _run_loop(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up; plain asyncio works the same
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = GatewaySettings(
        config_path=args.config,
        keys_path=args.keys,
        reload_interval_s=args.reload_interval,
        health_interval_s=args.health_interval,
        header_timeout_s=args.header_timeout,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        max_connections_per_source=args.max_connections_per_source,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        tenant_body_bytes=args.tenant_body_bytes,
        total_body_bytes=args.total_body_bytes,
        parse_workers=args.parse_workers,
        inline_parse_bytes=args.inline_parse_bytes,
        replicas=args.replicas,
        max_queue=args.max_queue,
        max_queue_wait_s=args.queue_timeout,
        engine_in_flight_per_replica=args.engine_in_flight_per_replica,
        fair_queuing=args.fair_queuing == "vtc",
        fair_input_weight=args.fair_input_weight,
        fair_output_weight=args.fair_output_weight,
        affinity_prefix_chars=args.affinity_prefix_chars,
        load_factor=args.load_factor,
        default_max_tokens=args.default_max_tokens,
        allowed_media_domains=args.allowed_media_domains,
        connect_timeout_s=args.connect_timeout,
        upstream_read_timeout_s=args.upstream_timeout,
        health_timeout_s=args.health_timeout,
        drain_timeout_s=args.drain_timeout,
    )
    host, port = args.listen
    metrics_host, metrics_port = args.metrics_listen
    try:
        load_snapshot(settings.config_path, settings.keys_path)
    except (OSError, ValueError) as exc:
        logging.getLogger("kvfleet.gateway").error("cannot start: %s", describe_error(exc))
        return 2
    try:
        _run_loop(serve(settings, host, port, metrics_host, metrics_port))
    except KeyboardInterrupt:
        return 0
    return 0
