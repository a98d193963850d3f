"""Every generated file is fresh (``make generate --check``), and the check catches each kind of drift.

The one list of generated files and their sources is hack/generate.py; the tests of what is *in* them
(structural CRDs, dashboards' PromQL, the chart's rendering) live beside their subject.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import generate
import pytest


def test_committed_generated_files_are_fresh() -> None:
    drift = generate.generate(generate.REPO, check=True)
    assert drift == [], f"run `make generate`; stale: {[str(d) for d in drift]}"


def test_generation_is_byte_stable() -> None:
    assert generate.build_all() == generate.build_all()


def test_everything_the_issue_names_is_generated() -> None:
    paths = {str(path) for path in generate.build_all()}
    for wanted in (
        "crds/kvfleet.io_modeldeployments.yaml",
        "crds/kvfleet.io_tenants.yaml",
        "charts/kvfleet/templates/crd-modeldeployments.yaml",
        "charts/kvfleet/templates/crd-tenants.yaml",
        "charts/kvfleet/README.md",
        "dashboards/json/fleet.json",
        "charts/kvfleet/files/dashboards/fleet.json",
        "dashboards/rules/kvfleet-alerts.yaml",
        "charts/kvfleet/files/prometheus-rules.yaml",
        "docs/crd-reference.md",
    ):
        assert wanted in paths


def test_the_chart_crds_are_the_generated_crds_templated() -> None:
    """The chart's CRD templates come from the same run as crds/: the CRD body is carried unchanged."""
    files = generate.build_all()
    for plural in ("modeldeployments", "tenants"):
        crd = files[PurePosixPath(f"crds/kvfleet.io_{plural}.yaml")]
        template = files[PurePosixPath(f"charts/kvfleet/templates/crd-{plural}.yaml")]
        assert crd.split("spec:\n", 1)[1] in template


def test_check_names_every_kind_of_drift_and_writing_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = generate.generate(tmp_path, check=False)
    assert {d.reason for d in written} == {"missing"}
    assert generate.main(["--check"], root=tmp_path) == 0

    (tmp_path / "docs/crd-reference.md").write_text("edited by hand\n")
    (tmp_path / "crds/kvfleet.io_tenants.yaml").unlink()
    (tmp_path / "dashboards/json/retired.json").write_text("{}\n")
    assert generate.main(["--check"], root=tmp_path) == 1
    err = capsys.readouterr().err
    assert "differs: docs/crd-reference.md" in err
    assert "missing: crds/kvfleet.io_tenants.yaml" in err
    assert "leftover: dashboards/json/retired.json" in err
    assert "make generate" in err
    # --check wrote nothing.
    assert (tmp_path / "docs/crd-reference.md").read_text() == "edited by hand\n"

    assert generate.main([], root=tmp_path) == 0
    assert generate.generate(tmp_path, check=True) == []
    assert not (tmp_path / "dashboards/json/retired.json").exists()
