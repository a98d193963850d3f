"""The KV capacity an engine really has: the blocks vLLM allocated, read from its own metrics.

vLLM sizes its KV cache at start (from ``--gpu-memory-utilization`` on GPUs, ``VLLM_CPU_KVCACHE_SPACE`` on
its CPU build, or ``--num-gpu-blocks-override``) and exports the result as a label of an info gauge:
``vllm:cache_config_info{num_gpu_blocks="N", block_size="B", ...} 1`` (checked on vLLM 0.32; the figure is
``cache_config.num_gpu_blocks`` after the engine core's profiling run, the same one vLLM logs as "vllm
cache_config_info with initialization after num_gpu_blocks is: N"). The planner's estimate is what the
operator admits quotas against before any engine runs; this figure is the truth to compare it with.

It lives with the KV sizing math (not in ``engine/``) because the operator reads it too: it scrapes each
ready engine pod's metrics port, where the engine plugin re-exports vLLM's series, and admits quotas
against the figure once one is known (``kvfleet_operator.reconcile.capacity``). Pure: text in, figure out.
"""

from __future__ import annotations

import re

#: vLLM's info gauge for its CacheConfig (the ``vllm:`` prefix is part of the name in the exposition).
CACHE_CONFIG_INFO = "vllm:cache_config_info"

#: One sample of the info gauge, e.g. ``vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0``
#: (label values are Prometheus-quoted: ``\\``, ``\"`` and ``\n`` escapes, never a bare quote).
_SAMPLE = re.compile(re.escape(CACHE_CONFIG_INFO) + r'\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}')
_BLOCKS = re.compile(r'(?:^|,)\s*num_gpu_blocks="([^"]*)"')


def parse_reported_blocks(metrics_text: str) -> int | None:
    """The KV blocks vLLM allocated, from its ``/metrics`` text; ``None`` before it reports them (the
    label is empty or ``None`` until the profiling run is done) or when the series is absent.

    With several engine cores (data parallel) each reports its own figure; they are sized alike, so the
    smallest is returned (what every core can hold).

    A scan for the one series, not a full exposition parser: the KV core stays free of the metrics
    library (the ``runtime-cores-are-pure`` import contract), and an engine's page names every tenant and
    may be megabytes, which the operator reads on its event loop.
    """
    figures: list[int] = []
    for line in metrics_text.splitlines():
        if not line.startswith(CACHE_CONFIG_INFO + "{"):
            continue  # HELP/TYPE comments and every other series
        sample = _SAMPLE.match(line)
        blocks = _BLOCKS.search(sample.group(1)) if sample else None
        if blocks is not None and blocks.group(1).isdigit() and int(blocks.group(1)) > 0:
            figures.append(int(blocks.group(1)))
    return min(figures) if figures else None
