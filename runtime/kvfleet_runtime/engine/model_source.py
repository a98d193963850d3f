"""Model weights into an engine pod: a Hugging Face snapshot fetched once into the pool's model cache.

``kvfleet engine fetch-model`` (the engine pod's init container) downloads the pool's model
(``EngineSettings.model`` is the repo id, ``revision`` the branch, tag or commit) with huggingface_hub's
``snapshot_download`` into ``model_dir(cache, repo, revision)`` on the model-cache volume. The engine
container's ``kvfleet engine launch --model-cache`` computes the same folder with the same function and
starts vLLM on it with ``HF_HUB_OFFLINE=1``: the hub is read before the engine starts, never by it.

The revision is pinned once: the fetch resolves it to a commit, downloads every file at that commit (a
branch moving mid-download cannot mix two commits) and records it in ``FETCHED_MARKER``. A folder with
a marker is complete and is never fetched again, so replicas that share the cache (a ReadWriteMany claim)
all serve the commit the first fetch resolved; an ``flock`` makes the others wait for that fetch instead
of downloading the same files.

huggingface_hub reads ``HF_TOKEN`` (the credentials Secret) and ``HF_ENDPOINT`` (a mirror) from the
environment; ``fetch_model`` also takes both explicitly.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

#: Written last into a fetched folder: its presence means every file of the commit is there.
FETCHED_MARKER = ".kvfleet-fetched.json"
#: The branch huggingface_hub resolves when no revision is given.
DEFAULT_REVISION = "main"


class ModelFetchError(RuntimeError):
    """The model could not be fetched; the message says why (bad token, unknown repo or revision, ...)."""


@dataclass(frozen=True)
class FetchedModel:
    """A complete local copy of one repo at one commit."""

    path: Path
    repo: str
    revision: str
    commit: str


def model_dir(cache: Path, repo: str, revision: str | None) -> Path:
    """The folder of ``repo`` at ``revision`` in the model cache (one rule for the fetch and the launch).

    Repo ids are ``org/name`` and revisions may hold ``/`` (branch names): both are quoted to one path
    segment each, so no two (repo, revision) pairs share a folder.
    """
    rev = revision or DEFAULT_REVISION
    return cache / "huggingface" / quote(repo, safe="") / quote(rev, safe="")


def read_fetched(path: Path) -> FetchedModel | None:
    """The fetched model in ``path``, or ``None`` when it has no (readable) marker: not fetched yet."""
    try:
        data = json.loads((path / FETCHED_MARKER).read_text())
        return FetchedModel(path, str(data["repo"]), str(data["revision"]), str(data["commit"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def require_fetched(cache: Path, repo: str, revision: str | None) -> FetchedModel:
    """The fetched copy the engine must load. Raises ``ModelFetchError`` when the fetch did not finish
    (the launcher never falls back to the hub: it runs offline)."""
    path = model_dir(cache, repo, revision)
    fetched = read_fetched(path)
    if fetched is None:
        raise ModelFetchError(
            f"{repo}@{revision or DEFAULT_REVISION} is not in the model cache ({path} has no "
            f"{FETCHED_MARKER}): run `kvfleet engine fetch-model` first (the engine pod's init container)"
        )
    return fetched


def fetch_model(
    repo: str,
    revision: str | None,
    cache: Path,
    *,
    token: str | None = None,
    endpoint: str | None = None,
) -> FetchedModel:
    """Download ``repo`` at ``revision`` into the cache unless a complete copy is there; return it.

    ``token`` and ``endpoint`` default to ``HF_TOKEN`` and ``HF_ENDPOINT``. Raises ``ModelFetchError``
    (unauthorised, unknown repo or revision, unreachable hub) with the hub's reason.
    """
    # Imported here: only the engine image has huggingface_hub (vLLM needs it); the CLI imports this module.
    from huggingface_hub import HfApi, snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError  # noqa: PLC0415

    dest = model_dir(cache, repo, revision)
    dest.parent.mkdir(parents=True, exist_ok=True)
    token = token or os.environ.get("HF_TOKEN") or None
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    lock_path = dest.parent / f".{dest.name}.lock"
    with lock_path.open("a") as lock:
        # Replicas sharing the cache wait for the one that fetches, then find its marker.
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = read_fetched(dest)
        if done is not None:
            return done
        partial = dest.parent / f".{dest.name}.partial"
        try:
            info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision)
            if not info.sha:
                raise ModelFetchError(f"the hub gave no commit for {repo}@{revision}")
            # Every file at the resolved commit, not at the branch (which may move while we download).
            snapshot_download(repo, revision=info.sha, local_dir=partial, token=token, endpoint=endpoint)
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            hint = " (check the token in the credentials Secret: HF_TOKEN)" if status in (401, 403) else ""
            raise ModelFetchError(f"cannot fetch {repo}@{revision or DEFAULT_REVISION}: {exc}{hint}") from exc
        except LocalEntryNotFoundError as exc:  # the hub was unreachable
            raise ModelFetchError(f"cannot reach the hub for {repo}: {exc}") from exc
        # huggingface_hub's own bookkeeping is no part of the model.
        shutil.rmtree(partial / ".cache", ignore_errors=True)
        fetched = FetchedModel(dest, repo, revision or DEFAULT_REVISION, info.sha)
        marker = {"repo": repo, "revision": fetched.revision, "commit": fetched.commit}
        (partial / FETCHED_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        if dest.exists():  # a fetch that died after its rename left no marker: replace it
            shutil.rmtree(dest)
        partial.rename(dest)
        return fetched


def is_streamable_uri(model: str) -> bool:
    """Whether vLLM loads ``model`` by streaming it from object storage (``--load-format runai_streamer``)."""
    return model.startswith(("s3://", "gs://"))
