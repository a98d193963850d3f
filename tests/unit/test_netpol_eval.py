"""tests/netpol_eval.py against the NetworkPolicy semantics the Kubernetes documentation states, case by
case (most from the examples on the "Network Policies" page), so the attack tests can trust its answers."""

from __future__ import annotations

from typing import Any

import pytest

from netpol_eval import (
    NAMESPACE_NAME_LABEL,
    ContainerPort,
    Namespace,
    Pod,
    allowed_ports,
    is_allowed,
    policy_types,
    selector_matches,
)

NAMESPACES = [
    Namespace("default"),
    Namespace("myproject-ns", {"project": "myproject"}),
    Namespace("other"),
    Namespace("alice-ns", {"user": "alice"}),
]


def policy(namespace: str, spec: dict[str, Any], name: str = "p") -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


DB = Pod("default", "db", {"role": "db"}, ip="10.0.0.10")


def allowed(policies: list[dict[str, Any]], source: Pod, destination: Pod = DB, port: int = 6379) -> bool:
    return is_allowed(policies, NAMESPACES, source, destination, port)


def test_without_policies_every_connection_is_allowed() -> None:
    assert allowed([], Pod("other", "x"), DB, 1)


def test_default_deny_ingress_isolates_every_pod_of_its_namespace_only() -> None:
    deny = [policy("default", {"podSelector": {}, "policyTypes": ["Ingress"]})]
    assert not allowed(deny, Pod("default", "web"))
    assert not allowed(deny, Pod("other", "x"))
    # A pod of another namespace is not selected: still open.
    assert allowed(deny, DB, Pod("other", "x"))
    # Ingress isolation says nothing about egress: the isolated pod may still connect out.
    assert allowed(deny, DB, Pod("other", "x"), 443)


def test_an_empty_rule_allows_all_ingress() -> None:
    allow_all = [policy("default", {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]})]
    assert allowed(allow_all, Pod("other", "x"), DB, 12345)


def test_default_deny_egress_blocks_the_source_whatever_the_destination_admits() -> None:
    deny_out = [policy("default", {"podSelector": {}, "policyTypes": ["Egress"]})]
    assert not allowed(deny_out, Pod("default", "web"), Pod("other", "x"))
    # Not an ingress rule: pods of other namespaces still reach the default namespace's pods.
    assert allowed(deny_out, Pod("other", "x"))


def test_policy_types_default_to_ingress_plus_egress_when_there_is_an_egress_section() -> None:
    only_ingress = policy("default", {"podSelector": {}, "ingress": [{}]})
    with_egress = policy("default", {"podSelector": {}, "egress": [{"ports": [{"port": 53}]}]})
    assert policy_types(only_ingress) == {"Ingress"}
    assert policy_types(with_egress) == {"Ingress", "Egress"}
    assert policy_types(policy("default", {"podSelector": {}, "policyTypes": ["Egress"]})) == {"Egress"}
    # with_egress isolates ingress too, with no ingress rule: nothing comes in.
    assert not allowed([with_egress], Pod("other", "x"))
    assert allowed([with_egress], DB, Pod("other", "dns"), 53)
    assert not allowed([with_egress], DB, Pod("other", "dns"), 80)


