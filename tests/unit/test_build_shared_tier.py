"""The shared KV tier (``spec.kvCache.shared``): the API, what the operator renders, the replicas' LMCache
arguments, and the tier server's store (salts, quotas, size, table changes). The server's RESP subset on a
real loopback socket: tests/loopback/test_shared_tier_server.py.

Two replicas sharing chunks through real LMCache servers and vLLM: tests/engine/test_shared_tier.py. Who
reaches the tier: tests/security/test_shared_tier_reachability.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.common import SHARED_TIER_METRICS_PORT, SHARED_TIER_PORT
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.shared_tier import SHARED_TIER_OVERHEAD
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.config import (
    LMCacheSettings,
    TenantEntry,
    TenantTable,
)
from kvfleet_runtime.engine.l1_governance import compute_l1_limits
from kvfleet_runtime.engine.launcher import ReplicaSite, build_lmcache_args, resolve_replica
from kvfleet_runtime.engine.shared_tier import SharedTierStore, salt_of_key
from shared_tier_builders import (
    CAPACITY,
    KEYS,
    salt_of,
    shared_tier_table,
    shared_tier_tenant,
    store_key,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")
GI = 1 << 30


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def render(shared: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The qwen72b example (a shared pool and the dedicated ``bank`` tenant) with ``spec.kvCache.shared``."""
    md_doc = _doc("modeldeployment-qwen72b.yaml", uid="uid-md")
    if shared is not None:
        md_doc["spec"]["kvCache"]["shared"] = shared
    md = ModelDeployment.model_validate(md_doc)
    tenants = [
        Tenant.model_validate(
            _doc(f"tenant-{name}.yaml", uid=f"uid-{name}", creationTimestamp=f"2026-01-01T00:00:0{i}Z")
        )
        for i, name in enumerate(("bank", "saas", "startup-a", "startup-b"))
    ]
    capacity = compute_pool_capacity(md)
    return build_desired_children(md, capacity, tenants, admit_tenants(capacity, tenants), KEYS, IMAGES)


def _named(children: list[dict[str, Any]], kind: str, suffix: str) -> list[dict[str, Any]]:
    return [c for c in children if c["kind"] == kind and c["metadata"]["name"].endswith(suffix)]


def _table(children: list[dict[str, Any]]) -> TenantTable:
    (config_map,) = [c for c in children if c["kind"] == "ConfigMap"]
    return TenantTable.model_validate_json(config_map["data"]["tenants.json"])


# --- API -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["0", "0Gi", 0])
def test_an_enabled_tier_without_size_is_refused(size: object) -> None:
    doc = _doc("modeldeployment-qwen72b.yaml")
    doc["spec"]["kvCache"]["shared"] = {"enabled": True, "size": size}
    with pytest.raises(ValidationError, match=r"shared\.size must be more than 0"):
        ModelDeployment.model_validate(doc)


def test_a_disabled_tier_is_accepted_and_builds_nothing() -> None:
    children = render({"enabled": False})
    assert not [c for c in children if c["metadata"]["name"].endswith("-shared-tier")]
    assert _table(children).pools["shared"].engine.lmcache.shared_host is None  # type: ignore[union-attr]


# --- rendering -------------------------------------------------------------------------------------------


def test_the_tier_is_one_restricted_server_sized_by_the_spec() -> None:
    children = render({"enabled": True, "size": "64Gi"})
    (deployment,) = _named(children, "Deployment", "-shared-tier")
    assert deployment["metadata"]["name"] == "qwen72b-shared-tier"
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["image"] == "engine:1"
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    memory = str(64 * GI + SHARED_TIER_OVERHEAD)
    assert container["resources"]["requests"]["memory"] == memory
    assert container["resources"]["limits"]["memory"] == memory
    command = container["command"]
    assert command[:3] == ["kvfleet", "engine", "shared-tier"]
    assert command[command.index("--size-bytes") + 1] == str(64 * GI)
    assert command[command.index("--pool") + 1] == "shared"
    assert command[command.index("--port") + 1] == str(SHARED_TIER_PORT)
    assert {p["containerPort"] for p in container["ports"]} == {SHARED_TIER_PORT, SHARED_TIER_METRICS_PORT}
    # It reads the same tenant table and key file as the engines (the salts and their quotas).
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "qwen72b-tenants"
    assert volumes["keys"]["secret"]["secretName"] == "qwen72b-keys"


