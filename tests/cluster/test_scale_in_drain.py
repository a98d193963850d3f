"""Scale-in drains on the real API server: the tenant table stops listing the leaving replicas first, the
StatefulSet keeps them (annotated) for the grace, a reconcile within the grace leaves it as it is, and the
first one after it scales the StatefulSet down and drops the annotation (reconcile/drain.py).

The pure decisions are tests/unit/test_drain.py; this checks what the real API server keeps of the
operator's writes (server-side apply removes the annotation the operator stops sending)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from cluster_helpers import apply_crds, scratch_namespace
from devcluster import ControlPlane
from test_operator_reconcile import CONFIG, create, get, load_example, reconcile

from kvfleet_operator.build.common import ANNOTATION_DRAIN, TENANT_TABLE_KEY, config_map_name

pytestmark = pytest.mark.cluster

MD = "qwen72b"
API = "/apis/kvfleet.io/v1alpha1"
GRACE_S = 4.0


def test_a_scale_in_stops_sending_first_and_removes_the_replicas_after_the_grace(
    full_cluster: ControlPlane,
) -> None:
    apply_crds(full_cluster)
    config = dataclasses.replace(CONFIG, drain_seconds=GRACE_S)
    with scratch_namespace(full_cluster, "drain") as ns:
        doc = load_example("modeldeployment-qwen72b.yaml", ns)
        doc["spec"]["pool"]["replicas"] = 3
        create(full_cluster, doc)
        sts_path = f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine"
        table_path = f"/api/v1/namespaces/{ns}/configmaps/{config_map_name(MD)}"

        def endpoints() -> list[str]:
            table = json.loads(get(full_cluster, table_path)["data"][TENANT_TABLE_KEY])
            listed = table["pools"]["shared"]["endpoints"]
            return [str(e).split(".")[0].removeprefix("http://") for e in listed]

        result, _ = reconcile(full_cluster, ns, MD, config)
        assert not result.problem, result.problem
        assert get(full_cluster, sts_path)["spec"]["replicas"] == 3
        assert endpoints() == [f"{MD}-engine-{i}" for i in range(3)]

        status, body = full_cluster.request(
            "PATCH",
            f"{API}/namespaces/{ns}/modeldeployments/{MD}",
            {"spec": {"pool": {"replicas": 1}}},
            content_type="application/merge-patch+json",
        )
        assert status == 200, body
        started = time.monotonic()
        reconcile(full_cluster, ns, MD, config)
        # Step 1: the gateways' table lists the one that stays; the three keep running, annotated.
        assert endpoints() == [f"{MD}-engine-0"]
        live = get(full_cluster, sts_path)
        assert live["spec"]["replicas"] == 3
        drain = json.loads(live["metadata"]["annotations"][ANNOTATION_DRAIN])
        assert drain["serving"] == 1 and drain["since"]
        # Within the grace a reconcile leaves the StatefulSet as it is (the drain is read back from it).
        if time.monotonic() - started < GRACE_S - 1:
            reconcile(full_cluster, ns, MD, config)
            again = get(full_cluster, sts_path)
            assert again["metadata"]["generation"] == live["metadata"]["generation"]
            assert again["metadata"]["annotations"] == live["metadata"]["annotations"]
            assert again["spec"]["replicas"] == 3
        # Step 2: after the grace, the pods go and the annotation with them.
        time.sleep(max(0.0, GRACE_S + 1.5 - (time.monotonic() - started)))
        reconcile(full_cluster, ns, MD, config)
        live = get(full_cluster, sts_path)
        assert live["spec"]["replicas"] == 1
        assert ANNOTATION_DRAIN not in (live["metadata"].get("annotations") or {}), live["metadata"]
        assert endpoints() == [f"{MD}-engine-0"]
        # Converges (a status write may follow while the pods the scale-in removed go away), and stays so.
        rounds = [reconcile(full_cluster, ns, MD, config)[1] for _ in range(4)]
        assert 0 in rounds, rounds
        assert get(full_cluster, sts_path)["spec"]["replicas"] == 1
