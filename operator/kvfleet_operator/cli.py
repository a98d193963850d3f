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
    election = parser.add_argument_group("leader election (a coordination.k8s.io/v1 Lease)")
    election.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="run kopf at once, without a Lease (only ever one replica)",
    )
    election.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the Lease (default: $POD_NAMESPACE, else the namespace of $KVFLEET_SALT_SECRET)",
    )
    election.add_argument("--leader-election-lease", default="kvfleet-leader", help="name of the Lease")
    election.add_argument(
        "--lease-duration", type=float, default=8.0, help="seconds a standby waits for an unrenewed Lease"
    )
    election.add_argument(
        "--renew-deadline", type=float, default=5.0, help="seconds without renewal after which a leader exits"
    )
    election.add_argument(
        "--retry-period", type=float, default=1.0, help="seconds between renewals and looks"
    )
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    # Imported here: importing the handlers registers them with kopf, which only running the operator wants.
    import asyncio  # noqa: PLC0415
    import os  # noqa: PLC0415

    from kvfleet_operator import metrics  # noqa: PLC0415
    from kvfleet_operator.handlers import kopf_handlers, running  # noqa: PLC0415
    from kvfleet_operator.k8s.leader import LeaseTimings, default_identity  # noqa: PLC0415

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # kopf logs every handler run at INFO: keep the log for what changed
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.REGISTRY)
    host, _, port = args.probe_address.rpartition(":")
    election = None
    if args.leader_election:
        namespace = (
            args.leader_election_namespace
            or os.environ.get("POD_NAMESPACE")
            or kopf_handlers.SALT_SECRET.partition("/")[0]
        )
        timings = LeaseTimings(args.lease_duration, args.renew_deadline, args.retry_period)
        election = running.LeaderElection(namespace, args.leader_election_lease, timings)
    options = running.RunOptions(
        identity=default_identity(),
        namespaces=tuple(args.namespace),
        probe_host=host,
        probe_port=int(port),
        election=election,
    )
    return asyncio.run(running.run(options))
