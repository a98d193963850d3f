"""Operator fail-over on the real control plane: two replicas, kill -9 of the leader, time until the other
reconciles a change; with the writes of both counted from the API server's audit log.

    PYTHONPATH=hack:tests:tests/cluster .venv/bin/python benchmarks/operator_failover.py [--kills 5]

Starts the full local control plane (its API server writes an audit log of every write), the qwen72b
example with three tenants, and two ``kvfleet operator`` replicas (identities ``replica-a`` and
``replica-b``, the chart's Lease timings: 8 s lease, 5 s renew deadline, 1 s retry). Each round: kill -9
of the Lease holder, create a Tenant at once, and measure

* ``failover``: from the kill until the new Tenant is Ready (the other replica took the Lease, started
  kopf and reconciled), the time a user waits for a change made at the worst moment;
* ``lease_takeover``: from the kill until the other replica holds the Lease;

then restart the killed replica as a standby. From the audit log: no write of the killed replica after
the kill, the two replicas' writes never interleave, and (``idle``) what a converged leader and a
standby write in 30 s: Lease renewals only. Writes are the operator's ServiceAccount's (both replicas run
as it; counted by user), told apart by the User-Agent each replica sends. Writes
``benchmarks/results/operator_failover.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from audit import AuditLog, by_operator, count_by, terms
from devcluster import start_control_plane
from operators import (
    OperatorReplica,
    holder,
    leftover_mutations,
    operator_user,
    prepare_namespace,
    tenants_ready,
)
from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)
from test_operator_reconcile import create, load_example


def wait(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` every 50 ms; returns when it held (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"{what} after {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    add_results_argument(parser, "operator_failover")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    plane = start_control_plane("full", timeout=300)
    logs = Path(tempfile.mkdtemp(prefix="kvfleet-failover-"))
    replicas: dict[str, OperatorReplica] = {}
    try:
        namespace = prepare_namespace(plane, "failover")
        audit = AuditLog(plane.audit_log)
        user = operator_user(namespace)
        for name in ("replica-a", "replica-b"):
            replicas[name] = OperatorReplica(plane, namespace, name, logs)
        replicas["replica-a"].start()
        wait(lambda: holder(plane, namespace) == "replica-a", 120, "replica-a leading")
        wait(lambda: tenants_ready(plane, namespace), 180, "tenants Ready")
        replicas["replica-b"].start()
        wait(lambda: replicas["replica-b"].role() == "standby", 60, "replica-b standing by")
        wait(lambda: leftover_mutations(plane, namespace) == 0, 60, "converged")

        # What a converged leader and its standby write while nothing changes.
        time.sleep(3)
        audit.mark()
        time.sleep(args.idle_seconds)
        idle = by_operator(audit.writes(), namespace, user=user)
        idle_work = [w.describe() for w in idle if not w.is_lease]
        idle_lease = count_by((w for w in idle if w.is_lease), "identity")

        failovers: list[float] = []
        takeovers: list[float] = []
        rounds: list[dict[str, object]] = []
        for i in range(args.kills):
            leader = holder(plane, namespace)
            standby = next(n for n in replicas if n != leader)
            audit.mark()
            replicas[leader].kill()
            killed = time.monotonic()
            doc = load_example("tenant-startup-a.yaml", namespace)
            doc["metadata"]["name"] = f"after-kill-{i}"
            create(plane, doc)
            new = (f"after-kill-{i}",)
            took_lease = (
                wait(lambda s=standby: holder(plane, namespace) == s, 60, f"{standby} leading") - killed
            )
            ready = wait(lambda n=new: tenants_ready(plane, namespace, n), 60, "tenant Ready")
            failovers.append(round(ready - killed, 2))
            takeovers.append(round(took_lease, 2))
            writes = by_operator(audit.writes(), namespace, user=user)
            runs = [who for who, _ in terms(writes)]
            by_killed = [w.describe() for w in writes if w.identity == leader]
            rounds.append(
                {
                    "killed": leader,
                    "failover_s": failovers[-1],
                    "lease_takeover_s": takeovers[-1],
                    "writes_by_identity": dict(count_by(writes, "identity")),
                    "runs_of_writers": runs,
                    "writes_by_killed_after_kill": by_killed,
                }
            )
            print(rounds[-1], flush=True)
            assert not by_killed, by_killed
            assert runs == [standby], runs  # only the new leader wrote, in one run
            replicas[leader].start()  # back as a standby
            # A standby times a Lease from when it first sees it: let it start and look before the next kill.
            wait(lambda r=replicas[leader]: r.role() == "standby", 60, f"{leader} standing by")
            time.sleep(2)
        assert leftover_mutations(plane, namespace) == 0
        figures = {
            "failover": Figure.of(failovers, "s", note="kill -9 of the leader to a new Tenant Ready"),
            "lease_takeover": Figure.of(
                takeovers, "s", note="kill -9 to the other replica holding the Lease"
            ),
            "idle_writes_besides_lease": Figure.single(
                len(idle_work), "writes", note=f"{args.idle_seconds:g} s"
            ),
            "idle_lease_renewals": Figure.single(
                sum(idle_lease.values()), "writes", note=f"{args.idle_seconds:g} s"
            ),
        }
        details: dict[str, object] = {
            "kills": args.kills,
            "lease": {"duration_s": 8, "renew_deadline_s": 5, "retry_period_s": 1},
            "idle_seconds": args.idle_seconds,
            "idle_writes_besides_lease": idle_work,
            "idle_lease_renewals_by_identity": dict(idle_lease),
            "rounds": rounds,
            "writes_counted_by": "user: the operator's ServiceAccount (both replicas run as it)",
        }
        run = measured(
            name_of(args.results),
            command_line(prefix="PYTHONPATH=hack:tests:tests/cluster"),
            figures,
            Machine.here(load_at_start),
            details,  # type: ignore[arg-type]
        )
        write_results(run, args.results)
        return 0
    finally:
        for replica in replicas.values():
            replica.kill()
        plane.stop()


if __name__ == "__main__":
    sys.exit(main())
