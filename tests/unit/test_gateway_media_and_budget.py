"""The pure rules behind issue 23's gateway holes 7 and 11: which media URLs a chat request may carry
(``rewrite.check_media_urls``), what vLLM is told to fetch (``launcher.build_vllm_args``/``_env``), and
which bound and how many sequences the token budget counts (``rewrite.parse_request``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_runtime.config import EngineSettings
from kvfleet_runtime.engine.launcher import (
    NO_MEDIA_HOST,
    EngineReplica,
    ReplicaSite,
    build_vllm_args,
    build_vllm_env,
)
from kvfleet_runtime.gateway.rewrite import BadRequest, Endpoint, check_media_urls, parse_request

ALLOWED = frozenset({"media.example"})


def _part(key: str, url: str) -> dict[str, Any]:
    return {"type": key, key: {"url": url}}


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://media.example.evil.test/x.png",
        "http://media.example@127.0.0.1/",
        "http://media.example\\@127.0.0.1/",
        "http://127.0.0.1/#media.example",
        "ftp://media.example/x.png",
        "file:///etc/passwd",
        "http://média.example/",
        "http://media.example /",
    ],
)
def test_a_media_url_off_the_allowed_hosts_is_refused_naming_its_field(url: str) -> None:
    for key in ("image_url", "audio_url", "video_url"):
        messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, _part(key, url)]}]
        with pytest.raises(BadRequest) as raised:
            check_media_urls(messages, ALLOWED)
        assert raised.value.param == f"messages[0].content[1].{key}"


def test_data_urls_and_allowed_hosts_pass_and_text_is_not_looked_at() -> None:
    ok = [
        {"role": "system", "content": "http://169.254.169.254/ in text is only text"},
        {"role": "user", "content": [_part("image_url", "DATA:image/png;base64,AAAA")]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://media.example/a.png"}]},
        {"role": "user", "content": [_part("video_url", "HTTPS://Media.Example/v.mp4")]},
    ]
    check_media_urls(ok, ALLOWED)
    with pytest.raises(BadRequest):  # no host allowed: only data: URLs
        check_media_urls(ok, frozenset())
    for bad in ({"image_url": 5}, {"image_url": {"url": None}}, {"audio_url": ["http://x"]}):
        with pytest.raises(BadRequest):
            check_media_urls([{"role": "user", "content": [bad]}], ALLOWED)


def test_the_engine_fetches_only_from_allowed_hosts_and_never_follows_a_redirect() -> None:
    replica = EngineReplica(EngineSettings(model="/m"), "m", 32)
    args = build_vllm_args(replica)
    i = args.index("--allowed-media-domains")
    assert args[i + 1 :][:1] == [NO_MEDIA_HOST] and NO_MEDIA_HOST.endswith(".invalid")
    allowed = EngineReplica(
        EngineSettings(model="/m"), "m", 32, ReplicaSite(allowed_media_domains=("a.example", "b.example"))
    )
    args = build_vllm_args(allowed)
    i = args.index("--allowed-media-domains")
    assert args[i + 1 : i + 3] == ["a.example", "b.example"]
    site_env = ReplicaSite(env={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"})
    env = build_vllm_env(EngineReplica(EngineSettings(model="/m"), "m", 32, site_env), {})
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_the_bound_counted_is_the_one_vllm_obeys() -> None:
    chat = parse_request(_chat(max_tokens=1, max_completion_tokens=30_000), Endpoint.CHAT, 64)
    assert (chat.max_tokens, chat.max_tokens_param) == (30_000, "max_completion_tokens")
    chat = parse_request(_chat(max_tokens=30_000, max_completion_tokens=1), Endpoint.CHAT, 64)
    assert chat.max_tokens == 1
    # Completions have no max_completion_tokens: vLLM reads max_tokens (else the gateway injects one).
    completion = parse_request(
        {"model": "m", "prompt": "x", "max_completion_tokens": 9}, Endpoint.COMPLETIONS, 64
    )
    assert completion.max_tokens is None


@pytest.mark.parametrize(
    ("prompt", "n", "sequences"),
    [("one", 1, 1), (["a", "b", "c"], 2, 6), ([1, 2, 3], 3, 3), ([[1, 2], [3]], 4, 8)],
)
def test_a_completions_batch_counts_n_sequences_for_every_prompt(prompt: Any, n: int, sequences: int) -> None:
    parsed = parse_request({"model": "m", "prompt": prompt, "n": n}, Endpoint.COMPLETIONS, 64)
    assert parsed.sequences == sequences
