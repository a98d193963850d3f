"""The shared pool's KEDA ScaledObject (operator/kvfleet_operator/build/autoscaling.py) and its API field
(``spec.pool.autoscaling``). tests/cluster/test_keda_autoscaling.py applies what this renders to real KEDA."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator.api.modeldeployment import (
    RULE_AUTOSCALING_BOUNDS,
    RULE_AUTOSCALING_PROMETHEUS,
    PoolAutoscaling,
)
from kvfleet_operator.build import autoscaling as build
from kvfleet_operator.build.common import Owner
from kvfleet_runtime.engine import metrics as engine_metrics
from kvfleet_runtime.gateway import metrics as gateway_metrics

OWNER = Owner(api_version="kvfleet.io/v1alpha1", kind="ModelDeployment", name="qwen", uid="u-1")
PROM = "http://prometheus-operated.monitoring:9090"


def render(**spec: Any) -> dict[str, Any]:
    scaling = PoolAutoscaling.model_validate({"enabled": True, "prometheusAddress": PROM, **spec})
    obj = build.build_scaled_object("team-a", "qwen", scaling, OWNER)
    assert obj is not None
    return obj


def triggers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in obj["spec"]["triggers"]}


def test_the_series_are_the_ones_the_runtime_exports() -> None:
    """The operator may not import the runtime's metrics modules (import contracts): its copies of the
    names must not drift from them."""
    assert build.GATEWAY_QUEUE_DEPTH == gateway_metrics.ENGINE_QUEUE_DEPTH
    assert build.GATEWAY_TTFT_SECONDS == gateway_metrics.TTFT_SECONDS
    assert build.SLA_TIER_LABEL == gateway_metrics.SLA_TIER_LABEL
    assert build.ENGINE_POOL_BLOCKS == engine_metrics.POOL_BLOCKS
    assert build.ENGINE_POOL_USED_BLOCKS == engine_metrics.POOL_USED_BLOCKS


def test_nothing_is_rendered_unless_autoscaling_is_enabled() -> None:
    assert build.build_scaled_object("ns", "qwen", PoolAutoscaling(), OWNER) is None
    off = PoolAutoscaling.model_validate({"enabled": False, "prometheusAddress": PROM})
    assert build.build_scaled_object("ns", "qwen", off, OWNER) is None


def test_the_scaled_object_drives_the_model_deployments_scale_subresource() -> None:
    obj = render(minReplicas=2, maxReplicas=6, pollingIntervalSeconds=5)
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert obj["metadata"]["name"] == "qwen-engine" and obj["metadata"]["namespace"] == "team-a"
    assert obj["metadata"]["ownerReferences"] == [OWNER.reference()]
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "name": "qwen",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (2, 6, 5)
    assert {t["metadata"]["serverAddress"] for t in spec["triggers"]} == {PROM}
    assert {t["type"] for t in spec["triggers"]} == {"prometheus"}


def test_each_tiers_queue_is_a_per_replica_target_on_this_pools_gateway() -> None:
    by_name = triggers(render(signals={"queuePerReplica": {"premium": 3, "standard": 5}}))
    premium = by_name["queue-premium"]
    assert premium["metricType"] == "AverageValue" and premium["metadata"]["threshold"] == "3"
    query = premium["metadata"]["query"]
    assert query == (
        'sum(kvfleet_gateway_engine_queue_depth{namespace="team-a",pod=~"(qwen-gateway|qwen-epp)-.+",'
        'pool="shared",sla_tier="premium"}) or vector(0)'
    )
    assert by_name["queue-standard"]["metadata"]["threshold"] == "5"
    assert 'sla_tier="standard"' in by_name["queue-standard"]["metadata"]["query"]


def test_best_effort_load_alone_asks_for_at_most_its_cap() -> None:
    by_name = triggers(render(minReplicas=1, maxReplicas=8, bestEffortMaxReplicas=3))
    basic = by_name["queue-basic"]
    # ceil(value / 8) <= 3 for any value once it is clamped at 3 replicas' worth of queue (24).
    assert basic["metadata"]["threshold"] == "8"
    assert basic["metadata"]["query"].startswith("clamp_max(sum(kvfleet_gateway_engine_queue_depth{")
    assert basic["metadata"]["query"].endswith(" or vector(0), 24)")
    # The guaranteed tiers are not clamped: they scale to maxReplicas.
    assert "clamp_max" not in by_name["queue-premium"]["metadata"]["query"]


def test_without_a_cap_above_the_floor_best_effort_load_asks_for_nothing() -> None:
    assert "queue-basic" not in triggers(render(minReplicas=2, maxReplicas=4))
    assert "queue-basic" not in triggers(render(minReplicas=2, maxReplicas=4, bestEffortMaxReplicas=2))


def test_a_zero_target_turns_a_signal_off() -> None:
    by_name = triggers(render(signals={"queuePerReplica": {"standard": 0}, "kvUsage": 0}))
    assert set(by_name) == {"queue-premium"}


def test_kv_use_and_ttft_grow_the_pool_in_proportion() -> None:
    by_name = triggers(render(signals={"kvUsage": 0.85, "ttft": {"tier": "premium", "p99Seconds": 0.5}}))
    kv = by_name["kv-usage"]
    assert kv["metricType"] == "Value" and kv["metadata"]["threshold"] == "0.85"
    engines = 'namespace="team-a",pod=~"qwen-engine-[0-9]+"'
    assert kv["metadata"]["query"] == (
        f"((sum(kvfleet_engine_kv_pool_used_blocks{{{engines}}}) / "
        f"sum(kvfleet_engine_kv_pool_blocks{{{engines}}})) > -1) or vector(0)"
    )
    ttft = by_name["ttft-premium"]
    assert ttft["metricType"] == "Value" and ttft["metadata"]["threshold"] == "0.5"
    assert (
        "histogram_quantile(0.99, sum by (le) (rate(kvfleet_gateway_time_to_first_token_seconds_bucket{"
        in (ttft["metadata"]["query"])
    )
    assert 'sla_tier="premium"}[2m]' in ttft["metadata"]["query"]
    # The defaults: kvUsage 0.9 on, no TTFT objective.
    defaults = triggers(render())
    assert defaults["kv-usage"]["metadata"]["threshold"] == "0.9" and "ttft-premium" not in defaults


def test_the_trigger_order_is_stable() -> None:
    """KEDA names the HPA's metrics by position (s0-prometheus, ...): the same spec, the same order."""
    obj = render(bestEffortMaxReplicas=2, signals={"ttft": {"p99Seconds": 1}})
    names = [t["name"] for t in obj["spec"]["triggers"]]
    assert names == ["queue-premium", "queue-standard", "queue-basic", "kv-usage", "ttft-premium"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, RULE_AUTOSCALING_BOUNDS.message),
        ({"minReplicas": 2, "maxReplicas": 4, "bestEffortMaxReplicas": 1}, RULE_AUTOSCALING_BOUNDS.message),
        ({"maxReplicas": 4, "bestEffortMaxReplicas": 5}, RULE_AUTOSCALING_BOUNDS.message),
        ({"enabled": True}, RULE_AUTOSCALING_PROMETHEUS.message),
    ],
)
def test_inconsistent_bounds_and_a_missing_prometheus_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message[:40])):
        PoolAutoscaling.model_validate(spec)


def test_only_http_prometheus_addresses_are_taken() -> None:
    with pytest.raises(ValidationError):
        PoolAutoscaling.model_validate({"enabled": True, "prometheusAddress": "prometheus:9090"})
