from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.build.tenant_table import (
    PoolEndpoints,
    admit_tenants,
    build_tenant_table,
    compute_pool_capacity,
)
from kvfleet_runtime.config import Isolation

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(path: Path, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["metadata"].update(meta)
    return doc


def _tiny() -> ModelDeployment:
    return ModelDeployment.model_validate(_load(EXAMPLES / "local/modeldeployment-tiny.yaml", uid="md-uid"))


def _tenants() -> list[Tenant]:
    files = sorted((EXAMPLES / "local").glob("tenant-*.yaml"))
    return [
        Tenant.model_validate(_load(f, uid=f"uid-{i}", creationTimestamp=f"2026-01-01T00:00:0{i}Z"))
        for i, f in enumerate(files)
    ]


def test_tiny_cpu_pool_capacity_matches_vllm() -> None:
    # 1 GiB of VLLM_CPU_KVCACHE_SPACE at 512 B/token is 2,097,152 tokens (what vLLM reports), 65,536
    # blocks of 32 tokens.
    capacity = compute_pool_capacity(_tiny())
    assert (capacity.hbm_tokens, capacity.hbm_blocks, capacity.block_size) == (2_097_152, 65_536, 32)
    assert capacity.cpu_bytes == 256 * 2**20


def test_examples_are_admitted_and_rendered() -> None:
    md, tenants = _tiny(), _tenants()
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    assert all(d.admitted for d in decisions), [d.message for d in decisions]
    table = build_tenant_table(
        md, capacity, tenants, decisions, {"shared": PoolEndpoints(("http://e0:8000",))}
    )
    premium = table.tenants["premium"]
    assert premium.quota.hbm_blocks == int(0.4 * 65_536)
    assert premium.quota.hbm_burst_blocks == int(0.6 * 65_536)
    assert premium.priority < table.tenants["basic-a"].priority
    shared = [t for t in table.tenants.values() if t.isolation is Isolation.SHARED]
    assert {t.salt_id for t in shared} == {table.pool_salt_id}
    assert premium.salt_id != table.pool_salt_id
    assert table.pools["shared"].endpoints == ["http://e0:8000"]


def test_overcommit_rejects_the_later_tenant_with_numbers() -> None:
    md, tenants = _tiny(), _tenants()
    greedy = copy.deepcopy(tenants[-1].model_dump(by_alias=True, exclude_none=True))
    greedy["metadata"].update(name="greedy", creationTimestamp="2026-02-01T00:00:00Z")
    greedy["spec"].update(isolation="salted", kvQuota={"hbm": "70%"}, burstLimit="80%")
    decisions = admit_tenants(compute_pool_capacity(md), [*tenants, Tenant.model_validate(greedy)])
    by_name = {d.name: d for d in decisions}
    assert all(d.admitted for n, d in by_name.items() if n != "greedy")
    assert not by_name["greedy"].admitted
    assert by_name["greedy"].reason == reasons.QUOTA_EXCEEDS_CAPACITY
    assert "of 65536 blocks per replica" in by_name["greedy"].message


def test_from_config_is_gone_from_the_api_and_the_error_says_what_replaces_it() -> None:
    """fromConfig could never be sized (no config.json before an engine starts) and is no longer a field:
    set next to a preset it is an unknown field; set alone (an API server that pruned it leaves no
    architecture) the message names fromConfig and the command that prints the explicit fields."""
    doc = _load(EXAMPLES / "local/modeldeployment-tiny.yaml")
    doc["spec"]["model"]["architecture"]["fromConfig"] = True
    with pytest.raises(ValidationError, match=r"architecture\.fromConfig\n.*Extra inputs are not permitted"):
        ModelDeployment.model_validate(doc)
    doc["spec"]["model"]["architecture"] = {}
    with pytest.raises(ValidationError, match=r"fromConfig is no longer a field.*kvfleet plan --config-json"):
        ModelDeployment.model_validate(doc)
