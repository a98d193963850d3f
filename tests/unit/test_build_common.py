"""Names, labels, owner references and security contexts every builder shares (build/common.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build import common
from kvfleet_operator.build.common import Owner, owner_of

OWNER = Owner(api_version="kvfleet.io/v1alpha1", kind="ModelDeployment", name="m", uid="u-1")


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        pytest.param("shared", "m-engine", id="shared-pool-keeps-the-short-name"),
        pytest.param("dedicated-bank", "m-dedicated-bank-engine", id="dedicated-pool-is-named-in-between"),
    ],
)
def test_engine_name(pool: str, expected: str) -> None:
    assert common.engine_name("m", pool) == expected


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        pytest.param(common.gateway_name, "m-gateway", id="gateway"),
        pytest.param(common.config_map_name, "m-tenants", id="tenant-table-config-map"),
        pytest.param(common.keys_secret_name, "m-keys", id="keys-secret"),
    ],
)
def test_child_names(fn: Any, expected: str) -> None:
    assert fn("m") == expected


@pytest.mark.parametrize(
    ("component", "pool", "expected"),
    [
        pytest.param(
            "gateway",
            None,
            {
                "app.kubernetes.io/name": "kvfleet",
                "app.kubernetes.io/instance": "m",
                "app.kubernetes.io/component": "gateway",
            },
            id="no-pool-label-without-a-pool",
        ),
        pytest.param(
            "engine",
            "shared",
            {
                "app.kubernetes.io/name": "kvfleet",
                "app.kubernetes.io/instance": "m",
                "app.kubernetes.io/component": "engine",
                "kvfleet.io/pool": "shared",
            },
            id="engine-selects-its-pool",
        ),
    ],
)
def test_selector_labels(component: str, pool: str | None, expected: dict[str, str]) -> None:
    assert common.selector_labels("m", component, pool) == expected


@pytest.mark.parametrize(("component", "pool"), [("gateway", None), ("engine", "dedicated-bank")])
def test_object_labels_are_the_selector_plus_what_the_operator_lists_children_by(
    component: str, pool: str | None
) -> None:
    labels = common.object_labels("m", component, pool)
    assert labels == {
        **common.selector_labels("m", component, pool),
        "app.kubernetes.io/managed-by": "kvfleet-operator",
        "kvfleet.io/model-deployment": "m",
    }
    # The owned selector finds every child by exactly those two labels.
    wanted = dict(term.split("=") for term in common.owned_selector("m").split(","))
    assert wanted.items() <= labels.items()


def test_owned_selector_does_not_find_another_model_deployments_children() -> None:
    wanted = dict(term.split("=") for term in common.owned_selector("m").split(","))
    assert not wanted.items() <= common.object_labels("other", "engine", "shared").items()


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param(
            ModelDeployment.model_construct(metadata={"name": "m", "uid": "u-1"}),
            Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "u-1"),
            id="model-deployment",
        ),
        pytest.param(
            Tenant.model_construct(metadata={"name": "bank", "uid": "u-2"}),
            Owner("kvfleet.io/v1alpha1", "Tenant", "bank", "u-2"),
            id="tenant",
        ),
        pytest.param(
            Tenant.model_construct(metadata={"name": "new"}),
            Owner("kvfleet.io/v1alpha1", "Tenant", "new", ""),
            id="no-uid-yet",
        ),
    ],
)
def test_owner_of(obj: ModelDeployment | Tenant, expected: Owner) -> None:
    assert owner_of(obj) == expected


def test_owner_reference_is_a_controller_that_blocks_owner_deletion() -> None:
    assert OWNER.reference() == {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "name": "m",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }


@pytest.mark.parametrize(
    ("annotations", "has_annotations"),
    [
        pytest.param(None, False, id="no-annotations-key-when-none"),
        pytest.param({}, False, id="no-annotations-key-when-empty"),
        pytest.param({"a": "b"}, True, id="annotations-kept"),
    ],
)
def test_metadata(annotations: dict[str, str] | None, has_annotations: bool) -> None:
    meta = common.metadata("x", "ns", {"l": "v"}, OWNER, annotations)
    assert (meta["name"], meta["namespace"], meta["labels"]) == ("x", "ns", {"l": "v"})
    assert meta["ownerReferences"] == [OWNER.reference()]
    assert ("annotations" in meta) is has_annotations


def test_security_contexts_meet_the_restricted_pod_security_level() -> None:
    container = common.restricted_container_security()
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["readOnlyRootFilesystem"] is True
    assert container["runAsNonRoot"] is True
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}
    pod = common.restricted_pod_security()
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] != 0 and pod["runAsGroup"] != 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize(("text", "encoded"), [("", ""), ("key", "a2V5"), ("é", "w6k=")])
def test_b64_is_what_the_api_server_stores_under_data(text: str, encoded: str) -> None:
    assert common.b64(text) == encoded
