"""Sticky admission (build/tenant_table.py: admit_tenants), as a property over random histories.

Threat: a tenant that is serving loses its admission, and its key starts getting 401, because another
tenant (an older one) raised its quota; or a tenant that asks for more loses what it had. Each history is
a random sequence of creates, quota edits (up and down), deletes and key breakages on one pool; after
every step admission runs as the reconcile runs it, with the statuses the previous step wrote (the
admitted quota in ``status.admittedQuota`` is admission's only memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator.api import Tenant, reasons
from kvfleet_operator.api.tenant import QuotaTerms
from kvfleet_operator.build.tenant_table import PoolCapacity, TenantDecision, admit_tenants
from kvfleet_runtime.kv.sizing import compute_blocks_for_share, compute_blocks_for_tokens

CAPACITY = PoolCapacity(
    block_size=16,
    hbm_blocks=1000,
    hbm_tokens=16_000,
    hbm_bytes=16_000_000,
    cpu_bytes=1000,
    nvme_bytes=1000,
    offload_bytes_per_token=100,
)
NAMES = ("a", "b", "c", "d", "e", "f")


@dataclass
class Quota:
    hbm: int | str
    cpu: int
    nvme: int
    burst: int

    def spec(self) -> dict[str, Any]:
        return {
            "kvQuota": {"hbm": self.hbm, "cpu": str(self.cpu), "nvme": str(self.nvme)},
            "burstLimit": f"{self.burst}%",
        }


@dataclass
class Held:
    """One tenant in the world: its spec, when it was created, and its status as last written."""

    created: int
    isolation: str
    quota: Quota
    admitted: dict[str, Any] | None = None
    key_broken: bool = False

    def tenant(self, name: str) -> Tenant:
        spec: dict[str, Any] = {"modelDeploymentRef": {"name": "m"}, "isolation": self.isolation}
        if self.isolation == "dedicated":
            spec["dedicated"] = {"gpuGroup": f"group-{name}"}
        spec |= self.quota.spec()
        doc: dict[str, Any] = {
            "metadata": {
                "name": name,
                "creationTimestamp": f"2026-01-01T00:{self.created // 60:02d}:{self.created % 60:02d}Z",
            },
            "spec": spec,
        }
        if self.admitted is not None:
            doc["status"] = {"admittedQuota": self.admitted}
        return Tenant.model_validate(doc)


@st.composite
def quotas(draw: st.DrawFn) -> Quota:
    burst = draw(st.integers(1, 100))
    if draw(st.booleans()):
        hbm: int | str = f"{draw(st.integers(0, burst))}%"
    else:  # tokens: may exceed the burst limit (only admission can tell)
        hbm = draw(st.integers(0, 16_000))
    return Quota(hbm=hbm, cpu=draw(st.integers(0, 700)), nvme=draw(st.integers(0, 700)), burst=burst)


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("create"),
            st.sampled_from(NAMES),
            st.sampled_from(("shared", "salted", "dedicated")),
            quotas(),
        ),
        st.tuples(st.just("edit"), st.sampled_from(NAMES), quotas()),
        st.tuples(st.just("delete"), st.sampled_from(NAMES)),
        st.tuples(st.just("break-key"), st.sampled_from(NAMES)),
        st.tuples(st.just("fix-key"), st.sampled_from(NAMES)),
    ),
    min_size=1,
    max_size=30,
)


@dataclass
class World:
    tenants: dict[str, Held] = field(default_factory=dict)
    clock: int = 0

    def step(self, op: tuple[Any, ...]) -> str | None:
        """Apply ``op``; returns the name of the tenant whose spec it edited (or created), if any."""
        kind, name = op[0], op[1]
        held = self.tenants.get(name)
        if kind == "create" and held is None:
            self.clock += 1
            self.tenants[name] = Held(created=self.clock, isolation=op[2], quota=op[3])
            return name
        if kind == "edit" and held is not None:
            held.quota = op[2]
            return name
        if kind == "delete":
            self.tenants.pop(name, None)
        if kind in ("break-key", "fix-key") and held is not None:
            held.key_broken = kind == "break-key"
        return None

    def admit(self) -> dict[str, TenantDecision]:
        """One reconcile's admission, then its status writes (what the next reconcile reads)."""
        serving = [h.tenant(n) for n, h in self.tenants.items() if not h.key_broken]
        refused = [h.tenant(n) for n, h in self.tenants.items() if h.key_broken]
        decisions = {d.name: d for d in admit_tenants(CAPACITY, serving, held=refused)}
        for name, held in self.tenants.items():
            if name in decisions:  # a key-refused tenant's status keeps its admitted quota
                terms = decisions[name].terms
                held.admitted = terms.model_dump(by_alias=True, mode="json") if terms else None
        return decisions


def _room(held: Held) -> int:
    """Shared-pool HBM blocks a tenant's admitted quota takes (a dedicated one has its own pool)."""
    if held.isolation == "dedicated" or held.admitted is None:
        return 0
    hbm = held.admitted["hbm"]
    if isinstance(hbm, int):
        return compute_blocks_for_tokens(hbm, CAPACITY.block_size)
    return compute_blocks_for_share(hbm, CAPACITY.hbm_blocks)


def _quota_numbers(d: TenantDecision) -> tuple[int, int, int, int]:
    assert d.quota is not None
    return (d.quota.hbm_blocks, d.quota.hbm_burst_blocks, d.quota.cpu_bytes, d.quota.nvme_bytes)


