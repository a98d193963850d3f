"""The two-key rotation recipe of docs/operations.md ("Rotating an API key"), run as written.

Each step's code block is taken from the page and run with bash and the real kubectl against the real
API server; the operator's reconcile (in process, as every kopf handler calls it) stands for the resync
the page tells the reader to wait for. After each step the test checks what the page promises: the
fingerprints in the tenant's status and the key hashes in the key file the gateway loads.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest
from devcluster import BUILD_COMMAND, ControlPlane, missing_binaries

from components import missing_component
from kvfleet_runtime.config import hash_api_key
from operator_support import (
    REPO,
    converge,
    fingerprint,
    key_file,
    secret_value,
    tenant,
    tiny_namespace,
)

SECTION = "### Rotating an API key"
#: The line of step 1 that names the tenant; the test points it at its own namespace.
TARGET = "NS=llm TENANT=saas"


def recipe() -> list[str]:
    """The bash blocks of the rotation section, in order."""
    text = (REPO / "docs/operations.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.DOTALL)


def run_blocks(plane: ControlPlane, *blocks: str, env: dict[str, str] | None = None) -> str:
    """Run ``blocks`` as one bash script (so variables carry from one to the next); its stdout."""
    script = "set -euo pipefail\n" + "\n".join(blocks)
    done = subprocess.run(
        ["bash", "-c", script],
        env={**plane.env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{script}\n--- stderr:\n{done.stderr}"
    return done.stdout


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    if missing_binaries(("kubectl",)):
        missing_component("kubectl", BUILD_COMMAND)
    yield from tiny_namespace(api_cluster, "rotation", ("premium", "basic-a"))


def test_the_documented_two_key_rotation(api_cluster: ControlPlane, namespace: str) -> None:
    plane = api_cluster
    blocks = recipe()
    assert len(blocks) == 5, "the recipe has five steps"
    locate, rotate, check_both, drop_previous, check_one = blocks
    assert TARGET in locate
    locate = locate.replace(TARGET, f"NS={namespace} TENANT=basic-a")
    converge(plane, namespace, "tiny")  # basic-a is admitted and gets a generated key

    old = secret_value(plane, namespace, "basic-a-api-key")
    assert old is not None
    assert tenant(plane, namespace, "basic-a")["status"]["apiKeyFingerprints"] == {
        "current": fingerprint(old)
    }
    assert key_file(plane, namespace, "tiny").key_hashes["basic-a"] == [hash_api_key(old)]

    # Step 2: the new key is current, the old one previous; after the resync the gateway takes both.
    run_blocks(plane, locate, rotate)
    new = secret_value(plane, namespace, "basic-a-api-key")
    assert new is not None and new != old and new.startswith("kvf-") and len(new) == 68
    assert secret_value(plane, namespace, "basic-a-api-key", "api-key-previous") == old
    converge(plane, namespace, "tiny")
    assert key_file(plane, namespace, "tiny").key_hashes["basic-a"] == [hash_api_key(new), hash_api_key(old)]
    both = {"current": fingerprint(new), "previous": fingerprint(old)}
    assert tenant(plane, namespace, "basic-a")["status"]["apiKeyFingerprints"] == both

    # Step 3, as the reader runs it (NEW and OLD are still set in their shell): status and local agree.
    shown, computed = run_blocks(plane, locate, check_both, env={"NEW": new, "OLD": old}).splitlines()
    assert shown == f'{{"current":"{both["current"]}","previous":"{both["previous"]}"}}'
    assert computed == f"current {both['current']} previous {both['previous']}"

    # Steps 4 and 5: the old key goes; after the resync only the new one is accepted.
    run_blocks(plane, locate, drop_previous)
    assert secret_value(plane, namespace, "basic-a-api-key", "api-key-previous") is None
    converge(plane, namespace, "tiny")
    assert key_file(plane, namespace, "tiny").key_hashes["basic-a"] == [hash_api_key(new)]
    assert run_blocks(plane, locate, check_one).strip() == f'{{"current":"{fingerprint(new)}"}}'
    # The other tenant never noticed.
    premium = secret_value(plane, namespace, "premium-api-key")
    assert premium is not None
    assert key_file(plane, namespace, "tiny").key_hashes["premium"] == [hash_api_key(premium)]
