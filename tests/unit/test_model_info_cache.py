"""The install's answers about model classes, copied into each engine start's vLLM cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet_runtime.config import EngineSettings
from kvfleet_runtime.engine import model_info_cache
from kvfleet_runtime.engine.launcher import EngineReplica, build_vllm_env

LLAMA = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
QWEN = "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"


def _kept(tmp_path: Path) -> Path:
    kept = tmp_path / "install" / "modelinfos"
    kept.mkdir(parents=True)
    (kept / LLAMA).write_text('{"hash": "h1", "modelinfo": {}}')
    (kept / QWEN).write_text('{"hash": "h2", "modelinfo": {}}')
    (kept / "notes.txt").write_text("not an answer")
    os.utime(kept / LLAMA, ns=(1_000_000_000, 1_000_000_000))
    return kept


def test_seed_copies_every_answer_with_its_time(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    root = tmp_path / "start" / "vllm-cache"
    assert model_info_cache.seed(root, kept) == [LLAMA, QWEN]
    assert sorted(p.name for p in (root / "modelinfos").iterdir()) == [LLAMA, QWEN]
    copied = root / "modelinfos" / LLAMA
    assert copied.read_text() == '{"hash": "h1", "modelinfo": {}}'
    assert copied.stat().st_mtime_ns == 1_000_000_000  # a rewrite by vLLM would show as a new time


def test_seed_leaves_an_answer_the_start_already_has(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    root = tmp_path / "vllm-cache"
    (root / "modelinfos").mkdir(parents=True)
    (root / "modelinfos" / LLAMA).write_text("newer")
    assert model_info_cache.seed(root, kept) == [QWEN]
    assert (root / "modelinfos" / LLAMA).read_text() == "newer"


def test_an_answer_that_cannot_be_copied_costs_only_the_inspection(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    (kept / LLAMA).unlink()
    (kept / LLAMA).mkdir()  # unreadable as a file (as root, a mode would not stop the copy)
    root = tmp_path / "vllm-cache"
    assert model_info_cache.seed(root, kept) == [QWEN]  # the start goes on; vLLM inspects Llama itself


def test_without_kept_answers_nothing_is_seeded(tmp_path: Path) -> None:
    root = tmp_path / "vllm-cache"
    assert model_info_cache.seed(root, tmp_path / "missing") == []
    assert not (root / "modelinfos").exists()


def test_primed_names_the_architectures_with_an_answer(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    assert model_info_cache.primed(["LlamaForCausalLM", "MistralForCausalLM"], kept) == ["LlamaForCausalLM"]
    assert model_info_cache.primed(["LlamaForCausalLM"], tmp_path / "missing") == []
    # Nothing to inspect: prime returns at once, without importing vLLM, and makes the answers readable
    # by the engine's user (vLLM writes them 0600; the image's engine runs as 10001).
    (kept / LLAMA).chmod(0o600)
    assert model_info_cache.prime(["LlamaForCausalLM", "Qwen2ForCausalLM"], kept) == []
    assert (kept / LLAMA).stat().st_mode & 0o777 == 0o644


def test_each_vllm_start_gets_the_installs_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _kept(tmp_path)
    monkeypatch.setattr(model_info_cache, "KEPT", kept)
    replica = EngineReplica(EngineSettings(model="/m"), "m", 32)
    env = build_vllm_env(replica, {}, tmp_path / "start")
    assert (Path(env["VLLM_CACHE_ROOT"]) / "modelinfos" / LLAMA).is_file()
