"""The gateway's settings are declared once (gateway/settings.py): each field with a flag is a
``kvfleet gateway`` flag of that name, parsed by its own parser, defaulting to the field's default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.gateway import settings as s
from kvfleet_runtime.gateway.settings import GatewaySettings, flags, from_flags

#: A value other than the default for each parser a flag uses, and what it parses to.
SAMPLES: dict[Any, tuple[str, Any]] = {
    Path: ("elsewhere.json", Path("elsewhere.json")),
    int: ("7", 7),
    float: ("7.5", 7.5),
    s.positive_int: ("7", 7),
    s.non_negative_int: ("0", 0),
    s.replica_count: ("3", 3),
    s.vtc_or_fifo: ("fifo", False),
    s.shared_store_url: ("rediss://store.kvfleet-system:6380/0", "rediss://store.kvfleet-system:6380/0"),
    s.sync_interval: ("0.1", 0.1),
    s.tcp_port: ("5558", 5558),
    s.positive_seconds: ("0.25", 0.25),
    str: ("ca.pem", "ca.pem"),
    s.host_list: ("Images.Example.COM,cdn.example.com", frozenset({"images.example.com", "cdn.example.com"})),
}
#: Settings only code sets (tests, benchmarks): no flag.
WITHOUT_FLAG = {"upstream_connections"}
REQUIRED = ["--config", "c.json", "--keys", "k.json"]


def parse(*argv: str) -> GatewaySettings:
    return from_flags(build_parser().parse_args(["gateway", *REQUIRED, *argv]))


def test_every_setting_but_the_code_only_ones_is_a_flag_of_its_own() -> None:
    declared = flags()
    assert set(declared) | WITHOUT_FLAG == {f.name for f in dataclasses.fields(GatewaySettings)}
    names = [flag.name for flag in declared.values()]
    assert len(set(names)) == len(names) and all(n.startswith("--") for n in names)


def test_without_flags_the_gateway_runs_with_the_declared_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_GATEWAY_REPLICAS", raising=False)
    assert parse() == GatewaySettings(config_path=Path("c.json"), keys_path=Path("k.json"))


@pytest.mark.parametrize("field", sorted(flags()))
def test_each_flag_sets_its_own_field_and_nothing_else(field: str) -> None:
    flag = flags()[field]
    text, value = SAMPLES[flag.parse]  # a new parser needs a sample here
    got = parse(flag.name, text)  # after REQUIRED: the last --config or --keys counts
    expected = dataclasses.replace(parse(), **{field: value})
    assert getattr(got, field) == value != getattr(parse(), field)
    assert got == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-connections", "0"], "wants a positive integer, got '0'"),
        (["--fair-queuing", "random"], "wants vtc or fifo, got 'random'"),
        (["--max-connections-per-source", "-1"], "wants an integer of 0 or more"),
        (["--allowed-media-domains", "http://x"], "--allowed-media-domains"),
        (["--shared-store", "http://store:6379"], "wants a redis://host:port"),
        (["--shared-store", "redis://:hunter2@store:6379"], "KVFLEET_SHARED_STORE_PASSWORD"),
        (["--shared-store-sync", "1"], "at most 0.25"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    err = capsys.readouterr().err
    assert argv[0] in err and message in err


def test_a_required_flag_missing_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--config", "c.json"])
    assert "--keys" in capsys.readouterr().err


def test_the_help_shows_every_flag_with_its_text() -> None:
    parser = argparse.ArgumentParser()
    s.add_flags(parser)
    text = parser.format_help()
    for flag in flags().values():
        assert flag.name in text
    assert "stream already started (default: 600)" in " ".join(text.split())  # from its field
