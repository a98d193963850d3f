"""vLLM's model-class inspection, answered once per install instead of once per engine start.

Before it serves, vLLM inspects the model's architecture class (is it a text generator, does it support
LoRA, ...) in a fresh Python process that imports torch and vLLM again: 15 s on 2 idle cores, more on a
loaded node, on every start. It skips that when ``$VLLM_CACHE_ROOT/modelinfos/`` holds the answer for the
class: one JSON file per class, keyed by the hash of the class's source file (vLLM 0.32,
``vllm/model_executor/models/registry.py``; an answer for other source is ignored and inspected again).

Each engine start gets a fresh ``VLLM_CACHE_ROOT`` (``launcher.build_vllm_env``: starts must not share
state), so the answers live beside the install instead, in ``KEPT``: ``prime`` writes them where vLLM is
installed (the engine image's build, the development venv's provisioning) and ``seed`` copies them into a
start's cache. A missing or stale answer costs only the inspection it would have cost anyway.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: Where an install keeps its answers (``<prefix>/share/kvfleet/vllm-cache/modelinfos``): read-only in the
#: engine image (primed when it is built), written by ``hack/provision.d/20-engine.sh`` in the dev venv.
KEPT = Path(sys.prefix) / "share" / "kvfleet" / "vllm-cache" / "modelinfos"

#: The architectures primed: the tiny Llama's (the tests and the demo). Each costs an inspection (15 s) at
#: the image build and the venv's provisioning; any other class is inspected at each start as before.
ARCHITECTURES = ("LlamaForCausalLM",)


def seed(cache_root: Path, kept: Path | None = None) -> list[str]:
    """Copy the kept answers (``KEPT`` by default) into ``cache_root/modelinfos`` (one engine start's
    ``VLLM_CACHE_ROOT``), leaving any answer already there; the names copied."""
    kept = KEPT if kept is None else kept
    if not kept.is_dir():
        return []
    target = cache_root / "modelinfos"
    copied = []
    for source in sorted(kept.glob("*.json")):
        dest = target / source.name
        if dest.exists():
            continue
        try:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)  # with its time: vLLM writes a new file only for an answer it computed
        except OSError as exc:  # only time is lost: vLLM inspects the class itself
            log.warning("vLLM's kept answer %s not copied (%s); vLLM will inspect the class", source, exc)
            continue
        copied.append(source.name)
    return copied


def primed(architectures: Sequence[str] = ARCHITECTURES, kept: Path = KEPT) -> list[str]:
    """The ``architectures`` that have an answer in ``kept`` (vLLM names each file ``...-<class>.json``)."""
    return [arch for arch in architectures if any(kept.glob(f"*-{arch}.json"))]


def prime(architectures: Sequence[str] = ARCHITECTURES, kept: Path = KEPT) -> list[str]:
    """Have vLLM inspect each of ``architectures`` that ``kept`` has no answer for, writing its answer
    there; the architectures inspected. Raises ``RuntimeError`` when vLLM cannot inspect one."""
    todo = [arch for arch in architectures if arch not in primed(architectures, kept)]
    if todo:
        # vLLM reads VLLM_CACHE_ROOT when asked (vllm.envs): set here, before the import, it is enough.
        os.environ["VLLM_CACHE_ROOT"] = str(kept.parent)
        from vllm.model_executor.models.registry import ModelRegistry  # noqa: PLC0415 - after the env

        for arch in todo:
            # The registry's own inspect-and-cache step: the one vLLM runs at start (a private name in
            # vLLM 0.32; if a later vLLM renames it, priming fails loudly at the image build).
            if ModelRegistry._try_inspect_model_cls(arch) is None:
                raise RuntimeError(f"vLLM could not inspect {arch}")
        missing = [arch for arch in todo if arch not in primed(todo, kept)]
        if missing:
            raise RuntimeError(f"vLLM inspected {', '.join(missing)} but wrote no answer under {kept}")
    # vLLM writes its answers readable by their owner only; an engine runs as another user (10001).
    if kept.is_dir():
        for path in (kept, *kept.glob("*.json")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    return todo


if __name__ == "__main__":  # the engine image's build runs this file alone, before kvfleet is installed
    print("vLLM model classes inspected:", ", ".join(prime()) or "none (already primed)")
