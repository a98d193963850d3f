"""Model sources and reported KV capacity, the pure parts: model sources in the API, the engine pod and
the launcher; the planner's reserve; vLLM's reported KV blocks. The download itself runs for real in
tests/engine/test_model_source.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from engine_fixtures import TINY_MODEL_DEPLOYMENT, load_manifest, render_engine
from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import DEFAULT_RESERVE_PER_GPU
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.engine import (
    GCS_CREDENTIALS_KEY,
    MODEL_CACHE_MOUNT,
    MODEL_CREDENTIALS_MOUNT,
    build_engine_statefulset,
)
from kvfleet_operator.build.model_deployment import OperatorImages, shared_workload
from kvfleet_operator.build.tenant_table import build_engine_settings, compute_pool_capacity
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import EngineSettings
from kvfleet_runtime.engine.cli import resolve_launch
from kvfleet_runtime.engine.launcher import (
    RUNAI_STREAMER_LOAD_FORMAT,
    EngineReplica,
    ReplicaSite,
    build_vllm_args,
    build_vllm_env,
    resolve_replica,
)
from kvfleet_runtime.engine.model_source import (
    FETCHED_MARKER,
    ModelFetchError,
    model_dir,
    read_fetched,
    require_fetched,
)
from kvfleet_runtime.kv.reported_capacity import parse_reported_blocks
from kvfleet_runtime.kv.sizing import DEFAULT_RESERVE_BYTES_PER_GPU

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "modeldeployment-qwen72b.yaml"
IMAGES = OperatorImages(engine="engine:1", gateway="gateway:1")


def _md(source: dict[str, Any], **pool: Any) -> ModelDeployment:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["uid"] = "md-uid"
    doc["spec"]["model"]["source"] = source
    doc["spec"]["pool"].update(pool)
    return ModelDeployment.model_validate(doc)


def _pod(md: ModelDeployment) -> dict[str, Any]:
    pod: dict[str, Any] = build_engine_statefulset(shared_workload(md, IMAGES))["spec"]["template"]["spec"]
    return pod


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == "engine")


# --- runtime: the cache layout and the launcher -----------------------------------------------------


def test_model_dir_gives_each_repo_and_revision_its_own_folder(tmp_path: Path) -> None:
    a = model_dir(tmp_path, "org/model", "release/v1")
    assert a.parent.parent == tmp_path / "huggingface"
    assert a != model_dir(tmp_path, "org/model", "release-v1")
    assert a != model_dir(tmp_path, "org-model", "release/v1")
    assert model_dir(tmp_path, "org/model", None) == model_dir(tmp_path, "org/model", "main")


def test_require_fetched_refuses_a_folder_without_its_marker(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "org/model", "main")
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")  # files, but the fetch never finished
    with pytest.raises(ModelFetchError, match="fetch-model"):
        require_fetched(tmp_path, "org/model", "main")
    (path / FETCHED_MARKER).write_text('{"repo": "org/model", "revision": "main", "commit": "abc"}')
    fetched = read_fetched(path)
    assert fetched is not None and fetched.commit == "abc"
    assert require_fetched(tmp_path, "org/model", "main").path == path


@pytest.mark.parametrize("uri", ["s3://bucket/llama", "gs://bucket/llama"])
def test_object_storage_streams_with_runai(uri: str) -> None:
    replica = EngineReplica(EngineSettings(model=uri), "m", 16, ReplicaSite(cpu_kv_cache_gib=None))
    args = build_vllm_args(replica)
    assert args[args.index("--load-format") + 1] == RUNAI_STREAMER_LOAD_FORMAT
    local = EngineReplica(EngineSettings(model="/models/llama"), "m", 16, ReplicaSite(cpu_kv_cache_gib=None))
    assert "--load-format" not in build_vllm_args(local)


def test_a_local_copy_drops_the_hub_revision() -> None:
    md = _md({"huggingFace": "Qwen/Qwen2.5-72B-Instruct"})
    from kvfleet_runtime.config import PoolEntry, TenantTable  # noqa: PLC0415 - local to this test

    engine = build_engine_settings(md)
    assert engine.revision == "main"  # the example pins spec.model.revision
    table = TenantTable(
        model_deployment="m",
        served_model_name="m",
        pool_salt_id="p",
        pools={"shared": PoolEntry(name="shared", block_size=16, hbm_blocks_per_replica=10, engine=engine)},
        tenants={},
    )
    gpu = ReplicaSite(cpu_kv_cache_gib=None)
    assert "--revision" in build_vllm_args(resolve_replica(table, "shared", gpu))
    local = resolve_replica(table, "shared", gpu, model="/model-cache/huggingface/x/main")
    assert "--revision" not in build_vllm_args(local)


# --- operator: the engine pod -------------------------------------------------------------------------


def test_hugging_face_is_fetched_by_an_init_container_into_an_emptydir() -> None:
    pod = _pod(_md({"huggingFace": "Qwen/Qwen2.5-72B-Instruct", "credentialsSecretRef": {"name": "hf"}}))
    (fetch,) = pod["initContainers"]
    assert fetch["command"][:3] == ["kvfleet", "engine", "fetch-model"]
    assert fetch["command"][-2:] == ["--model-cache", MODEL_CACHE_MOUNT]
    # Only the keys a download reads, by name: another key of the Secret (LD_PRELOAD) never comes in.
    assert "envFrom" not in fetch
    creds = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in fetch["env"] if "valueFrom" in e}
    assert creds == {k: {"name": "hf", "key": k, "optional": True} for k in ("HF_TOKEN", "HF_ENDPOINT")}
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    engine = _engine(pod)
    cmd = engine["command"]
    assert cmd[cmd.index("--model-cache") + 1] == MODEL_CACHE_MOUNT
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "model-cache")
    assert mount["readOnly"] is True
    # The token reaches only the step that downloads: the engine runs offline and never reads it.
    assert "envFrom" not in engine
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in engine["env"])


def test_a_cache_claim_is_shared_by_the_replicas() -> None:
    pod = _pod(_md({"huggingFace": "Qwen/Qwen2.5-72B-Instruct", "cacheClaimName": "models-rwx"}))
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx"}} in pod["volumes"]
    assert "envFrom" not in pod["initContainers"][0]


def test_s3_credentials_are_the_engines_environment() -> None:
    pod = _pod(_md({"uri": "s3://models/qwen", "credentialsSecretRef": {"name": "s3"}}))
    assert "initContainers" not in pod
    engine = _engine(pod)
    assert "envFrom" not in engine
    creds = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in engine["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert creds["AWS_ACCESS_KEY_ID"] == {"name": "s3", "key": "AWS_ACCESS_KEY_ID", "optional": True}
    assert set(creds) == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
    }
    assert "--model-cache" not in engine["command"]


def test_s3_credentials_are_env_and_win_over_the_templates_env_from() -> None:
    """Credentials are ``env`` (Kubernetes gives it precedence over ``envFrom``): a template's ConfigMap
    cannot replace them."""
    template = {"envFrom": [{"prefix": "TUNING_", "configMapRef": {"name": "tuning"}}]}
    pod = _pod(_md({"uri": "s3://models/qwen", "credentialsSecretRef": {"name": "s3"}}, podTemplate=template))
    engine = _engine(pod)
    assert engine["envFrom"] == [{"prefix": "TUNING_", "configMapRef": {"name": "tuning"}}]
    assert "AWS_ACCESS_KEY_ID" in {e["name"] for e in engine["env"]}


def test_gcs_credentials_are_a_mounted_key_file() -> None:
    pod = _pod(_md({"uri": "gs://models/qwen", "credentialsSecretRef": {"name": "gcs"}}))
    engine = _engine(pod)
    assert {"name": "model-credentials", "secret": {"secretName": "gcs"}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == f"{MODEL_CREDENTIALS_MOUNT}/{GCS_CREDENTIALS_KEY}"
    assert "envFrom" not in engine


def test_pvc_source_has_no_fetch() -> None:
    pod = _pod(_md({"pvc": {"claimName": "weights", "path": "/qwen"}}))
    assert "initContainers" not in pod
    assert "--model-cache" not in _engine(pod)["command"]


# --- API ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"uri": "https://example.com/qwen"}, "s3://bucket/path or gs://bucket/path"),
        ({"pvc": {"claimName": "w"}, "cacheClaimName": "c"}, "cacheClaimName"),
    ],
)
def test_api_refuses_sources_nothing_can_load(source: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _md(source)


# --- capacity -----------------------------------------------------------------------------------------


def test_reserve_per_gpu_moves_the_planned_blocks() -> None:
    source = {"huggingFace": "Qwen/Qwen2.5-72B-Instruct"}
    default = compute_pool_capacity(_md(source))
    assert _md(source).spec.pool.reserve_per_gpu == "2Gi"
    more = compute_pool_capacity(_md(source, reservePerGpu="6Gi"))
    assert more.hbm_blocks < default.hbm_blocks
    # 4 GiB more on each of the replica's GPUs is that many fewer bytes of KV cache.
    md = _md(source)
    gpus = md.spec.engine.tensor_parallel_size * md.spec.engine.pipeline_parallel_size
    assert default.hbm_bytes - more.hbm_bytes == pytest.approx(4 * 2**30 * gpus, rel=0.01)


VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="%s"} 1.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="1",num_gpu_blocks="%s"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_reported_blocks_come_from_cache_config_info() -> None:
    assert parse_reported_blocks(VLLM_METRICS % ("65536", "65536")) == 65536
    # Data-parallel cores: what every core holds.
    assert parse_reported_blocks(VLLM_METRICS % ("65536", "60000")) == 60000
    # Before the profiling run the label is None: no figure yet, not zero.
    assert parse_reported_blocks(VLLM_METRICS % ("None", "None")) is None
    assert parse_reported_blocks("") is None
    without = "".join(line + "\n" for line in VLLM_METRICS.splitlines() if "cache_config_info" not in line)
    assert parse_reported_blocks(without) is None


def test_the_pods_commands_fetch_and_launch_one_folder(tmp_path: Path) -> None:
    """The rendered engine command (``--model <repo> --model-cache /model-cache``) resolves, through the
    launcher's real flag parsing, to the folder ``fetch-model`` fills for the pool's repo and revision."""
    doc = load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid")
    doc["spec"]["model"]["source"] = {"huggingFace": "kvfleet/tiny-llama"}
    doc["spec"]["model"]["revision"] = "v1"
    rendered = render_engine(doc)
    argv = [str(tmp_path) if a == MODEL_CACHE_MOUNT else a for a in rendered.command[1:]]
    args = build_parser().parse_args(argv)
    with pytest.raises(ModelFetchError, match="fetch-model"):  # nothing fetched: no launch
        resolve_launch(args, rendered.table)
    folder = model_dir(tmp_path, "kvfleet/tiny-llama", "v1")
    folder.mkdir(parents=True)
    (folder / FETCHED_MARKER).write_text('{"repo": "kvfleet/tiny-llama", "revision": "v1", "commit": "c"}')
    _, replica = resolve_launch(args, rendered.table)
    vllm = build_vllm_args(replica)
    assert vllm[vllm.index("--model") + 1] == str(folder)
    assert "--revision" not in vllm
    assert build_vllm_env(replica, {})["HF_HUB_OFFLINE"] == "1"


def test_the_api_default_reserve_per_gpu_is_the_planners() -> None:
    assert parse_quantity(DEFAULT_RESERVE_PER_GPU) == DEFAULT_RESERVE_BYTES_PER_GPU