#: The documentation's example: db pods accept TCP 6379 from an IP block (minus a subnet), from every pod
#: of namespaces labelled project=myproject, and from pods labelled role=frontend of its own namespace.
DOCS_EXAMPLE = policy(
    "default",
    {
        "podSelector": {"matchLabels": {"role": "db"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [
                    {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
                    {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
                    {"podSelector": {"matchLabels": {"role": "frontend"}}},
                ],
                "ports": [{"protocol": "TCP", "port": 6379}],
            }
        ],
    },
    name="test-network-policy",
)


@pytest.mark.parametrize(
    ("source", "port", "expected"),
    [
        pytest.param(Pod("default", "fe", {"role": "frontend"}), 6379, True, id="frontend-same-namespace"),
        pytest.param(Pod("default", "fe", {"role": "frontend"}), 6380, False, id="frontend-other-port"),
        pytest.param(Pod("other", "fe", {"role": "frontend"}), 6379, False, id="frontend-other-namespace"),
        pytest.param(Pod("myproject-ns", "any"), 6379, True, id="any-pod-of-a-selected-namespace"),
        pytest.param(Pod("other", "x", ip="172.17.0.5"), 6379, True, id="in-the-ip-block"),
        pytest.param(Pod("other", "x", ip="172.17.1.5"), 6379, False, id="in-the-excepted-subnet"),
        pytest.param(Pod("other", "x", ip="10.1.0.5"), 6379, False, id="outside-the-ip-block"),
        pytest.param(Pod("default", "web", {"role": "web"}), 6379, False, id="unlabelled-same-namespace"),
    ],
)
def test_the_documentations_example(source: Pod, port: int, expected: bool) -> None:
    assert allowed([DOCS_EXAMPLE], source, DB, port) is expected
    # Pods the policy does not select are not isolated by it.
    assert allowed([DOCS_EXAMPLE], source, Pod("default", "cache", {"role": "cache"}), port)


def test_namespace_and_pod_selector_in_one_peer_is_and_in_two_peers_is_or() -> None:
    both = {
        "namespaceSelector": {"matchLabels": {"user": "alice"}},
        "podSelector": {"matchLabels": {"role": "client"}},
    }
    one_peer = [policy("default", {"podSelector": {}, "ingress": [{"from": [both]}]})]
    two_peers = [
        policy(
            "default",
            {
                "podSelector": {},
                "ingress": [
                    {
                        "from": [
                            {"namespaceSelector": both["namespaceSelector"]},
                            {"podSelector": both["podSelector"]},
                        ]
                    }
                ],
            },
        )
    ]
    alice_client = Pod("alice-ns", "c", {"role": "client"})
    alice_other = Pod("alice-ns", "o")
    local_client = Pod("default", "c", {"role": "client"})
    foreign_client = Pod("other", "c", {"role": "client"})
    assert [allowed(one_peer, p) for p in (alice_client, alice_other, local_client, foreign_client)] == [
        True,
        False,
        False,  # the namespace selector applies: the default namespace is not alice's
        False,
    ]
    assert [allowed(two_peers, p) for p in (alice_client, alice_other, local_client, foreign_client)] == [
        True,
        True,  # any pod of alice's namespaces
        True,  # the podSelector peer: clients of the policy's own namespace
        False,  # ... and only of its own namespace
    ]


def test_an_empty_namespace_selector_selects_every_namespace() -> None:
    anywhere = [
        policy(
            "default",
            {
                "podSelector": {},
                "ingress": [
                    {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"s": "1"}}}]}
                ],
            },
        )
    ]
    assert allowed(anywhere, Pod("other", "s", {"s": "1"}))
    assert not allowed(anywhere, Pod("other", "x"))


def test_every_namespace_carries_its_name_label() -> None:
    by_name = [
        policy(
            "default",
            {
                "podSelector": {},
                "ingress": [
                    {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "other"}}}]}
                ],
            },
        )
    ]
    assert allowed(by_name, Pod("other", "x"))
    assert not allowed(by_name, Pod("alice-ns", "x"))
    # Even a namespace the caller did not describe (the API server labels every one).
    assert not allowed(by_name, Pod("undeclared", "x"))
    assert Namespace("ns", {NAMESPACE_NAME_LABEL: "forged"}).all_labels()[NAMESPACE_NAME_LABEL] == "ns"


def test_end_port_is_an_inclusive_range() -> None:
    ranged = [
        policy(
            "default",
            {
                "podSelector": {},
                "ingress": [{"ports": [{"protocol": "TCP", "port": 32000, "endPort": 32768}]}],
            },
        )
    ]
    source = Pod("other", "x")
    assert [allowed(ranged, source, DB, p) for p in (31999, 32000, 32500, 32768, 32769)] == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_the_protocol_defaults_to_tcp_and_must_match() -> None:
    udp = [policy("default", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "UDP", "port": 53}]}]})]
    tcp = [policy("default", {"podSelector": {}, "ingress": [{"ports": [{"port": 53}]}]})]
    source = Pod("other", "x")
    assert not is_allowed(udp, NAMESPACES, source, DB, 53, "TCP")
    assert is_allowed(udp, NAMESPACES, source, DB, 53, "UDP")
    assert is_allowed(tcp, NAMESPACES, source, DB, 53, "TCP")
    assert not is_allowed(tcp, NAMESPACES, source, DB, 53, "UDP")


def test_a_port_entry_without_a_port_admits_every_port_of_its_protocol() -> None:
    any_tcp = [policy("default", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "TCP"}]}]})]
    assert allowed(any_tcp, Pod("other", "x"), DB, 1)
    assert allowed(any_tcp, Pod("other", "x"), DB, 65535)
    assert not is_allowed(any_tcp, NAMESPACES, Pod("other", "x"), DB, 53, "UDP")


def test_a_named_port_is_the_destination_containers_port_of_that_name() -> None:
    named = [policy("default", {"podSelector": {}, "ingress": [{"ports": [{"port": "metrics"}]}]})]
    server = Pod("default", "s", ports=(ContainerPort(9100, "metrics"), ContainerPort(8000, "http")))
    source = Pod("other", "x")
    assert allowed(named, source, server, 9100)
    assert not allowed(named, source, server, 8000)
    # A pod without a port of that name admits nothing through that rule.
    assert not allowed(named, source, DB, 9100)


