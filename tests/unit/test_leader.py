"""The pure part of leader election (``kvfleet_operator.k8s.leader``): who may write, and when.

The shell (Lease reads and writes, the watchdog, hand-over on SIGTERM) runs against the real API server
in tests/cluster/test_operator_ha.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kvfleet_operator.k8s.leader import (
    Decision,
    LeaseRecord,
    LeaseTimings,
    Observation,
    build_lease,
    build_released,
    decide,
    leadership_lost,
    observe,
    user_agent,
)

TIMINGS = LeaseTimings(lease_duration=8, renew_deadline=5, retry_period=1)
AT = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def lease(holder: str, renew: str = "t1", transitions: int = 0, version: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": "kvfleet-leader", "namespace": "ns", "resourceVersion": version},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 8,
            "acquireTime": "t0",
            "renewTime": renew,
            "leaseTransitions": transitions,
        },
    }


def test_timings_must_leave_the_old_leader_time_to_stop() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaseTimings(lease_duration=5, renew_deadline=5, retry_period=1)
    with pytest.raises(ValueError):
        LeaseTimings(lease_duration=8, renew_deadline=1, retry_period=2)


def test_no_lease_is_created_and_a_held_one_is_waited_for_until_it_expires_unchanged() -> None:
    assert decide(observe(None, None, 0.0), "b", 0.0) is Decision.CREATE
    seen = observe(None, lease("a", renew="t1"), 100.0)
    assert decide(seen, "b", 107.9) is Decision.WAIT
    # The holder renewed (renewTime changed): the expiry clock starts again from when b saw it.
    renewed = observe(seen, lease("a", renew="t2", version="2"), 105.0)
    assert renewed.seen_at == 105.0
    assert decide(renewed, "b", 112.9) is Decision.WAIT
    assert decide(renewed, "b", 113.0) is Decision.TAKE_OVER
    # Unchanged record seen again: the clock keeps running from the first sight.
    again = observe(renewed, lease("a", renew="t2", version="2"), 110.0)
    assert again.seen_at == 105.0


def test_a_released_lease_is_taken_at_once_and_the_holder_renews() -> None:
    released = observe(None, lease(""), 50.0)
    assert decide(released, "b", 50.0) is Decision.TAKE_OVER
    mine = observe(None, lease("b"), 50.0)
    assert decide(mine, "b", 1000.0) is Decision.RENEW


def test_writes_carry_the_read_version_and_count_terms() -> None:
    seen = observe(None, lease("a", transitions=3, version="42"), 0.0)
    taken = build_lease("ns", "kvfleet-leader", "b", Decision.TAKE_OVER, seen, TIMINGS, AT)
    assert taken["metadata"]["resourceVersion"] == "42"  # a write in between makes this one conflict
    assert taken["spec"] == {
        "holderIdentity": "b",
        "leaseDurationSeconds": 8,
        "acquireTime": "2026-11-30T12:00:00.123456Z",
        "renewTime": "2026-11-30T12:00:00.123456Z",
        "leaseTransitions": 4,
    }
    mine = observe(None, lease("b", transitions=4, version="43"), 0.0)
    renewed = build_lease("ns", "kvfleet-leader", "b", Decision.RENEW, mine, TIMINGS, AT)
    assert renewed["spec"]["leaseTransitions"] == 4 and renewed["spec"]["acquireTime"] == "t0"
    created = build_lease("ns", "kvfleet-leader", "b", Decision.CREATE, observe(None, None, 0), TIMINGS, AT)
    assert "resourceVersion" not in created["metadata"] and created["spec"]["leaseTransitions"] == 0
    with pytest.raises(ValueError):
        build_lease("ns", "kvfleet-leader", "b", Decision.WAIT, seen, TIMINGS, AT)


def test_release_clears_the_holder_and_keeps_the_term_count() -> None:
    mine = observe(None, lease("b", transitions=4, version="43"), 0.0)
    released = build_released("ns", "kvfleet-leader", mine, AT)
    assert released["metadata"]["resourceVersion"] == "43"
    assert released["spec"]["holderIdentity"] == "" and released["spec"]["leaseTransitions"] == 4
    assert decide(observe(None, released, 1.0), "a", 1.0) is Decision.TAKE_OVER


def test_the_leader_stops_before_any_standby_may_start() -> None:
    """The leader's deadline counts from when it sent its last good renewal; a standby's wait from when it
    saw that renewal, which is later. So the leader has stopped for lease - deadline (3 s) before."""
    sent = 10.0
    assert not leadership_lost(sent, sent + 5.0, TIMINGS)
    assert leadership_lost(sent, sent + 5.01, TIMINGS)
    standby_saw = sent + 0.01
    first_take_over = standby_saw + 8
    assert leadership_lost(sent, first_take_over - 2.9, TIMINGS)


def test_observation_of_a_vanished_lease_is_a_change() -> None:
    seen = Observation(LeaseRecord("a", 8, 0), "1", 0.0)
    gone = observe(seen, None, 3.0)
    assert gone.record is None and gone.seen_at == 3.0 and decide(gone, "b", 3.0) is Decision.CREATE


def test_user_agents_name_the_replica() -> None:
    assert user_agent("kvfleet-7f9c-abcde") == "kvfleet-operator (kvfleet-7f9c-abcde)"
    assert user_agent("kvfleet-7f9c-abcde", via="kopf/1.45.2") == "kopf/1.45.2 (kvfleet-7f9c-abcde)"
