"""spec.gateway.fairQueuing / engineInFlightPerReplica / queueTimeout reach the gateway's command line.

The rendered command is parsed by the gateway's own argument parser (``kvfleet_runtime.cli``), so the test
fails if the operator writes a flag or a value the gateway does not take the way it is meant. The invalid
values are rows of tests/invalid_manifests.py (replayed through pydantic, the CRD's CEL rules and, in
tests/cluster, a real API server); here: the pydantic messages a human reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from invalid_manifests import apply_patch, build_base_manifest
from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import FairQueuingOrder, GatewaySpec
from kvfleet_operator.build.common import KV_EVENTS_PORT, Owner
from kvfleet_operator.build.gateway import GatewayWorkload, build_gateway_deployment, gateway_engine_in_flight
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import KeyFile
from kvfleet_runtime.gateway.settings import from_flags

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
GATEWAY = GatewayWorkload(namespace="ns", model_deployment="m", owner=OWNER, replicas=2, image="gw:1")


def _gateway_args(deployment: dict[str, Any]) -> tuple[bool, int, float]:
    """What the gateway runs with, read by its own parser: (fair queuing on, in flight, queue timeout)."""
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "kvfleet"
    settings = from_flags(build_parser().parse_args(command[1:]))
    return settings.fair_queuing, settings.engine_in_flight_per_replica, settings.max_queue_wait_s


def test_unset_fields_render_no_flag_and_the_gateway_keeps_its_defaults() -> None:
    deployment = build_gateway_deployment(GATEWAY)
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert not {"--fair-queuing", "--engine-in-flight-per-replica", "--queue-timeout"} & set(command)
    assert _gateway_args(deployment) == (True, 256, 10.0)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            {
                "fair_queuing": FairQueuingOrder.FIFO,
                "engine_in_flight_per_replica": 8,
                "queue_timeout_s": 30.0,
            },
            (False, 4, 30.0),
            id="fifo-8-over-2-gateways",
        ),
        # 5 over 2 gateway replicas: 3 each (rounded up; the engine may get 6, never fewer than asked).
        pytest.param(
            {"fair_queuing": FairQueuingOrder.VTC, "engine_in_flight_per_replica": 5, "queue_timeout_s": 0.5},
            (True, 3, 0.5),
            id="vtc-5-rounded-up",
        ),
        pytest.param({"engine_in_flight_per_replica": 0}, (True, 0, 10.0), id="no-limit-stays-0"),
    ],
)
def test_set_fields_reach_the_gateway(fields: dict[str, Any], expected: tuple[bool, int, float]) -> None:
    assert _gateway_args(build_gateway_deployment(dataclasses.replace(GATEWAY, **fields))) == expected


@pytest.mark.parametrize(
    ("total", "gateways", "each"), [(8, 2, 4), (5, 2, 3), (3, 3, 1), (1, 1, 1), (0, 4, 0), (256, 1, 256)]
)
def test_engine_in_flight_is_split_over_the_gateway_replicas(total: int, gateways: int, each: int) -> None:
    assert gateway_engine_in_flight(total, gateways) == each
    if total:
        # Never less than asked for, and at most one more request per gateway replica.
        assert total <= each * gateways < total + gateways


def test_a_model_deployment_manifest_reaches_the_gateway_deployment() -> None:
    manifest = apply_patch(
        build_base_manifest("ModelDeployment"),
        {
            "spec.gateway": {
                "replicas": 2,
                "fairQueuing": "fifo",
                "engineInFlightPerReplica": 64,
                "queueTimeout": "1m30s",
            }
        },
    )
    md = ModelDeployment.model_validate(manifest)
    capacity = compute_pool_capacity(md)
    keys = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
    images = OperatorImages(engine="engine:1", gateway="gateway:1")
    children = build_desired_children(md, capacity, [], admit_tenants(capacity, []), keys, images, False)
    (deployment,) = [
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-gateway")
    ]
    assert _gateway_args(deployment) == (False, 32, 90.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"queueTimeout": "0s"}, "spec.gateway.queueTimeout must be longer than 0s and at most 10m"),
        ({"queueTimeout": "11m"}, "spec.gateway.queueTimeout must be longer than 0s and at most 10m"),
        ({"queueTimeout": "10"}, "is not a duration"),
        (
            {"replicas": 4, "engineInFlightPerReplica": 3},
            "spec.gateway.engineInFlightPerReplica must be 0 (no limit) or at least spec.gateway.replicas",
        ),
        ({"fairQueuing": "wfq"}, "'vtc' or 'fifo'"),
    ],
)
def test_invalid_values_are_refused_with_a_message_naming_the_field(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GatewaySpec.model_validate(spec)


def test_valid_edges_are_accepted() -> None:
    GatewaySpec.model_validate({"queueTimeout": "10m", "replicas": 4, "engineInFlightPerReplica": 4})
    GatewaySpec.model_validate({"replicas": 64, "engineInFlightPerReplica": 0, "queueTimeout": "1ms"})


@pytest.mark.parametrize(
    ("routing", "port"),
    [pytest.param(None, KV_EVENTS_PORT, id="unset-precise"), pytest.param("affinity", None, id="affinity")],
)
def test_spec_gateway_routing_decides_whether_the_front_doors_follow_the_kv_events(
    routing: str | None, port: int | None
) -> None:
    """spec.gateway.routing: precise (the default) gives the gateway and the Endpoint Picker the engines'
    KV events port; affinity gives them none, so they route by the salted prefix hash alone."""
    doc = build_base_manifest("ModelDeployment")
    gateway = doc["spec"].setdefault("gateway", {})
    gateway["dataPlane"] = "envoy"  # both front doors: Envoy's EPP and the gateway's flags
    if routing is not None:
        gateway["routing"] = routing
    md = ModelDeployment.model_validate(
        {**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "u"}}
    )
    capacity = compute_pool_capacity(md)
    children = build_desired_children(
        md, capacity, [], admit_tenants(capacity, []), KeyFile(salt_key_hex="ab" * 32, key_hashes={}),
        OperatorImages(engine="e:1", gateway="g:1"),
    )  # fmt: skip
    commands = [
        c["command"]
        for child in children
        if child["kind"] == "Deployment"
        for c in child["spec"]["template"]["spec"]["containers"]
        if c.get("command", [""])[0] == "kvfleet" and c["command"][1] in ("gateway", "epp", "envoy")
    ]
    assert sorted(command[1] for command in commands) == ["envoy", "epp"]
    for command in commands:
        assert from_flags(build_parser().parse_args(command[1:])).kv_events_port == port
