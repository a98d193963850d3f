"""The gateway's metering registry: past the cap on tenant label values, tenants share one label and the
series stay bounded. The series over HTTP in front of a fake upstream:
tests/loopback/test_gateway_metering.py."""

from __future__ import annotations

from kvfleet_runtime.gateway import metrics as m


def test_tenants_past_the_cap_share_one_label() -> None:
    metrics = m.GatewayMetrics()
    names = [f"t{i}" for i in range(m.MAX_TENANT_LABELS + 2)]
    labels = [metrics.tenant_label(n) for n in names]
    assert labels[: m.MAX_TENANT_LABELS] == names[: m.MAX_TENANT_LABELS]
    assert labels[m.MAX_TENANT_LABELS :] == [m.OTHER_TENANTS, m.OTHER_TENANTS]
    assert metrics.tenant_label("t0") == "t0"  # a labelled tenant keeps its label
    assert metrics.tenant_label(m.UNAUTHENTICATED) == m.UNAUTHENTICATED  # fixed values are not tenants
    metrics.set_model_deployment("md")
    for n in names:
        metrics.count_response(n, 200)
    exposed = {
        s.labels["tenant"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == m.RESPONSES_TOTAL
    }
    assert len(exposed) == m.MAX_TENANT_LABELS + 1
    assert exposed[m.OTHER_TENANTS] == 2
