"""The pure rules behind issue 23's gateway holes 7 and 11: which media URLs a chat request may carry
(``rewrite.check_media_urls``), what vLLM is told to fetch (``launcher.build_vllm_args``/``_env``), and
which bound and how many sequences the token budget counts (``rewrite.parse_request``)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_fixtures import EXAMPLES, TINY_MODEL_DEPLOYMENT, load_manifest
from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import EngineSettings, KeyFile, TenantTable, parse_media_hosts
from kvfleet_runtime.engine.cli import resolve_launch
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


def test_the_platforms_media_hosts_reach_the_gateway_and_every_engine_through_their_command_lines() -> None:
    """The chart's ``allowedMediaHosts`` (``KVFLEET_ALLOWED_MEDIA_HOSTS``) as the operator renders it: the
    gateway's and each engine's own command lines, parsed by the real ``kvfleet`` parser."""
    hosts = parse_media_hosts("Media.Example, cdn.example,media.example")
    assert hosts == ("cdn.example", "media.example")
    for bad in ("http://media.example", "media.example:443", "*.example", "media.example/x"):
        with pytest.raises(ValueError, match="not a host name"):
            parse_media_hosts(bad)
    md = ModelDeployment.model_validate(load_manifest(TINY_MODEL_DEPLOYMENT, uid="md-uid"))
    tenants = [
        Tenant.model_validate(load_manifest(p, uid=f"uid-{i}", creationTimestamp=f"2026-01-01T00:00:0{i}Z"))
        for i, p in enumerate(sorted((EXAMPLES / "local").glob("tenant-*.yaml")))
    ]
    capacity = compute_pool_capacity(md)
    keys = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
    images = OperatorImages(engine="e:1", gateway="g:1")
    decisions = admit_tenants(capacity, tenants)
    for media_hosts in ((), hosts):
        children = build_desired_children(
            md, capacity, tenants, decisions, keys, images, media_hosts=media_hosts
        )
        table = TenantTable.model_validate_json(
            next(c for c in children if c["kind"] == "ConfigMap")["data"]["tenants.json"]
        )
        gateway = next(
            c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "tiny-gateway"
        )
        command = gateway["spec"]["template"]["spec"]["containers"][0]["command"]
        assert build_parser().parse_args(command[1:]).allowed_media_domains == frozenset(media_hosts)
        engines = [c for c in children if c["kind"] == "StatefulSet"]
        assert engines
        for engine in engines:
            command = engine["spec"]["template"]["spec"]["containers"][0]["command"]
            _, replica = resolve_launch(build_parser().parse_args(command[1:]), table)
            assert replica.site.allowed_media_domains == media_hosts
            args = build_vllm_args(replica)
            i = args.index("--allowed-media-domains")
            assert args[i + 1 : i + 1 + max(1, len(media_hosts))] == list(media_hosts or (NO_MEDIA_HOST,))
