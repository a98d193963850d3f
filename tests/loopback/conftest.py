"""The loopback tier: tests that start servers on 127.0.0.1, in this process or in a child, and nothing
beyond this machine.

What starts: the real gateway (``running_gateway``: its aiohttp server, the ``GuardedSite`` the CLI serves)
in front of ``FakeEngine`` upstreams (tests/gateway_support.py: the HTTP shape of vLLM's OpenAI server);
the engine pod's metrics and debug servers and a prometheus_client ``/metrics`` upstream; the shared KV
tier's RESP server; a local HTTP server the operator's capacity reader scrapes; and a short soak
(benchmarks/soak.py, the gateway on a fake upstream, as a child process). No cluster, no vLLM, no
provisioned component. Each test costs a server start (milliseconds) plus what it waits for: timeouts,
drains and slow clients make some take seconds; the soak about half a minute.
"""
