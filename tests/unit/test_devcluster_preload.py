"""``python -m devcluster preload-images`` (run by hack/provision.d/40-images.sh): what it needs is named
when it is missing, with exit status 1, before any containerd starts. The import itself runs for real in
every ``make test`` (the provisioning step fails the run if it fails) and its result is what the real node
tier's first start finds (tests/e2e/test_real_node.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from devcluster.__main__ import main
from devcluster.node import stale_refs

pytestmark = pytest.mark.unit


def _path_with(tmp_path: Path, tools: tuple[str, ...]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


def test_missing_tools_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, ("podman",)))
    assert main(["preload-images"]) == 1
    assert "preload-images: preloading the node's images needs: containerd, ctr" in capsys.readouterr().err


def test_no_images_built_yet_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, ("containerd", "ctr", "podman")))
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    assert main(["preload-images"]) == 1
    err = capsys.readouterr().err
    assert f"no images built yet ({tmp_path / 'cache' / 'images' / 'images.json'})" in err


def test_earlier_builds_of_the_imported_images_are_stale_and_nothing_else() -> None:
    """After an import the node's store keeps each image's current refs; an earlier content tag of the
    same repository goes, and so does nothing of another repository (the pause image, say)."""
    current = [
        ["ghcr.io/kvfleet/kvfleet-engine:0.1.0-bbb", "ghcr.io/kvfleet/kvfleet-engine:0.1.0"],
        ["ghcr.io/kvfleet/kvfleet:0.1.0-ccc", "ghcr.io/kvfleet/kvfleet:0.1.0"],
    ]
    present = [
        "ghcr.io/kvfleet/kvfleet-engine:0.1.0-aaa",
        "ghcr.io/kvfleet/kvfleet-engine:0.1.0-bbb",
        "ghcr.io/kvfleet/kvfleet-engine:0.1.0",
        "ghcr.io/kvfleet/kvfleet:0.1.0-ccc",
        "ghcr.io/kvfleet/kvfleet:0.1.0",
        "ghcr.io/kvfleet/kvfleet:0.0.9-ddd",
        "localhost/kvfleet/pause:1.0",
        "sha256:0123abcd",
    ]
    assert stale_refs(present, current) == [
        "ghcr.io/kvfleet/kvfleet-engine:0.1.0-aaa",
        "ghcr.io/kvfleet/kvfleet:0.0.9-ddd",
    ]
