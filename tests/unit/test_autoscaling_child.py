"""The operator manages the shared pool's KEDA ScaledObject as an optional child (spec.pool.autoscaling):
built with the ModelDeployment's other children, withheld with ``AutoscalingUnavailable`` where the chart
grants no rights on scaledobjects (``rbac.keda``) or the cluster runs no KEDA, and listed only where it may
be managed. The chart side (rights, ``KVFLEET_EXPOSURE_KINDS``) is tests/tools/test_rbac_chart.py; real KEDA
scaling the ModelDeployment is tests/cluster/test_keda_autoscaling.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, reasons
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.status import WorkloadReadiness
from kvfleet_runtime.config import KeyFile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
NOW = "2026-12-01T00:00:00Z"
PROM = "http://prometheus-operated.monitoring:9090"
UP = WorkloadReadiness(wanted=1, ready=1)


def _qwen(autoscaling: dict[str, Any] | None = None) -> ModelDeployment:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "modeldeployment-qwen72b.yaml").read_text())
    doc["metadata"].update(uid="md-uid", generation=1)
    if autoscaling is not None:
        doc["spec"]["pool"]["autoscaling"] = autoscaling
    return ModelDeployment.model_validate(doc)


def _desired(md: ModelDeployment) -> list[dict[str, Any]]:
    capacity = compute_pool_capacity(md)
    return build_desired_children(md, capacity, [], admit_tenants(capacity, []), KEYS, IMAGES)


def test_the_scaled_object_is_a_child_only_when_autoscaling_is_enabled() -> None:
    assert not [o for o in _desired(_qwen()) if o["kind"] == "ScaledObject"]
    on = _desired(_qwen({"enabled": True, "prometheusAddress": PROM, "maxReplicas": 6}))
    (scaled,) = [o for o in on if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "qwen72b"
    assert scaled["spec"]["maxReplicaCount"] == 6
    assert scaled["metadata"]["ownerReferences"][0]["uid"] == "md-uid"
    assert kinds.kind_of(scaled) is kinds.SCALED_OBJECT  # planned and pruned like any child


@pytest.mark.parametrize(
    ("managed", "unserved", "says"),
    [
        pytest.param((), (), "install the chart with rbac.keda=true", id="no-rights"),
        pytest.param(
            (kinds.SCALED_OBJECT,),
            (kinds.SCALED_OBJECT,),
            "the cluster does not serve keda.sh/v1alpha1: install KEDA",
            id="no-keda",
        ),
    ],
)
def test_without_rights_or_keda_the_scaled_object_is_withheld_and_the_status_says_which(
    managed: tuple[kinds.Kind, ...], unserved: tuple[kinds.Kind, ...], says: str
) -> None:
    md = _qwen({"enabled": True, "prometheusAddress": PROM})
    desired = _desired(md)
    kept, withheld = steps.withhold_exposure(desired, managed, unserved)
    assert [o["kind"] for o in kept] == [o["kind"] for o in desired if o["kind"] != "ScaledObject"]
    why = withheld["ScaledObject"]
    assert why.startswith("spec.pool.autoscaling asks for a ScaledObject") and says in why, why
    assert "nothing scales the pool: spec.pool.replicas is what runs" in why
    status = st.compute_model_deployment_status(
        md, None, [], UP, UP, "http://x/v1", None, NOW, autoscaling_note=why
    )
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        reasons.AUTOSCALING_UNAVAILABLE,
        why,
    )
    assert ready["status"] == "True"  # the pool still serves, at spec.pool.replicas


def test_kept_where_managed_and_served_and_listed_only_where_managed() -> None:
    desired = _desired(_qwen({"enabled": True, "prometheusAddress": PROM}))
    kept, withheld = steps.withhold_exposure(desired, (kinds.SCALED_OBJECT,), ())
    assert "ScaledObject" in [o["kind"] for o in kept] and not withheld
    assert kinds.SCALED_OBJECT in steps.child_kinds(False, (kinds.SCALED_OBJECT,))
    assert kinds.SCALED_OBJECT not in steps.child_kinds(True, ())
    assert kinds.parse_exposure_kinds("ScaledObject") == (kinds.SCALED_OBJECT,)