@settings(max_examples=500, deadline=None)
@given(OPS)
def test_admitted_tenants_keep_their_quota_until_their_own_edit(ops: list[tuple[Any, ...]]) -> None:
    world = World()
    before: dict[str, TenantDecision] = {}
    for op in ops:
        previously = {n: h.admitted for n, h in world.tenants.items()}
        touched = world.step(op)
        decisions = world.admit()

        # Never over capacity: the shared pool's guarantees add up; a dedicated pool holds one tenant.
        shared = [d for d in decisions.values() if d.admitted and d.pool == "shared"]
        totals = [sum(_quota_numbers(d)[i] for d in shared) for i in (0, 2, 3)]
        # ...and the room key-refused tenants keep counts too.
        kept = sum(_room(h) for h in world.tenants.values() if h.key_broken)
        assert totals[0] + kept <= CAPACITY.hbm_blocks
        for d in decisions.values():
            if d.admitted:
                hbm, burst, cpu, nvme = _quota_numbers(d)
                assert hbm <= burst and hbm <= CAPACITY.hbm_blocks
                assert cpu <= CAPACITY.cpu_bytes and nvme <= CAPACITY.nvme_bytes

        for name, decision in decisions.items():
            was = previously.get(name)
            if was is None:
                continue
            # Admitted before, still there: still admitted, whatever anyone else did.
            assert decision.admitted, (op, name, decision.message)
            assert decision.terms is not None
            now = decision.terms.model_dump(by_alias=True, mode="json")
            if name != touched:
                # Not its edit: the very same quota; or, once another tenant freed room, the raise it
                # asked for earlier and was refused (spec is the desired state: admission keeps trying).
                assert now == was or decision.terms == decision.requested, (op, name)
                if now == was and name in before and before[name].admitted:
                    assert _quota_numbers(decision) == _quota_numbers(before[name])
            elif decision.reason == reasons.QUOTA_CHANGE_REFUSED:
                assert now == was and decision.refused  # a refused change keeps the old quota
                assert decision.requested != decision.terms
            else:
                assert decision.reason == reasons.ADMITTED
                assert decision.terms == decision.requested  # its change was admitted
        before = decisions


def _tenant(name: str, created: int, hbm: str, admitted: str | None = None, burst: str = "80%") -> Tenant:
    doc: dict[str, Any] = {
        "metadata": {"name": name, "creationTimestamp": f"2026-01-01T00:00:{created:02d}Z"},
        "spec": {"modelDeploymentRef": {"name": "m"}, "kvQuota": {"hbm": hbm}, "burstLimit": burst},
    }
    if admitted is not None:
        doc["status"] = {"admittedQuota": {"hbm": admitted, "cpu": "0", "nvme": "0", "burstLimit": burst}}
    return Tenant.model_validate(doc)


def test_an_older_tenants_raise_cannot_evict_a_younger_serving_tenant() -> None:
    """A raise cannot evict by seniority: 'old' serves at 30%, 'young' at 50%; 'old' asks for 60%. Were
    admission recomputed first come, first served, 'young' would lose its place to 'old'."""
    decisions = admit_tenants(
        CAPACITY, [_tenant("old", 1, "60%", admitted="30%"), _tenant("young", 2, "50%", admitted="50%")]
    )
    old, young = decisions
    assert (
        young.admitted and young.reason == reasons.ADMITTED and young.quota and young.quota.hbm_blocks == 500
    )
    assert old.admitted and old.reason == reasons.QUOTA_CHANGE_REFUSED
    assert old.quota and old.quota.hbm_blocks == 300
    assert old.terms == QuotaTerms(hbm="30%", cpu="0", nvme="0", burst_limit="80%")
    assert old.refused and "HBM guarantees would total 1100 of 1000 blocks" in old.refused
    assert "keeps serving at its admitted quota (hbm 30%" in old.refused


def test_a_decrease_is_admitted_at_once_and_frees_room_in_the_same_reconcile() -> None:
    decisions = admit_tenants(
        CAPACITY,
        [
            _tenant("young", 2, "20%", admitted="50%"),
            _tenant("old", 1, "60%", admitted="30%"),
        ],
    )
    by_name = {d.name: d for d in decisions}
    assert [d.name for d in decisions] == ["old", "young"]  # creation order
    assert by_name["young"].terms is not None and by_name["young"].terms.hbm == "20%"
    assert by_name["old"].reason == reasons.ADMITTED and by_name["old"].terms is not None
    assert by_name["old"].terms.hbm == "60%"


def test_a_new_tenant_does_not_take_the_room_of_an_admitted_one() -> None:
    decisions = admit_tenants(
        CAPACITY, [_tenant("first", 1, "40%"), _tenant("second", 2, "70%", admitted="70%")]
    )
    first, second = decisions
    assert second.admitted
    assert not first.admitted and first.reason == reasons.QUOTA_EXCEEDS_CAPACITY
    assert "(700 already guaranteed to other tenants)" in first.message


def test_a_tenant_whose_key_is_refused_keeps_its_room() -> None:
    held = _tenant("held", 1, "70%", admitted="70%")
    decisions = admit_tenants(CAPACITY, [_tenant("new", 2, "40%")], held=[held])
    assert [d.name for d in decisions] == ["new"]
    assert not decisions[0].admitted
