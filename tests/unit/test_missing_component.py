"""`make test` cannot be green while a real component is missing: ``missing_component`` fails unless the
caller opted out explicitly (``KVFLEET_ALLOW_MISSING=1``, which `make unit` sets and `make test` does not),
and then skips with the same message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import components
from components import ALLOW_MISSING_ENV, allow_missing, missing_component

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({}, False),
        ({ALLOW_MISSING_ENV: "1"}, True),
        ({ALLOW_MISSING_ENV: "0"}, False),
        ({ALLOW_MISSING_ENV: ""}, False),
        ({ALLOW_MISSING_ENV: "yes"}, False),
        ({"CI": "true"}, False),
        ({"CI": ""}, False),
    ],
)
def test_only_an_explicit_opt_out_allows_a_missing_component(env: dict[str, str], allowed: bool) -> None:
    assert allow_missing(env) is allowed


@pytest.fixture
def no_record(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Keep this file's fake component out of the run's "missing real components" summary."""
    record: dict[str, str] = {}
    monkeypatch.setattr(components, "MISSING", record)
    return record


def test_a_missing_component_fails_naming_it_and_its_command(
    monkeypatch: pytest.MonkeyPatch, no_record: dict[str, str]
) -> None:
    monkeypatch.delenv(ALLOW_MISSING_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        missing_component("frobnicator", "hack/build-frobnicator.sh")
    assert "real component missing: frobnicator (provision it with: hack/build-frobnicator.sh)" in str(
        failed.value
    )
    assert f"{ALLOW_MISSING_ENV}=1" in str(failed.value)
    assert no_record == {"frobnicator": "hack/build-frobnicator.sh"}


def test_with_the_opt_out_it_skips_with_the_same_message(
    monkeypatch: pytest.MonkeyPatch, no_record: dict[str, str]
) -> None:
    monkeypatch.setenv(ALLOW_MISSING_ENV, "1")
    with pytest.raises(pytest.skip.Exception) as skipped:
        missing_component("frobnicator", "hack/build-frobnicator.sh")
    assert "real component missing: frobnicator (provision it with: hack/build-frobnicator.sh)" in str(
        skipped.value
    )


def _recipe(target: str) -> str:
    makefile = (REPO / "Makefile").read_text()
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert match, f"no make target {target}"
    return match.group(1)


def test_make_unit_opts_out_and_make_test_does_not() -> None:
    assert f"{ALLOW_MISSING_ENV}=1" in _recipe("unit")
    assert ALLOW_MISSING_ENV not in _recipe("test")
    sets_it = re.compile(rf"^\s*(export\s+)?{ALLOW_MISSING_ENV}=", re.MULTILINE)
    for script in ("test.sh", *(f"provision.d/{p.name}" for p in (REPO / "hack/provision.d").glob("*.sh"))):
        assert not sets_it.search((REPO / "hack" / script).read_text()), script
    # `make help` (the target comments) tells how to opt out.
    help_lines = [line for line in (REPO / "Makefile").read_text().splitlines() if "##" in line]
    assert any(ALLOW_MISSING_ENV in line for line in help_lines)
