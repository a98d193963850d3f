"""How a test reacts to a real component that is absent (no tests here).

``missing_component`` fails the running test, naming the component and the command that provisions it, so
`make test` cannot be green while a real component is missing. A caller who wants to run without them says
so: ``KVFLEET_ALLOW_MISSING=1`` (what `make unit` sets) turns those failures into skips with the same
message. CI runs `make test` as it is (tests/unit/test_docs.py checks .ci/run), so CI never skips.

A module of its own, not tests/conftest.py: pytest imports every folder's conftest.py under the one name
``conftest``, so ``from conftest import ...`` would pick whichever was imported last.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NoReturn

import pytest

#: The explicit opt-out: set to exactly ``1``, tests whose real component is missing skip instead of failing.
ALLOW_MISSING_ENV = "KVFLEET_ALLOW_MISSING"

#: component -> the command that provisions it, for every component a test found missing (terminal summary).
MISSING: dict[str, str] = {}


def allow_missing(env: Mapping[str, str] = os.environ) -> bool:
    """True only when the caller opted out explicitly (``KVFLEET_ALLOW_MISSING=1``)."""
    return env.get(ALLOW_MISSING_ENV, "") == "1"


def missing_component(component: str, provide_with: str) -> NoReturn:
    """Fail (or, with the opt-out, skip) the running test: ``component`` is absent; ``provide_with``
    is the command that provisions it."""
    MISSING[component] = provide_with
    message = f"real component missing: {component} (provision it with: {provide_with})"
    if allow_missing():
        pytest.skip(f"{message}; skipped because {ALLOW_MISSING_ENV}=1")
    pytest.fail(f"{message}; {ALLOW_MISSING_ENV}=1 skips the tests that need it instead", pytrace=False)
