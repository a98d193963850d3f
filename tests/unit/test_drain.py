"""Scale-in that drains (operator/kvfleet_operator/reconcile/drain.py): the tenant table drops the leaving
replicas first, the StatefulSet keeps them for the grace, all read back from the live StatefulSet.
tests/cluster/test_scale_in_drain.py runs it against the real API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.build.common import ANNOTATION_DRAIN, TENANT_TABLE_KEY
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_operator.reconcile.drain import Drain, compute_drain, compute_drains, drain_annotation
from kvfleet_runtime.config import KeyFile

T0 = "2026-12-01T00:00:00Z"
T30 = "2026-12-01T00:00:30Z"
T90 = "2026-12-01T00:01:30Z"
GRACE = 60.0


def sts(replicas: int, drain: dict[str, Any] | str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "qwen72b-engine"}
    if drain is not None:
        meta["annotations"] = {ANNOTATION_DRAIN: drain if isinstance(drain, str) else json.dumps(drain)}
    return {"kind": "StatefulSet", "metadata": meta, "spec": {"replicas": replicas}}


@pytest.mark.parametrize(
    ("desired", "live", "now", "expected"),
    [
        pytest.param(3, None, T0, None, id="not-created-yet"),
        pytest.param(3, sts(3), T0, None, id="steady"),
        pytest.param(4, sts(3), T0, None, id="scale-out"),
        pytest.param(1, sts(3), T0, Drain(3, 1, T0), id="scale-in-starts-a-drain"),
        pytest.param(1, sts(3, {"serving": 1, "since": T0}), T30, Drain(3, 1, T0), id="within-the-grace"),
        pytest.param(1, sts(3, {"serving": 1, "since": T0}), T90, None, id="grace-over-the-pods-go"),
        pytest.param(3, sts(3, {"serving": 1, "since": T0}), T30, None, id="scaled-back-up"),
        pytest.param(2, sts(3, {"serving": 1, "since": T0}), T30, Drain(3, 2, T0), id="partly-back-up"),
        pytest.param(0, sts(3, {"serving": 1, "since": T0}), T30, Drain(3, 0, T30), id="further-in-restarts"),
        pytest.param(1, sts(3, "not json"), T30, Drain(3, 1, T30), id="unreadable-annotation-restarts"),
        pytest.param(1, sts(3, {"serving": 1}), T30, Drain(3, 1, T30), id="incomplete-annotation-restarts"),
    ],
)
def test_compute_drain(desired: int, live: dict[str, Any] | None, now: str, expected: Drain | None) -> None:
    assert compute_drain(desired, live, now, GRACE) == expected


def test_no_grace_means_no_drain() -> None:
    assert compute_drain(1, sts(3), T0, 0.0) is None


def test_the_annotation_round_trips_and_says_how_long_is_left() -> None:
    drain = Drain(running=3, serving=1, since=T0)
    again = compute_drain(1, sts(3, drain_annotation(drain)), T30, GRACE)
    assert again == drain and again.remaining_s(T30, GRACE) == 30.0


def _qwen(replicas: int) -> ModelDeployment:
    doc: dict[str, Any] = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "modeldeployment-qwen72b.yaml").read_text()
    )
    doc["metadata"].update(uid="md-uid", generation=1)
    doc["spec"]["pool"]["replicas"] = replicas
    return ModelDeployment.model_validate(doc)


def _children(
    md: ModelDeployment, draining: dict[str, tuple[int, str]] | None = None
) -> list[dict[str, Any]]:
    capacity = compute_pool_capacity(md)
    keys = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
    images = OperatorImages(engine="e", gateway="g")
    return build_desired_children(
        md, capacity, [], admit_tenants(capacity, []), keys, images, draining=draining
    )


def test_while_draining_the_table_lists_the_replicas_that_stay_and_the_statefulset_runs_all() -> None:
    md = _qwen(1)
    steady = _children(md)
    drains = compute_drains(steady, [sts(3)], T0, GRACE)
    assert drains == {"qwen72b-engine": Drain(3, 1, T0)}
    children = _children(md, {n: (d.running, drain_annotation(d)) for n, d in drains.items()})
    (statefulset,) = [o for o in children if o["kind"] == "StatefulSet"]
    assert statefulset["spec"]["replicas"] == 3
    assert json.loads(statefulset["metadata"]["annotations"][ANNOTATION_DRAIN]) == {"serving": 1, "since": T0}
    (config_map,) = [o for o in children if o["kind"] == "ConfigMap"]
    table = json.loads(config_map["data"][TENANT_TABLE_KEY])
    assert [e.split(".")[0] for e in table["pools"]["shared"]["endpoints"]] == ["http://qwen72b-engine-0"]
    # Without a drain: the same table, and the StatefulSet at the desired replicas with no annotation.
    (plain,) = [o for o in steady if o["kind"] == "StatefulSet"]
    assert plain["spec"]["replicas"] == 1 and ANNOTATION_DRAIN not in plain["metadata"].get("annotations", {})
    (plain_map,) = [o for o in steady if o["kind"] == "ConfigMap"]
    assert plain_map["data"] == config_map["data"]
