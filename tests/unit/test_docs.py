"""The docs cannot rot: the README's two commands, every repo path and make target they name exists, and
every `kvfleet plan` command in them runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvfleet_runtime.cli import main

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "charts/kvfleet/README.md"]
TOP = "hack|tests|benchmarks|runtime|operator|charts|dashboards|examples|docs|images|crds"
PATH_RE = re.compile(rf"`((?:{TOP})/[A-Za-z0-9_./-]+?)(?:::[^`]*)?`")
#: A placeholder the reader replaces (e.g. ``--config-json path/to/model/config.json``): not runnable here.
PLACEHOLDER = "path/to/"
#: Every fenced block, with its language: a fence of another language (yaml, python) is no opener of the
#: prose after it.
CODE_BLOCK_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL_LANGUAGES = ("", "sh", "bash", "console")


def _commands(text: str) -> list[str]:
    """Shell commands in code blocks, with backslash continuations joined."""
    out = []
    for language, block in CODE_BLOCK_RE.findall(text):
        if language not in SHELL_LANGUAGES:
            continue
        out += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def test_readme_has_exactly_the_two_commands_and_ci_runs_the_second() -> None:
    commands = _commands((REPO / "README.md").read_text())
    assert commands == ["make demo", "make test"]
    ci = [
        line
        for line in (REPO / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set"))
    ]
    assert ci == ["make test"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repo_path_named_in_the_docs_exists(doc: Path) -> None:
    missing = [p for p in PATH_RE.findall(doc.read_text()) if not (REPO / p).exists()]
    assert missing == []


def test_every_make_target_named_in_the_docs_exists() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.MULTILINE))
    named = {t for doc in DOCS for t in re.findall(r"`make ([a-z-]+)`", doc.read_text())}
    assert named <= targets


def test_every_kvfleet_plan_command_in_the_docs_runs(capsys: pytest.CaptureFixture[str]) -> None:
    ran = 0
    for doc in DOCS:
        for command in _commands(doc.read_text()):
            argv = shlex.split(command)
            if (
                len(argv) > 1
                and argv[0].endswith("kvfleet")
                and argv[1] == "plan"
                and PLACEHOLDER not in command
            ):
                assert main(argv[1:]) == 0, f"{doc.name}: {command}"
                ran += 1
    assert ran >= 1
    assert "tokens" in capsys.readouterr().out