def test_policies_are_a_union() -> None:
    first = policy(
        "default", {"podSelector": {"matchLabels": {"role": "db"}}, "ingress": [{"ports": [{"port": 1}]}]}
    )
    second = policy("default", {"podSelector": {}, "ingress": [{"ports": [{"port": 2}]}]}, name="q")
    source = Pod("other", "x")
    assert [allowed([first, second], source, DB, p) for p in (1, 2, 3)] == [True, True, False]
    # For a pod only the second policy selects, the first adds nothing.
    web = Pod("default", "web")
    assert [allowed([first, second], source, web, p) for p in (1, 2)] == [False, True]


def test_a_policy_applies_to_its_own_namespace_only() -> None:
    elsewhere = [policy("other", {"podSelector": {}, "policyTypes": ["Ingress"]})]
    assert allowed(elsewhere, Pod("other", "x"))
    assert not allowed(elsewhere, DB, Pod("other", "x"))


def test_egress_and_ingress_must_both_allow() -> None:
    ingress_open = policy("default", {"podSelector": {}, "ingress": [{}]})
    egress_to_db = policy(
        "other",
        {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "db"}}}]}],
        },
        name="out",
    )
    source = Pod("other", "x")
    assert allowed([ingress_open, egress_to_db], source, DB)
    assert not allowed([ingress_open, egress_to_db], source, Pod("default", "web"))
    # A named port in an egress rule is the destination's.
    named_out = policy(
        "other", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"ports": [{"port": "http"}]}]}
    )
    server = Pod("default", "s", ports=(ContainerPort(8000, "http"),))
    assert allowed([named_out], source, server, 8000)
    assert not allowed([named_out], source, server, 8001)


@pytest.mark.parametrize(
    ("expression", "labels", "expected"),
    [
        ({"key": "tier", "operator": "In", "values": ["a", "b"]}, {"tier": "a"}, True),
        ({"key": "tier", "operator": "In", "values": ["a", "b"]}, {"tier": "c"}, False),
        ({"key": "tier", "operator": "In", "values": ["a"]}, {}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "b"}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "a"}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {}, True),  # an absent key is not in the set
        ({"key": "tier", "operator": "Exists"}, {"tier": ""}, True),
        ({"key": "tier", "operator": "Exists"}, {}, False),
        ({"key": "tier", "operator": "DoesNotExist"}, {}, True),
        ({"key": "tier", "operator": "DoesNotExist"}, {"tier": "a"}, False),
    ],
)
def test_match_expressions(expression: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selector_matches({"matchExpressions": [expression]}, labels) is expected


def test_match_labels_and_expressions_are_anded_and_the_empty_selector_selects_all() -> None:
    selector = {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]}
    assert selector_matches(selector, {"a": "1", "b": "x"})
    assert not selector_matches(selector, {"a": "1"})
    assert not selector_matches(selector, {"b": "x"})
    assert selector_matches({}, {})
    assert selector_matches({}, {"anything": "at all"})


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"ingress": [{"from": [{}]}]}, id="peer-without-selector"),
        pytest.param(
            {"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]},
            id="ipblock-and-pods",
        ),
        pytest.param({"ingress": [{"ports": [{"port": "http", "endPort": 9000}]}]}, id="endport-named-port"),
        pytest.param({"ingress": [{"ports": [{"port": 9000, "endPort": 8000}]}]}, id="endport-below-port"),
        pytest.param(
            {
                "ingress": [
                    {"from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Gt"}]}}]}
                ]
            },
            id="unknown-operator",
        ),
        pytest.param(
            {
                "ingress": [
                    {"from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}
                ]
            },
            id="in-without-values",
        ),
    ],
)
def test_malformed_policies_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        allowed([policy("default", {"podSelector": {}, **bad})], Pod("default", "x"), DB, 9000)


def test_allowed_ports_agrees_with_port_by_port_evaluation() -> None:
    policies = [
        policy(
            "default",
            {
                "podSelector": {},
                "ingress": [
                    {"ports": [{"port": 80}, {"port": 32000, "endPort": 32010}, {"port": "metrics"}]},
                    {"from": [{"podSelector": {"matchLabels": {"role": "x"}}}], "ports": [{"port": 65535}]},
                ],
            },
        )
    ]
    server = Pod("default", "s", ports=(ContainerPort(9100, "metrics"),))
    source = Pod("default", "x", {"role": "x"})
    brute = {p for p in range(1, 65536) if is_allowed(policies, NAMESPACES, source, server, p)}
    assert allowed_ports(policies, NAMESPACES, source, server) == brute
    assert brute == {80, *range(32000, 32011), 9100, 65535}
    assert allowed_ports([], NAMESPACES, source, server) == set(range(1, 65536))
