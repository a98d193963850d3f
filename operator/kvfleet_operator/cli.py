"""``kvfleet operator``: run the operator (registered through the ``kvfleet.commands`` entry point)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from prometheus_client import start_http_server


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "operator",
        help="run the kvfleet operator (reconciles ModelDeployments and Tenants)",
        description="Run the kvfleet operator against the cluster in $KUBECONFIG or the in-cluster config.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", action="append", default=[], help="watch only this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--metrics-port", type=int, default=8081, help="port of /metrics (0: off)")
    parser.add_argument(
        "--probe-address", default="0.0.0.0:8080", help="host:port of the liveness/readiness endpoint"
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    # Imported here: importing the handlers registers them with kopf, which only running the operator wants.
    import kopf  # noqa: PLC0415

    from kvfleet_operator import metrics  # noqa: PLC0415
    from kvfleet_operator.handlers import kopf_handlers  # noqa: PLC0415

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # kopf logs every handler run at INFO: keep the log for what changed
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.REGISTRY)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://{args.probe_address}/healthz",
        # The reconcile lists Tenants across exactly these namespaces (dedicated GPU group ownership).
        memo=kopf.Memo({kopf_handlers.MEMO_WATCH_NAMESPACES: tuple(args.namespace)}),
    )
    return 0
