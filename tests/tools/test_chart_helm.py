"""charts/kvfleet through helm, without a cluster: ``helm lint`` is clean, ``helm template`` refuses bad
values with the schema's message, and the rendered objects are as documented (Recreate, restricted
security context, probes, CRDs kept on uninstall, monitoring objects only with their API,
one dashboard ConfigMap per dashboard). RBAC rules: tests/tools/test_rbac_chart.py."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS

from components import missing_component
from kvfleet_operator.build.gateway_store import parse_gateway_store
from netpol_eval import ContainerPort, Namespace, Pod, allowed_ports

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
MONITORING = ("--api-versions", "monitoring.coreos.com/v1")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    path = find_binary("helm")
    if path is None:
        missing_component("helm", "hack/build-cluster.sh")
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=120, check=False)


def render(*args: str) -> list[dict[str, Any]]:
    done = helm("template", "kvfleet", str(CHART), "-n", "kvfleet-system", *args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def only(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


# --- helm lint / template ---------------------------------------------------------------------------------
def test_helm_lint_is_clean() -> None:
    # helm lint has no --api-versions: the monitoring objects are checked by test_monitoring_objects_*.
    for extra in ((), ("--set", "operator.watchNamespaces={a,b}"), ("--set", "crds.keep=false")):
        done = helm("lint", "--strict", str(CHART), *extra)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "operator.replica=1"), "additional properties 'replica' not allowed"),
        (("--set", "operator.replicas=-1"), "minimum"),
        (("--set-string", "operator.replicas=1"), "want integer"),
        (("--set", "crds.keep=maybe"), "want boolean"),
    ],
)
def test_helm_template_rejects_bad_values_with_the_schema_message(
    args: tuple[str, ...], message: str
) -> None:
    done = helm("template", "kvfleet", str(CHART), *args)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_default_render_objects() -> None:
    docs = render()
    kinds_rendered = sorted({d["kind"] for d in docs})
    assert kinds_rendered == [
        "ClusterRole",  # listing nodes only (rbac.readNodes, tests/unit/test_rbac.py)
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "Deployment",
        "NetworkPolicy",  # the operator's pods: probes, and metrics for the scrapers only
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == "kvfleet", doc["metadata"]["name"]


def test_monitoring_objects_only_with_their_api() -> None:
    names = {d["kind"] for d in render()}
    assert "ServiceMonitor" not in names and "PrometheusRule" not in names
    docs = render(*MONITORING)
    monitor = only(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    rule = only(docs, "PrometheusRule")
    shipped = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == shipped
    off = render(*MONITORING, "--set", "prometheusRule.enabled=false,metrics.serviceMonitor.enabled=false")
    assert not {"ServiceMonitor", "PrometheusRule"} & {d["kind"] for d in off}


def test_operator_deployment() -> None:
    deployment = only(render(), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2  # one leads, one stands by (tests/cluster/test_operator_ha.py)
    rolling = {"maxSurge": 1, "maxUnavailable": 0}  # the new pod stands by before the old one goes
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": rolling}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/kvfleet/kvfleet:0.1.0"
    assert container["args"] == [
        "operator",
        "--namespace=kvfleet-system",  # namespaced by default: the release namespace (see test_rbac.py)
        "--metrics-port=8081",
        "--probe-address=0.0.0.0:8080",
        "--leader-election-lease=kvfleet-leader",
    ]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "probe"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 8081, "probe": 8080}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    from_fields = [e for e in container["env"] if "valueFrom" in e]
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in from_fields}
    assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert env["KVFLEET_ENGINE_IMAGE"] == "ghcr.io/kvfleet/kvfleet-engine:0.1.0"
    assert env["KVFLEET_GATEWAY_IMAGE"] == "ghcr.io/kvfleet/kvfleet:0.1.0"
    assert env["KVFLEET_RESYNC_SECONDS"] == "30"
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "512Mi"},
    }


def test_the_shared_store_reaches_the_operator_only_when_it_has_a_url() -> None:
    """``gatewaySharedStore`` becomes ``KVFLEET_GATEWAY_SHARED_STORE`` (JSON the operator parses with
    ``build.gateway_store.parse_gateway_store``) with the release namespace, the Secrets that are named;
    nothing without a URL. A URL with credentials is refused by the schema."""

    def env(*args: str) -> dict[str, str]:
        (container,) = only(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container["env"] if "value" in e}

    assert "KVFLEET_GATEWAY_SHARED_STORE" not in env("--set", "gatewaySharedStore.passwordSecret.name=pw")
    value = env(
        "--set", "gatewaySharedStore.url=rediss://store.platform:6380/2",
        "--set", "gatewaySharedStore.passwordSecret.name=pw",
    )["KVFLEET_GATEWAY_SHARED_STORE"]  # fmt: skip
    ref = parse_gateway_store(value)
    assert ref is not None and ref.url == "rediss://store.platform:6380/2"
    assert ref.namespace == "kvfleet-system" and ref.ca_secret is None
    assert ref.password_secret is not None and (ref.password_secret.name, ref.password_secret.key) == (
        "pw",
        "password",
    )
    done = helm(
        "template", "kvfleet", str(CHART), "--set", "gatewaySharedStore.url=redis://u:secret@store:6379"
    )
    assert done.returncode != 0 and "gatewaySharedStore/url" in done.stderr


def test_the_release_can_install_its_own_shared_store() -> None:
    """``gatewaySharedStore.install``: one Valkey pod (restricted Pod Security, its password read from a
    config file in a Secret, never a command line), a Service, the operator pointed at it with that
    Secret (and allowed to read it by name), and a NetworkPolicy that admits kvfleet's gateway and Endpoint
    Picker pods of the watched namespaces and the operator, nobody else. A URL given beside it is ignored."""
    docs = render(
        "--set", "gatewaySharedStore.install.enabled=true",
        "--set", "gatewaySharedStore.url=redis://elsewhere:6379",
        "--set", "operator.watchNamespaces={team-a}",
    )  # fmt: skip
    secret = only(docs, "Secret", "kvfleet-gateway-store")
    password = base64.b64decode(secret["data"]["password"]).decode()
    conf = base64.b64decode(secret["data"]["valkey.conf"]).decode()
    assert len(password) >= 32 and f"requirepass {password}\n" in conf and "appendonly no" in conf
    store = only(docs, "Deployment", "kvfleet-gateway-store")
    pod = store["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert password not in json.dumps(store)
    assert container["command"] == ["valkey-server", "/etc/valkey/valkey.conf"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    service = only(docs, "Service", "kvfleet-gateway-store")
    assert service["spec"]["selector"] == store["spec"]["selector"]["matchLabels"]
    (op,) = only(docs, "Deployment", "kvfleet")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in op["env"] if "value" in e}
    ref = parse_gateway_store(env["KVFLEET_GATEWAY_SHARED_STORE"])
    assert ref is not None and ref.url == "redis://kvfleet-gateway-store.kvfleet-system.svc:6379/0"
    assert ref.password_secret is not None and ref.password_secret.name == "kvfleet-gateway-store"
    readable = [
        r
        for d in docs
        if d["kind"] == "Role"
        for r in d["rules"]
        if r.get("resources") == ["secrets"] and r["verbs"] == ["get"]
    ]
    assert ["kvfleet-gateway-store"] in [r.get("resourceNames") for r in readable]

    policy = only(docs, "NetworkPolicy", "kvfleet-gateway-store")
    store_pod = Pod(
        "kvfleet-system",
        "store-0",
        store["spec"]["template"]["metadata"]["labels"],
        (ContainerPort(6379, "resp"),),
    )
    spaces = [Namespace("kvfleet-system"), Namespace("team-a"), Namespace("team-b")]
    gateway = {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/component": "gateway"}
    operator = {
        "app.kubernetes.io/name": "kvfleet",
        "app.kubernetes.io/instance": "kvfleet",
        "app.kubernetes.io/component": "operator",
    }

    def reach(source: Pod) -> set[int]:
        return allowed_ports([policy], spaces, source, store_pod)

    assert reach(Pod("team-a", "gw", gateway)) == {6379}
    assert reach(Pod("team-a", "epp", {**gateway, "app.kubernetes.io/component": "epp"})) == {6379}
    assert reach(Pod("kvfleet-system", "op", operator)) == {6379}
    assert reach(Pod("team-b", "gw", gateway)) == set()  # a namespace the operator does not serve
    assert reach(Pod("team-a", "engine", {**gateway, "app.kubernetes.io/component": "engine"})) == set()
    assert reach(Pod("team-a", "curious")) == set()
    assert not [d for d in render() if d["metadata"]["name"] == "kvfleet-gateway-store"]


def test_operator_replicas_spread_and_a_disruption_budget_only_with_more_than_one() -> None:
    docs = render()
    pdb = only(docs, "PodDisruptionBudget")
    selector = only(docs, "Deployment")["spec"]["selector"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": selector}
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"] == selector
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    for args in (("--set", "operator.replicas=1"), ("--set", "operator.podDisruptionBudget.enabled=false")):
        assert not [d for d in render(*args) if d["kind"] == "PodDisruptionBudget"], args
    custom = render("--set", "operator.affinity.nodeAffinity.x=1")
    assert only(custom, "Deployment")["spec"]["template"]["spec"]["affinity"] == {"nodeAffinity": {"x": 1}}


def test_crds_are_templated_kept_on_uninstall_and_optional() -> None:
    crds = [d for d in render() if d["kind"] == "CustomResourceDefinition"]
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "modeldeployments.kvfleet.io",
        "tenants.kvfleet.io",
    ]
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        source = yaml.safe_load(
            (REPO / "crds" / f"kvfleet.io_{crd['spec']['names']['plural']}.yaml").read_text()
        )
        assert crd["spec"] == source["spec"]
    dropped = [d for d in render("--set", "crds.keep=false") if d["kind"] == "CustomResourceDefinition"]
    assert all("annotations" not in d["metadata"] for d in dropped) and len(dropped) == 2
    assert not [d for d in render("--set", "crds.install=false") if d["kind"] == "CustomResourceDefinition"]


def test_one_dashboard_configmap_per_dashboard_with_configurable_sidecar_label() -> None:
    docs = render(
        "--set",
        "dashboards.label=grafana_dash,dashboards.labelValue=yes,dashboards.folderAnnotation=k8s-folder,"
        "dashboards.folder=LLM,dashboards.namespace=monitoring",
    )
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == len(ALL_DASHBOARDS)
    uids = set()
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dash"] == "yes"
        assert cm["metadata"]["annotations"] == {"k8s-folder": "LLM"}
        assert cm["metadata"]["namespace"] == "monitoring"
        ((name, text),) = cm["data"].items()
        assert text == (REPO / "dashboards" / "json" / name).read_text().rstrip("\n")
        uids.add(json.loads(text)["uid"])
    assert uids == {spec.uid for spec in ALL_DASHBOARDS}
    assert not [d for d in render("--set", "dashboards.enabled=false") if d["kind"] == "ConfigMap"]


def test_the_operators_metrics_port_admits_the_scrapers_only() -> None:
    """A pod of another team's namespace (or of the operator's own) reaches an operator pod on the probe
    port only; the configured scrapers reach the metrics port too, and a narrower scraper selector narrows
    it."""

    def ports_for(policies: list[dict[str, Any]], source: Pod) -> set[int]:
        operator_pod = Pod(
            "kvfleet-system",
            "kvfleet-0",
            {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/instance": "kvfleet",
             "app.kubernetes.io/component": "operator"},
            (ContainerPort(8081, "metrics"), ContainerPort(8080, "probe")),
        )  # fmt: skip
        spaces = [Namespace("kvfleet-system"), Namespace("team-a"), Namespace("monitoring"), Namespace("obs")]
        return allowed_ports(policies, spaces, source, operator_pod)

    scraper = {"kvfleet.io/metrics-scraper": "true"}
    default = [only(render(), "NetworkPolicy", "kvfleet-operator")]
    assert ports_for(default, Pod("team-a", "curious")) == {8080}
    assert ports_for(default, Pod("team-a", "dressed-up", scraper)) == {8080}  # the label, not the namespace
    assert ports_for(default, Pod("kvfleet-system", "neighbour")) == {8080}
    assert ports_for(default, Pod("monitoring", "prometheus", scraper)) == {8080, 8081}
    custom = [
        only(
            render("--set", "metricsScrapers.namespaceSelector.matchLabels.team=obs",
                   "--set", "metricsScrapers.podSelector.matchLabels.app=prom"),
            "NetworkPolicy",
            "kvfleet-operator",
        )
    ]  # fmt: skip
    assert ports_for(custom, Pod("monitoring", "prometheus", scraper)) == {8080}
