"""The Tenant's ``fairShareWeight``: validated, defaulted, and carried into the tenant table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.tenant_table import (
    PoolEndpoints,
    admit_tenants,
    build_tenant_table,
    compute_pool_capacity,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(path: Path, i: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["metadata"].update(uid=f"uid-{i}", creationTimestamp=f"2026-01-01T00:00:0{i}Z")
    return doc


def _tenant(**spec: Any) -> Tenant:
    return Tenant.model_validate(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": "t", "namespace": "ns"},
            "spec": {"modelDeploymentRef": {"name": "md"}, **spec},
        }
    )


def test_weight_defaults_to_one_and_is_validated() -> None:
    assert _tenant().spec.fair_share_weight == 1.0
    assert _tenant(fairShareWeight=2.5).spec.fair_share_weight == 2.5
    for bad in (0, -1, 0.001, 1001, "heavy"):
        with pytest.raises(ValidationError):
            _tenant(fairShareWeight=bad)


def test_weight_reaches_the_tenant_table() -> None:
    md = ModelDeployment.model_validate(
        yaml.safe_load((EXAMPLES / "local/modeldeployment-tiny.yaml").read_text())
    )
    files = sorted((EXAMPLES / "local").glob("tenant-*.yaml"))
    tenants = [Tenant.model_validate(_example(f, i)) for i, f in enumerate(files)]
    heavy = tenants[0].model_copy(
        update={"spec": tenants[0].spec.model_copy(update={"fair_share_weight": 4.0})}
    )
    tenants = [heavy, *tenants[1:]]
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    table = build_tenant_table(
        md, capacity, tenants, decisions, {"shared": PoolEndpoints(("http://e:8000",))}
    )
    name = str(heavy.metadata["name"])
    assert table.tenants[name].fair_share_weight == 4.0
    assert {t.fair_share_weight for n, t in table.tenants.items() if n != name} == {1.0}