def test_the_service_is_cluster_internal_on_the_kv_port_only() -> None:
    (service,) = _named(render({"enabled": True, "size": "64Gi"}), "Service", "-shared-tier")
    assert service["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in service["spec"]["ports"]] == [SHARED_TIER_PORT]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "shared-tier"


def test_the_network_policy_admits_the_shared_pools_engines_on_the_kv_port() -> None:
    (policy,) = _named(render({"enabled": True, "size": "64Gi"}), "NetworkPolicy", "-shared-tier")
    kv_rule, metrics_rule = policy["spec"]["ingress"]
    assert kv_rule["ports"] == [{"protocol": "TCP", "port": SHARED_TIER_PORT}]
    (peer,) = kv_rule["from"]
    assert set(peer) == {"podSelector"}, "same namespace only"
    assert peer["podSelector"]["matchLabels"]["kvfleet.io/pool"] == "shared"
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": SHARED_TIER_METRICS_PORT}]


def test_only_the_shared_pool_gets_the_tier_as_its_lmcache_backend() -> None:
    table = _table(render({"enabled": True, "size": "64Gi"}))
    shared = table.pools["shared"].engine
    assert shared is not None and shared.lmcache is not None
    assert shared.lmcache.shared_host == "qwen72b-shared-tier.llm.svc"
    assert shared.lmcache.shared_port == SHARED_TIER_PORT
    (dedicated,) = [p for name, p in table.pools.items() if name != "shared"]
    assert dedicated.engine is not None and dedicated.engine.lmcache is not None
    assert dedicated.engine.lmcache.shared_host is None, "a dedicated tenant shares nothing"


def test_the_replicas_lmcache_stores_to_the_tier_after_its_own_nvme() -> None:
    settings = LMCacheSettings(cpu_bytes=GI, nvme_path="/nvme", shared_host="tier.ns.svc")
    args = build_lmcache_args(settings, "127.0.0.1", "python")
    adapters = [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--l2-adapter"]
    assert [a["type"] for a in adapters] == ["fs", "resp"]
    assert adapters[1]["host"] == "tier.ns.svc" and adapters[1]["port"] == SHARED_TIER_PORT
    assert "eviction" not in adapters[1], "the tier enforces quotas itself, across replicas"
    plain = build_lmcache_args(LMCacheSettings(cpu_bytes=GI), "127.0.0.1", "python")
    assert "--l2-adapter" not in plain


# --- the server ------------------------------------------------------------------------------------------


def _store(*tenants: TenantEntry) -> SharedTierStore:
    return SharedTierStore(CAPACITY, compute_l1_limits(shared_tier_table(*tenants), KEYS, "shared", CAPACITY))


def test_the_salt_is_the_last_of_five_fields_and_unsalted_keys_have_none() -> None:
    assert salt_of_key(b"model@00000000@0@abcd@s4lt") == "s4lt"
    assert salt_of_key(b"model@00000000@0@abcd") == ""


def test_a_chunk_is_read_back_under_its_own_salt_only() -> None:
    store = _store(shared_tier_tenant("a", 10_000), shared_tier_tenant("b", 10_000))
    assert store.set(store_key(salt_of("a"), 1), b"x" * 100)
    assert store.get(store_key(salt_of("a"), 1)) == b"x" * 100
    assert store.exists(store_key(salt_of("a"), 1))
    # Same chunk hash, other salt: another key, nothing there.
    assert store.get(store_key(salt_of("b"), 1)) is None
    assert not store.exists(store_key(salt_of("b"), 1))


def test_a_salt_the_table_does_not_know_stores_nothing() -> None:
    store = _store(shared_tier_tenant("a", 10_000))
    assert not store.set(store_key("stranger", 1), b"x" * 100)
    assert not store.set(b"m@00000000@0@ab", b"x" * 100)  # unsalted
    assert store.stored_bytes == 0
    assert not store.exists(store_key("stranger", 1))


def test_a_salt_over_its_quota_loses_its_own_oldest_chunks_at_once() -> None:
    store = _store(shared_tier_tenant("q", 300), shared_tier_tenant("k", 10_000))
    store.set(store_key(salt_of("k"), 0), b"k" * 100)
    for n in range(10):
        store.set(store_key(salt_of("q"), n), b"q" * 100)
        assert store.governor.usage()[salt_of("q")].resident_bytes <= 300
    assert store.exists(store_key(salt_of("q"), 9)) and not store.exists(store_key(salt_of("q"), 0))
    assert store.exists(store_key(salt_of("k"), 0)), "another salt never pays for it"
    assert store.stored_bytes == 400


def test_a_full_tier_is_brought_back_under_its_size() -> None:
    store = _store(shared_tier_tenant("a", CAPACITY), shared_tier_tenant("b", CAPACITY))
    for n in range(30):
        store.set(store_key(salt_of("a" if n % 2 else "b"), n), b"z" * 10_000)
        assert store.stored_bytes <= CAPACITY
    assert store.stored_bytes >= CAPACITY * 0.5


def test_a_tenant_removed_from_the_table_loses_its_chunks_in_the_next_cycle() -> None:
    keep, gone = shared_tier_tenant("keep", 10_000), shared_tier_tenant("gone", 10_000)
    store = _store(keep, gone)
    store.set(store_key(salt_of("keep"), 1), b"k" * 10)
    store.set(store_key(salt_of("gone"), 1), b"g" * 10)
    store.set_limits(compute_l1_limits(shared_tier_table(keep), KEYS, "shared", CAPACITY))
    store.cycle()
    assert not store.exists(store_key(salt_of("gone"), 1)) and store.exists(store_key(salt_of("keep"), 1))
    assert not store.set(store_key(salt_of("gone"), 2), b"g")


@pytest.mark.parametrize("tiers", [{}, {"cpuSize": "0", "nvme": None}])
def test_the_launcher_gives_each_replica_the_rendered_tier_as_its_last_l2_adapter(
    tiers: dict[str, Any],
) -> None:
    """The contract end to end: the operator's table, resolved as ``kvfleet engine launch`` resolves it,
    gives the replica's LMCache the ``resp`` adapter to the tier; a pool without CPU or NVMe tier still
    runs an LMCache server (it is what talks to the tier)."""
    md_doc = _doc("modeldeployment-qwen72b.yaml", uid="uid-md")
    md_doc["spec"]["kvCache"].update({"shared": {"enabled": True, "size": "64Gi"}, **tiers})
    md_doc["spec"]["kvCache"] = {k: v for k, v in md_doc["spec"]["kvCache"].items() if v is not None}
    md = ModelDeployment.model_validate(md_doc)
    capacity = compute_pool_capacity(md)
    children = build_desired_children(md, capacity, [], [], KEYS, IMAGES)
    gpu_site = ReplicaSite(cpu_kv_cache_gib=None)  # as `launch --gpu`
    replica = resolve_replica(_table(children), "shared", gpu_site, nvme_dir="/nvme/replica-0")
    assert replica.engine.lmcache is not None
    args = build_lmcache_args(replica.engine.lmcache, "127.0.0.1", "python")
    adapters = [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--l2-adapter"]
    assert adapters[-1] == {
        "type": "resp",
        "host": "qwen72b-shared-tier.llm.svc",
        "port": 6557,
        "num_workers": 2,
    }
    assert [a["type"] for a in adapters] == (["fs", "resp"] if not tiers else ["resp"])
