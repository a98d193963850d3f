"""The real-node autoscaling benchmark's pure parts (``benchmarks/autoscaling_real_node.py``): the
ModelDeployment it applies is one the operator accepts and renders a premium-queue-only ScaledObject from,
and its reading of the observer's samples finds each step of a scale-out and a scale-in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from devcluster.realpods import build_example_documents

from kvfleet_operator.api.modeldeployment import ModelDeployment
from kvfleet_operator.api.tenant import Tenant
from kvfleet_operator.build.autoscaling import build_scaled_object, scaled_object_name
from kvfleet_operator.build.common import Owner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import autoscaling_real_node as bench  # a script, imported from its own folder

PROM = "http://127.0.0.1:9090"
URL_1 = f"http://{bench.SECOND}.{bench.ENGINE}.{bench.NS}.svc:8000"


def test_the_applied_model_deployment_scales_on_the_premium_queue_alone() -> None:
    docs = bench.bench_documents(build_example_documents(bench.NS), PROM, "700m")
    (md_doc,) = (d for d in docs if d["kind"] == "ModelDeployment")
    md = ModelDeployment.model_validate(md_doc)
    assert md.metadata["name"] == bench.MD and scaled_object_name(bench.MD) == bench.SCALED_OBJECT
    assert "replicas" not in md_doc["spec"]["pool"]  # the HPA owns it
    assert md.spec.gateway.engine_in_flight_per_replica == bench.IN_FLIGHT_PER_REPLICA
    assert md.spec.pool.pod_template.resources.requests == {"cpu": bench.ENGINE_CPU_REQUEST}
    assert md.spec.pool.pod_template.resources.limits == {"cpu": "700m"}
    assert (
        "limits" not in bench.bench_documents([md_doc], PROM)[0]["spec"]["pool"]["podTemplate"]["resources"]
    )
    owner = Owner(api_version="kvfleet.io/v1alpha1", kind="ModelDeployment", name=bench.MD, uid="u")
    so = build_scaled_object(bench.NS, bench.MD, md.spec.pool.autoscaling, owner)
    assert so is not None
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 2)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["name"] == "queue-premium" and trigger["metadata"]["threshold"] == "2"
    assert "advanced" not in so["spec"]  # what the benchmark patches in (no API field renders it)
    tenants = [Tenant.model_validate(d) for d in docs if d["kind"] == "Tenant"]
    premium = [t.metadata["name"] for t in tenants if t.spec.tier.value == "premium"]
    assert sorted(premium) == sorted(bench.TENANTS)


def test_metric_values_reads_labels_and_sums_what_matches() -> None:
    text = (
        "# HELP vllm:request_success_total x\n"
        'vllm:request_success_total{finished_reason="length",model_name="m"} 3.0\n'
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 2.0\n'
        "vllm:request_success_totally 9\n"
        f'kvfleet_gateway_replica_healthy{{pool="shared",replica="{URL_1}"}} 1.0\n'
        'kvfleet_gateway_engine_queue_depth{pool="shared",sla_tier="premium"} 4.0\n'
        'kvfleet_gateway_engine_queue_depth{pool="shared",sla_tier="basic"} 7.0\n'
        "kvfleet_gateway_config_reloads_total 5.0\n"
    )
    assert bench.metric_sum(text, bench.SERVED) == 5.0
    assert bench.metric_values(text, bench.REPLICA_HEALTHY) == [({"pool": "shared", "replica": URL_1}, 1.0)]
    assert bench.metric_sum(text, bench.QUEUE_DEPTH, sla_tier="premium") == 4.0
    assert bench.metric_sum(text, bench.RELOADS) == 5.0


def _sample(t: float, **kw: Any) -> bench.Sample:
    return bench.Sample(t=t, **kw)


def test_scale_out_and_scale_in_events_come_from_the_samples() -> None:
    one = {f"{bench.ENGINE}-0": "ready"}
    samples = [
        _sample(0, md_replicas=1, sts_replicas=1, endpoints=1, engines=one, gw_reloads=3),
        _sample(10, md_replicas=2, sts_replicas=1, endpoints=1, engines=one, gw_reloads=3),
        _sample(11, md_replicas=2, sts_replicas=2, endpoints=2, engines={**one, bench.SECOND: "starting"},
                gw_reloads=3),
        _sample(50, md_replicas=2, sts_replicas=2, endpoints=2, engines={**one, bench.SECOND: "starting"},
                gw_reloads=4, gw_healthy={URL_1: 0}),
        _sample(90, md_replicas=2, sts_replicas=2, endpoints=2, engines={**one, bench.SECOND: "ready"},
                gw_reloads=4, gw_healthy={URL_1: 1}, served={bench.SECOND: 0}),
        _sample(92, md_replicas=2, sts_replicas=2, endpoints=2, engines={**one, bench.SECOND: "ready"},
                gw_reloads=4, gw_healthy={URL_1: 1}, served={bench.SECOND: 2}),
        # the load goes down at 100
        _sample(140, md_replicas=1, sts_replicas=2, endpoints=1, engines={**one, bench.SECOND: "ready"},
                gw_reloads=4, served={bench.SECOND: 6}),
        _sample(170, md_replicas=1, sts_replicas=2, endpoints=1, engines={**one, bench.SECOND: "ready"},
                gw_reloads=5, served={bench.SECOND: 7}),
        _sample(175, md_replicas=1, sts_replicas=2, endpoints=1, engines={**one, bench.SECOND: "ready"},
                gw_reloads=5, served={bench.SECOND: 7}),
        _sample(245, md_replicas=1, sts_replicas=1, endpoints=1, engines={**one, bench.SECOND: "terminating"},
                gw_reloads=5),
        _sample(250, md_replicas=1, sts_replicas=1, endpoints=1, engines=one, gw_reloads=5),
    ]  # fmt: skip
    out = bench.scale_out_events(samples, 5)
    assert out == {
        "hpa": 10, "statefulset": 11, "pod_created": 11, "pod_ready": 90, "table": 11,
        "gateway_reloaded": 50, "gateway_healthy": 90, "serving": 92,
    }  # fmt: skip
    down = bench.scale_in_events(samples, 100)
    assert down == {
        "hpa": 140, "table": 140, "gateway_reloaded": 170, "last_answer_on_leaving": 170,
        "statefulset": 245, "pod_terminating": 245, "pod_gone": 250,
    }  # fmt: skip
    # Nothing seen: None, never a guess.
    assert bench.scale_out_events(samples[:2], 5)["serving"] is None
    assert bench.reload_after(samples, None) is None


def test_outcomes_fail_on_anything_but_an_answer_and_fall_in_the_phase_they_were_sent_in() -> None:
    ok = bench.Outcome(sent=1.0, done=2.0, tenant="premium", status=200)
    refused = bench.Outcome(sent=5.0, done=5.1, tenant="premium", status=503, error="no replica")
    reset = bench.Outcome(sent=9.0, done=9.5, tenant="premium-b", status=0, error="ServerDisconnectedError")
    assert [o.failed for o in (ok, refused, reset)] == [False, True, True]
    cycle = bench.Cycle(start=0, step=4, down=8, end=12, scale_out={}, scale_in={})
    assert bench.outcomes_between([ok, refused, reset], *cycle.phase("scale_out")) == [refused]
    assert bench.outcomes_between([ok, refused, reset], *cycle.phase("scale_in")) == [reset]
