"""The gateways' shared store as the operator renders it (build/gateway_store.py): the chart's value
parsed strictly, the flags and the password's ``secretKeyRef`` on the gateway and Endpoint Picker
containers, the copies in the ModelDeployment's keys Secret, and a Secret that lacks what it should
stopping the start-up with a message naming it."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pydantic
import pytest

from kvfleet_operator.build.common import KEYS_DIR, Owner
from kvfleet_operator.build.endpoint_picker import build_epp_deployment
from kvfleet_operator.build.gateway import GatewayWorkload, build_gateway_deployment
from kvfleet_operator.build.gateway_store import (
    CA_DATA_KEY,
    PASSWORD_DATA_KEY,
    GatewayStore,
    SecretKeyRef,
    gateway_store_secret_data,
    parse_gateway_store,
    read_secret_key,
)
from kvfleet_runtime.gateway.settings import shared_store_url, sync_interval

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
GATEWAY = GatewayWorkload(namespace="ns", model_deployment="m", owner=OWNER, replicas=2, image="gw:1")
STORE = GatewayStore("rediss://store.platform:6380/0", password="s3cret-pass", ca_pem="-----BEGIN CERT")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_without_a_store_nothing_is_rendered() -> None:
    container = _container(build_gateway_deployment(GATEWAY))
    assert "--shared-store" not in container["command"] and "env" not in container
    assert gateway_store_secret_data(None) == {}


@pytest.mark.parametrize("build", [build_gateway_deployment, build_epp_deployment], ids=["gateway", "epp"])
def test_the_pipelines_containers_get_the_url_the_ca_file_and_the_password_from_the_keys_secret(
    build: Any,
) -> None:
    container = _container(build(dataclasses.replace(GATEWAY, shared_store=STORE)))
    command = container["command"]
    assert _flag(command, "--shared-store") == STORE.url
    assert _flag(command, "--shared-store-ca") == f"{KEYS_DIR}/{CA_DATA_KEY}"
    # What the runtime's own parsers accept (the flag is the gateway's; the operator renders it).
    assert shared_store_url(STORE.url) == STORE.url and sync_interval("0.2") == 0.2
    assert container["env"] == [
        {
            "name": "KVFLEET_SHARED_STORE_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "m-keys", "key": PASSWORD_DATA_KEY}},
        }
    ]
    assert STORE.password not in str(command)  # never on the command line


def test_the_keys_secret_carries_the_password_and_the_ca() -> None:
    data = gateway_store_secret_data(STORE)
    assert base64.b64decode(data[PASSWORD_DATA_KEY]).decode() == STORE.password
    assert base64.b64decode(data[CA_DATA_KEY]).decode() == STORE.ca_pem
    assert gateway_store_secret_data(GatewayStore("redis://s:6379")) == {}


def test_the_charts_value_parses_and_bad_values_are_refused_naming_the_field() -> None:
    ref = parse_gateway_store(
        '{"url": "redis://store:6379", "namespace": "kvfleet-system",'
        ' "passwordSecret": {"name": "pw", "key": "password"}}'
    )
    assert ref is not None and ref.password_secret == SecretKeyRef(name="pw", key="password")
    assert parse_gateway_store("") is None and parse_gateway_store(None) is None
    for text, message in (
        ('{"url": "http://store", "namespace": "n"}', "wants redis://host:port"),
        ('{"url": "redis://u:pw@store:6379", "namespace": "n"}', "carries credentials"),
        ('{"url": "redis://store:6379"}', "namespace"),
        ('{"url": "redis://store:6379", "namespace": "n", "password": "x"}', "password"),
    ):
        with pytest.raises(pydantic.ValidationError, match=message):
            parse_gateway_store(text)


def test_a_secret_that_lacks_the_password_names_what_is_missing() -> None:
    ref = SecretKeyRef(name="pw", key="password")
    what = "gatewaySharedStore.passwordSecret"
    with pytest.raises(ValueError, match="Secret ns/pw does not exist"):
        read_secret_key(None, ref, "ns", what)
    with pytest.raises(ValueError, match=r"has no data key 'password' \(it has \['pass'\]\)"):
        read_secret_key({"data": {"pass": "eA=="}}, ref, "ns", what)
    with pytest.raises(ValueError, match="is empty"):
        read_secret_key({"data": {"password": ""}}, ref, "ns", what)
    assert read_secret_key({"data": {"password": "cHc="}}, ref, "ns", what) == "pw"
