"""hack/venv-cache.sh: a provisioned machine keeps the .venv of a checkout (bootstrap plus the engine, three
minutes to install) and links it into the next checkout at the same place, as long as nothing that decides
what goes in has changed. Run for real on a copy of the script in a stand-in checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[2]


def _checkout(root: Path) -> Path:
    """A stand-in checkout: the script, the files its key reads, and a complete .venv."""
    (root / "hack").mkdir(parents=True)
    shutil.copy(REPO / "hack" / "venv-cache.sh", root / "hack" / "venv-cache.sh")
    for name in ("bootstrap.sh", "install-engine.sh"):
        (root / "hack" / name).write_text(f"# {name}\n")
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    _venv(root / ".venv")
    return root


def _venv(venv: Path) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / "lib").mkdir()
    (venv / "lib" / "torch.py").write_text("big = True\n")
    (venv / ".kvfleet-installed").write_text("")
    (venv / ".kvfleet-engine-installed").write_text("torch=2.13.0\n")


def _run(root: Path, cache: Path, what: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "hack" / "venv-cache.sh"), what],
        check=False,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "KVFLEET_VENV_CACHE"}
        | {"KVFLEET_CACHE": str(cache)}
        | env,
        timeout=60,
    )


def test_a_new_checkout_at_the_same_place_gets_the_kept_venv_linked(tmp_path: Path) -> None:
    root, cache = _checkout(tmp_path / "repo"), tmp_path / "cache"
    saved = _run(root, cache, "save")
    assert saved.returncode == 0, saved.stderr
    [kept] = list((cache / "venvs").iterdir())
    assert f"venv-cache: .venv kept for the next checkout here ({kept})" in saved.stdout
    # The next clone: same place, no .venv.
    shutil.rmtree(root / ".venv")
    restored = _run(root, cache, "restore")
    assert restored.returncode == 0, restored.stderr
    assert f"==> .venv: the copy this machine saved ({kept}; hack/venv-cache.sh)" in restored.stdout
    torch = root / ".venv" / "lib" / "torch.py"
    assert torch.read_text() == "big = True\n"
    assert torch.stat().st_ino == (kept / "lib" / "torch.py").stat().st_ino  # linked, not copied
    # bootstrap's stamp is newer than this checkout's pyproject.toml, so bootstrap installs nothing.
    stamp = root / ".venv" / ".kvfleet-installed"
    assert stamp.stat().st_mtime >= (root / "pyproject.toml").stat().st_mtime
    # An existing .venv is never replaced.
    (root / ".venv" / "mine").write_text("")
    assert _run(root, cache, "restore").stdout == ""
    assert (root / ".venv" / "mine").exists()


def test_a_change_to_what_goes_in_misses_and_the_newest_copy_alone_is_kept(tmp_path: Path) -> None:
    root, cache = _checkout(tmp_path / "repo"), tmp_path / "cache"
    assert _run(root, cache, "save").returncode == 0
    [first] = list((cache / "venvs").iterdir())
    (root / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["numpy"]\n')
    shutil.rmtree(root / ".venv")
    assert _run(root, cache, "restore").stdout == ""
    assert not (root / ".venv").exists()  # bootstrap installs it, as on a new machine
    _venv(root / ".venv")
    assert _run(root, cache, "save").returncode == 0
    [second] = list((cache / "venvs").iterdir())
    assert second != first
    # Another place is another key: a checkout elsewhere does not get this one's .venv (its scripts
    # name this place).
    other = _checkout(tmp_path / "other")
    shutil.rmtree(other / ".venv")
    (other / "pyproject.toml").write_text((root / "pyproject.toml").read_text())
    assert _run(other, cache, "restore").stdout == ""
    assert not (other / ".venv").exists()


def test_an_incomplete_venv_is_not_kept_and_the_switch_turns_it_off(tmp_path: Path) -> None:
    root, cache = _checkout(tmp_path / "repo"), tmp_path / "cache"
    (root / ".venv" / ".kvfleet-engine-installed").unlink()
    refused = _run(root, cache, "save")
    assert refused.returncode == 1
    assert "venv-cache: .venv is not complete (bootstrap and the engine first)" in refused.stderr
    assert not (cache / "venvs").exists() or not any((cache / "venvs").iterdir())
    (root / ".venv" / ".kvfleet-engine-installed").write_text("torch=2.13.0\n")
    off = _run(root, cache, "save", KVFLEET_VENV_CACHE="0")
    assert off.returncode == 0 and off.stdout == ""
    assert not (cache / "venvs").exists()
