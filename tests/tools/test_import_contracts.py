"""The import contracts ([tool.importlinter] in pyproject.toml) hold on the tree, and each one can fail.

Each violation is written into a copy of both packages under a temporary folder, which ``lint-imports``
then analyses in place of the installed (editable) packages, so the working tree is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = {"runtime": "kvfleet_runtime", "operator": "kvfleet_operator"}


def _lint_imports(cwd: Path, pythonpath: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_tree_keeps_every_contract() -> None:
    done = _lint_imports(REPO, [])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _copy_tree(tmp_path: Path) -> None:
    for folder, package in PACKAGES.items():
        shutil.copytree(
            REPO / folder / package,
            tmp_path / folder / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")


#: (importing module, module it imports, the contract that import breaks)
VIOLATIONS = [
    ("kvfleet_runtime.config", "kvfleet_operator.api", "runtime-independent-of-operator"),
    ("kvfleet_operator.k8s.kinds", "devcluster", "product-never-imports-dev-tooling"),
    ("kvfleet_operator.build.common", "kvfleet_runtime.engine.launcher", "operator-uses-config-and-sizing"),
    ("kvfleet_operator.api.units", "kvfleet_runtime.kv.sizing", "api-imports-nothing-of-ours"),
    ("kvfleet_operator.build.common", "kvfleet_operator.k8s.client", "operator-layers"),
    ("kvfleet_operator.reconcile.plan", "kvfleet_operator.handlers", "operator-layers"),
    ("kvfleet_operator.reconcile.status", "kopf", "operator-cores-are-pure"),
    ("kvfleet_runtime.kv.policy", "kvfleet_runtime.engine.attribution", "runtime-layers"),
    ("kvfleet_runtime.gateway.state", "kvfleet_runtime.engine.metrics", "runtime-layers"),
    ("kvfleet_runtime.kv.sizing", "prometheus_client", "runtime-cores-are-pure"),
]


def _module_file(root: Path, module: str) -> Path:
    folder = next(folder for folder, package in PACKAGES.items() if module.partition(".")[0] == package)
    return root / folder / (module.replace(".", "/") + ".py")


@pytest.mark.parametrize(("importer", "imported", "contract"), VIOLATIONS)
def test_a_violating_import_breaks_its_contract(
    tmp_path: Path, importer: str, imported: str, contract: str
) -> None:
    _copy_tree(tmp_path)
    pythonpath = [tmp_path / folder for folder in PACKAGES]
    # The copy as it is keeps the contract: the failure below is the added import's doing.
    kept = _lint_imports(tmp_path, pythonpath, "--contract", contract)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    target = _module_file(tmp_path, importer)
    target.write_text(target.read_text() + f"\nimport {imported}  # deliberate violation\n")
    broken = _lint_imports(tmp_path, pythonpath, "--contract", contract)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "1 broken" in broken.stdout
    # The report names the importing module, so a developer finds the line.
    assert importer in broken.stdout
