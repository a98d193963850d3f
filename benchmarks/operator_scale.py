"""Operator scale benchmark: 1,000 Tenants across 10 ModelDeployments on the real control plane.

    PYTHONPATH=hack:tests:tests/cluster .venv/bin/python benchmarks/operator_scale.py [--tenants 1000]

Starts the full local control plane with kwok nodes (a shared pool plus one tainted GPU group per
dedicated tenant), creates the ModelDeployments (CPU engines, so no GPU is needed for the shared pools)
and the Tenants (mostly salted and shared, 50 dedicated), then starts ``kvfleet operator`` and measures:
wall time until every Tenant is Ready, the API calls the operator made (its own
``kvfleet_operator_api_calls_total``), the writes the API server's audit log holds from the operator
(counted by user: the ServiceAccount it runs as; its client's and kopf's told apart by User-Agent; Lease
renewals apart), then the writes of
``--idle-seconds`` of converged resyncs (every ModelDeployment's timer fires in that time), and the
operator's peak RSS (VmHWM). Prints one JSON line and writes the results file ``--results`` (default
``benchmarks/results/operator_scale.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from audit import AuditLog, Write, by_operator, count_by
from cluster_helpers import apply_crds, create_namespace
from devcluster import build_layout, start_control_plane
from operators import operator_kubeconfig, operator_user
from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def model_deployment(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {
                "servedName": name,
                "source": {"huggingFace": "local/tiny-llama"},
                "architecture": {"preset": "tiny-llama"},
            },
            "engine": {"blockSize": 32},
            "kvCache": {"cpuSize": "64Gi"},
            "pool": {"replicas": 1, "gpusPerReplica": 0, "cpuKvCacheSpace": "64Gi"},
            "gateway": {"replicas": 1},
        },
    }


def tenant(namespace: str, name: str, md: str, index: int, group: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "modelDeploymentRef": {"name": md},
        "tier": ("premium", "standard", "basic")[index % 3],
        "kvQuota": {"hbm": "0.5%", "cpu": "128Mi"},
        "burstLimit": "20%",
        "isolation": "dedicated" if group else ("salted", "shared")[index % 2],
    }
    if group:
        spec["dedicated"] = {"gpuGroup": group, "replicas": 1}
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def ready_tenants(plane: Any, namespace: str) -> int:
    status, body = plane.request("GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants")
    assert status == 200, body
    return sum(
        1
        for item in body["items"]
        for c in (item.get("status") or {}).get("conditions") or []
        if c["type"] == "Ready" and c["status"] == "True"
    )


def api_calls(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    calls: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvfleet_operator_api_calls_total{"):
            verb = line.split('verb="')[1].split('"')[0]
            calls[verb] = float(line.rsplit(" ", 1)[1])
    return calls


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


#: The operator's identity in the audit log (its User-Agent names it).
IDENTITY = "scale-operator"


def audited(writes: list[Write]) -> dict[str, Figure]:
    """The operator's audited writes: total, by client (its own, kopf's) and by verb; Lease renewals
    apart."""
    work = [w for w in writes if not w.is_lease]
    client = Counter("kopf" if w.user_agent.startswith("kopf/") else "kvfleet" for w in work)
    figures = {"audited_writes_total": Figure.single(len(work), "writes")}
    figures |= {f"audited_writes.{c}": Figure.single(n, "writes") for c, n in sorted(client.items())}
    figures |= {
        f"audited_writes.verb.{v}": Figure.single(n, "writes")
        for v, n in sorted(count_by(work, "verb").items())
    }
    figures["audited_lease_writes"] = Figure.single(len(writes) - len(work), "writes")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--model-deployments", type=int, default=10)
    parser.add_argument("--dedicated", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=70,
        help="converged time whose writes are counted (resync: 60 s)",
    )
    add_results_argument(parser, "operator_scale")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]

    groups = [f"grp-{i}" for i in range(args.dedicated)]
    layout = build_layout(shared_nodes=4, dedicated=dict.fromkeys(groups, 1))
    plane = start_control_plane("full", layout=layout, timeout=300)
    operator: subprocess.Popen[bytes] | None = None
    try:
        apply_crds(plane)
        namespace = create_namespace(plane, "scale")
        mds = [f"md-{i}" for i in range(args.model_deployments)]
        for md in mds:
            status, body = plane.request(
                "POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments",
                model_deployment(namespace, md),
            )  # fmt: skip
            assert status == 201, body
        dedicated_every = max(1, args.tenants // max(1, args.dedicated))
        made_dedicated = 0
        isolation: dict[str, int] = {}
        for i in range(args.tenants):
            group = None
            if i % dedicated_every == 0 and made_dedicated < args.dedicated:
                group = groups[made_dedicated]
                made_dedicated += 1
            doc = tenant(namespace, f"t-{i:04d}", mds[i % len(mds)], i, group)
            isolation[doc["spec"]["isolation"]] = isolation.get(doc["spec"]["isolation"], 0) + 1
            status, body = plane.request(
                "POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants", doc
            )  # fmt: skip
            assert status == 201, body

        metrics_port = _free_port()
        env = {
            **plane.env(),
            "KUBECONFIG": str(operator_kubeconfig(plane, namespace, plane.workdir / "operator.kubeconfig")),
            "KVFLEET_SALT_SECRET": f"{namespace}/kvfleet-salt-master",
            "KVFLEET_RESYNC_SECONDS": "60",
            "POD_NAME": IDENTITY,
        }
        audit = AuditLog(plane.audit_log)
        # The operator's log, for debugging a slow run; the benchmark itself does not read it.
        log = Path(os.environ.get("KVFLEET_SCALE_LOG", os.devnull)).open("wb")  # noqa: SIM115
        started = time.monotonic()
        operator = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime", "operator", "--namespace", namespace,
             "--metrics-port", str(metrics_port), "--probe-address", f"127.0.0.1:{_free_port()}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        ready = 0
        while time.monotonic() - started < args.timeout:
            ready = ready_tenants(plane, namespace)
            if ready == args.tenants:
                break
            time.sleep(1)
        converged = time.monotonic() - started
        calls = api_calls(metrics_port)
        to_ready = by_operator(audit.writes(), user=operator_user(namespace))
        audit.mark()
        time.sleep(args.idle_seconds)
        idle = by_operator(audit.writes(), user=operator_user(namespace))
        peak_rss = round(peak_rss_mib(operator.pid), 1)
        result = {
            "tenants": args.tenants,
            "model_deployments": args.model_deployments,
            "dedicated": made_dedicated,
            "ready": ready,
            "seconds_to_all_ready": round(converged, 1),
            "api_calls": {k: int(v) for k, v in sorted(calls.items())},
            "api_calls_total": int(sum(calls.values())),
            "operator_peak_rss_mib": peak_rss,
            "audited_writes_to_ready": dict(count_by(to_ready, "user_agent")),
            "audited_writes_idle": dict(count_by(idle, "user_agent")),
        }
        print(json.dumps(result))
        events = plane.request("GET", f"/api/v1/namespaces/{namespace}/events")[1]["items"]
        reasons: dict[str, int] = {}
        for event in events:
            reasons[event["reason"]] = reasons.get(event["reason"], 0) + 1
        print(json.dumps({"events_by_reason": reasons}))
        figures = {
            "seconds_to_all_ready": Figure.single(round(converged, 1), "s"),
            "api_calls_total": Figure.single(sum(calls.values()), "calls"),
            **{f"api_calls.{verb}": Figure.single(n, "calls") for verb, n in sorted(calls.items())},
            "operator_peak_rss_mib": Figure.single(peak_rss, "MiB"),
            **audited(to_ready),
            "idle_audited_writes": Figure.single(
                sum(1 for w in idle if not w.is_lease), "writes", note=f"{args.idle_seconds:g} s converged"
            ),
        }
        details = {
            "tenants": args.tenants,
            "model_deployments": args.model_deployments,
            "dedicated": made_dedicated,
            "salted": isolation.get("salted", 0),
            "shared": isolation.get("shared", 0),
            "ready": ready,
            "events_by_reason": reasons,
            "idle_seconds": args.idle_seconds,
            "idle_writes": [w.describe() for w in idle if not w.is_lease][:50],
            "audited_writes_by_resource": dict(count_by((w for w in to_ready if not w.is_lease), "resource")),
        }
        run = measured(
            name_of(args.results),
            command_line(prefix="PYTHONPATH=hack:tests:tests/cluster"),
            figures,
            Machine.here(load_at_start),
            details,
        )
        write_results(run, args.results)
        return 0 if ready == args.tenants else 1
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(timeout=30)
        plane.stop()


if __name__ == "__main__":
    sys.exit(main())
