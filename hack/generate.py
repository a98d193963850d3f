#!/usr/bin/env python3
"""``make generate``: regenerate every generated file of the repository in one go.

    PYTHONPATH=dashboards .venv/bin/python hack/generate.py           # write what changed
    PYTHONPATH=dashboards .venv/bin/python hack/generate.py --check   # write nothing; exit 1 on drift

What is generated, and from what (edit the source, never the file):

| files | source |
|---|---|
| crds/*.yaml, docs/crd-reference.md | the pydantic models in operator/kvfleet_operator/api (``crdgen``) |
| charts/kvfleet/templates/crd-*.yaml | the same CRDs, templated for the chart (hack/chartgen.py) |
| charts/kvfleet/README.md | the chart's values.yaml comments and values.schema.json (hack/chartgen.py) |
| dashboards/json/*.json, dashboards/rules/kvfleet-alerts.yaml | dashboards/kvfleet_dashboards |
| charts/kvfleet/files/dashboards/*.json, charts/kvfleet/files/prometheus-rules.yaml | copies of those |

A file is drifted when it differs from what the sources generate, is missing, or is a leftover: a file in
a folder whose every file is generated (:data:`GENERATED_GLOBS`) that nothing generates any more. Writing
fixes all three (leftovers are deleted); ``--check`` names each and exits 1. tests/unit/test_generated.py
runs the check, so a commit that forgets to regenerate fails the unit tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import chartgen
from kvfleet_dashboards import outputs as dashboard_outputs

from kvfleet_operator.api import crdgen

REPO = Path(__file__).resolve().parents[1]
CRD_DIR = PurePosixPath("crds")
CRD_REFERENCE = PurePosixPath("docs/crd-reference.md")

#: Folders (as globs relative to the repository root) in which every file is generated.
GENERATED_GLOBS = (
    "crds/*.yaml",
    "charts/kvfleet/templates/crd-*.yaml",
    "dashboards/json/*.json",
    "charts/kvfleet/files/dashboards/*.json",
)


def build_all() -> dict[PurePosixPath, str]:
    """Every generated file, as {path relative to the repository root: content}. Pure and byte-stable."""
    crds = crdgen.build_crds()
    dashboards = dashboard_outputs.build_outputs()
    json_dir = dashboard_outputs.DASHBOARD_JSON_DIR
    dashboard_json = {path: text for path, text in dashboards.items() if path.parent == json_dir}
    out: dict[PurePosixPath, str] = {CRD_DIR / name: text for name, text in crds.items()}
    out[CRD_REFERENCE] = crdgen.build_crd_reference()
    out.update(chartgen.crd_templates(crds))
    out.update(chartgen.chart_readme())
    out.update(dashboards)
    out.update(chartgen.chart_copies(dashboard_json, dashboards[dashboard_outputs.RULES_FILE]))
    return out


@dataclass(frozen=True)
class Drift:
    path: PurePosixPath
    reason: Literal["differs", "missing", "leftover"]

    def __str__(self) -> str:
        return f"{self.reason}: {self.path}"


def find_drift(wanted: Mapping[PurePosixPath, str], root: Path) -> list[Drift]:
    """How the files under ``root`` differ from ``wanted``, sorted by path."""
    drift = [
        Drift(path, "missing" if not (root / path).is_file() else "differs")
        for path, text in wanted.items()
        if not (root / path).is_file() or (root / path).read_text() != text
    ]
    for pattern in GENERATED_GLOBS:
        for found in root.glob(pattern):
            path = PurePosixPath(found.relative_to(root).as_posix())
            if path not in wanted:
                drift.append(Drift(path, "leftover"))
    return sorted(drift, key=lambda d: str(d.path))


def generate(root: Path, check: bool) -> list[Drift]:
    """Find the drift under ``root``; unless ``check``, fix it (write, or delete leftovers). Returns it."""
    wanted = build_all()
    drift = find_drift(wanted, root)
    if not check:
        for item in drift:
            target = root / item.path
            if item.reason == "leftover":
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(wanted[item.path])
    return drift


def main(argv: Sequence[str] | None = None, root: Path = REPO) -> int:
    parser = argparse.ArgumentParser(prog="hack/generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each drifted file")
    args = parser.parse_args(argv)
    drift = generate(root, args.check)
    for item in drift:
        print(f"{item}" if args.check else f"fixed {item}", file=sys.stderr)
    if args.check and drift:
        print("generated files are stale: run `make generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
