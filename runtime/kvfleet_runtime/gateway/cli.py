"""``kvfleet gateway``: run the tenant-aware OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

from kvfleet_runtime.config import GATEWAY_METRICS_PORT, GATEWAY_PORT
from kvfleet_runtime.config_watch import describe_error
from kvfleet_runtime.gateway.server import serve
from kvfleet_runtime.gateway.settings import add_flags, from_flags
from kvfleet_runtime.gateway.state import load_snapshot


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"wants host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - a server in a pod listens on all


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="Run the tenant-aware OpenAI-compatible gateway.",
        description="Authenticate tenants, apply their limits, salt and prioritise their requests, and "
        "route them to vLLM replicas with prefix affinity. Reloads the tenant table and key file when "
        "they change.",
    )
    add_flags(p)  # one per gateway setting (gateway/settings.py)
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
    p.add_argument("--log-level", default="INFO", help="Python logging level")
    p.set_defaults(func=run)


#: How long another thread may hold the GIL before the event loop's thread gets it (CPython's default is
#: 5 ms). The loop gives the GIL up at every socket call and must wait up to this long for it back while
#: a reload's thread decodes a new tenant table (about 0.2 s of work at 10,000 tenants): at 5 ms a request
#: waited 200 ms during reloads (benchmarks/gateway/reload.py). With no other thread busy nothing switches.
SWITCH_INTERVAL_S = 0.0005


def run_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run a front door's event loop (uvloop where installed), its reload threads kept short of the GIL."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up; plain asyncio works the same
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = from_flags(args)
    host, port = args.listen
    metrics_host, metrics_port = args.metrics_listen
    try:
        load_snapshot(settings.config_path, settings.keys_path)
    except (OSError, ValueError) as exc:
        logging.getLogger("kvfleet.gateway").error("cannot start: %s", describe_error(exc))
        return 2
    try:
        run_loop(serve(settings, host, port, metrics_host, metrics_port))
    except KeyboardInterrupt:
        return 0
    return 0
