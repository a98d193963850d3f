"""The unit tier: tests that start nothing.

No subprocess (no helm, promtool, hack/ script or ``python -m``), no server (not even one in this process on
loopback), no soak, no cluster, no engine: pure functions, models, files under ``tmp_path`` and, where a
test needs vLLM's own code (its block pool, its metric definitions), an import of it. Each test costs
milliseconds; the tier runs in well under a minute, and `make unit` runs it with the two tiers below
(tools, loopback) without provisioning anything.

A test that needs to start something belongs elsewhere: a tool or script as a subprocess in tests/tools,
a server on loopback in tests/loopback, a control plane in tests/cluster, an engine in tests/engine.
"""
