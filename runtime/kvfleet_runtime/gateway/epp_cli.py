"""``kvfleet epp`` (the Endpoint Picker) and ``kvfleet envoy`` (Envoy in front of it).

Both take the gateway's settings flags (gateway/settings.py): the EPP enforces them, and Envoy's
timeouts and connection bound are rendered from the same values. gRPC and Envoy are imported when a
command runs, so the engine image, which has neither, still has a ``kvfleet`` command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

from kvfleet_runtime.config import ENVOY_ADMIN_PORT, EPP_METRICS_PORT, EPP_PORT, GATEWAY_PORT
from kvfleet_runtime.config_watch import describe_error
from kvfleet_runtime.gateway.cli import parse_listen, run_loop
from kvfleet_runtime.gateway.settings import GatewaySettings, add_flags, from_flags
from kvfleet_runtime.gateway.state import load_snapshot

log = logging.getLogger("kvfleet.gateway.epp")


def register(subparsers: Any) -> None:
    epp = subparsers.add_parser(
        "epp",
        help="Run the Endpoint Picker: kvfleet's tenancy for a Gateway API Inference Extension gateway.",
        description="An Envoy ext_proc gRPC server that authenticates tenants, applies their limits, "
        "salts and prioritises their requests, queues them fairly and picks the engine replica, for the "
        "platform's own gateway (an InferencePool's endpointPickerRef) or `kvfleet envoy`.",
    )
    add_flags(epp)
    epp.add_argument(
        "--listen",
        type=parse_listen,
        default=("0.0.0.0", EPP_PORT),  # noqa: S104 - a server in a pod listens on all
        help=f"host:port of the ext_proc gRPC service and gRPC health (0.0.0.0:{EPP_PORT})",
    )
    epp.add_argument(
        "--metrics-listen",
        type=parse_listen,
        default=("0.0.0.0", EPP_METRICS_PORT),  # noqa: S104
        help=f"host:port of /metrics (0.0.0.0:{EPP_METRICS_PORT})",
    )
    epp.add_argument(
        "--tls-cert", type=Path, help="PEM certificate of the gRPC port (with --tls-key: TLS only)"
    )
    epp.add_argument("--tls-key", type=Path, help="PEM private key of the gRPC port")
    epp.add_argument("--log-level", default="INFO", help="Python logging level")
    epp.set_defaults(func=run_epp)

    envoy = subparsers.add_parser(
        "envoy",
        help="Run Envoy in front of the Endpoint Picker (kvfleet's second data plane).",
        description="Render Envoy's configuration from the gateway's settings (the client-supplied "
        "destination header stripped, ext_proc to the EPP in full duplex, FailClose) and run Envoy.",
    )
    add_flags(envoy)
    envoy.add_argument(
        "--listen",
        type=parse_listen,
        default=("0.0.0.0", GATEWAY_PORT),  # noqa: S104
        help=f"host:port of the OpenAI API (0.0.0.0:{GATEWAY_PORT})",
    )
    envoy.add_argument(
        "--epp", type=parse_listen, required=True, help="host:port of the Endpoint Picker's gRPC service"
    )
    envoy.add_argument("--epp-ca", type=Path, help="PEM CA that signs the EPP's certificate (TLS to the EPP)")
    envoy.add_argument(
        "--admin-port", type=int, default=ENVOY_ADMIN_PORT, help="Envoy's admin port, on 127.0.0.1 (/ready)"
    )
    envoy.add_argument(
        "--print-config", action="store_true", help="print the rendered configuration and exit"
    )
    envoy.set_defaults(func=run_envoy)


def _check_table(settings: GatewaySettings) -> bool:
    try:
        load_snapshot(settings.config_path, settings.keys_path)
    except (OSError, ValueError) as exc:
        log.error("cannot start: %s", describe_error(exc))
        return False
    return True


def run_epp(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = from_flags(args)
    if (args.tls_cert is None) != (args.tls_key is None):
        log.error("cannot start: --tls-cert and --tls-key go together (TLS needs both)")
        return 2
    if not _check_table(settings):
        return 2
    tls = (args.tls_cert, args.tls_key) if args.tls_cert is not None else None
    try:
        run_loop(_serve_epp(settings, args.listen, args.metrics_listen, tls))
    except KeyboardInterrupt:
        return 0
    return 0


async def _serve_epp(
    settings: GatewaySettings,
    listen: tuple[str, int],
    metrics_listen: tuple[str, int],
    tls: tuple[Path, Path] | None,
) -> None:
    from kvfleet_runtime.gateway.epp import running_epp  # noqa: PLC0415 - gRPC only where it runs

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    host, port = listen
    async with running_epp(settings, host, port, metrics_port=metrics_listen[1], tls=tls) as (
        address,
        picker,
        url,
    ):
        log.info(
            "kvfleet endpoint picker on %s (%s), metrics on %s", address, "TLS" if tls else "plaintext", url
        )
        await picker.pipeline.warm_parse_workers()
        await stop.wait()
        log.info("shutting down: %d requests in flight", picker.in_flight)


def run_envoy(args: argparse.Namespace) -> int:
    from kvfleet_runtime.gateway.envoy import EnvoyPorts, bootstrap, envoy_argv  # noqa: PLC0415

    settings = from_flags(args)
    host, port = args.listen
    epp_host, epp_port = args.epp
    config = bootstrap(settings, EnvoyPorts(host, port, args.admin_port, epp_host, epp_port), args.epp_ca)
    if args.print_config:
        print(json.dumps(config, indent=2))
        return 0
    # A read-only root filesystem: the configuration goes to the writable temporary directory.
    directory = Path(tempfile.mkdtemp(prefix="kvfleet-envoy-"))
    path = directory / "envoy.json"
    path.write_text(json.dumps(config))
    argv = envoy_argv(path, directory)
    os.execv(argv[0], argv)  # noqa: S606 - Envoy replaces this process (its signals, its exit status)
