"""A small, pure evaluator of Kubernetes NetworkPolicy (networking.k8s.io/v1): may this pod connect to
that pod on this port?

It implements the semantics the operator's policies rely on, as the Kubernetes documentation states them
("Network Policies", and the API reference of ``NetworkPolicySpec``), so the attack tests in
``tests/security/`` can ask the operator's *rendered* objects who reaches an engine, without a cluster:

* A policy applies to the pods of **its own namespace** that its ``podSelector`` selects (``{}``: all).
* ``policyTypes`` absent: ``Ingress`` always, plus ``Egress`` when the policy has an ``egress`` section.
* A pod that no policy of a type selects is not isolated for that direction: everything is allowed. A pod
  that at least one policy of that type selects is isolated: a connection is allowed only when some
  rule of some of those policies admits it (the union; policies never deny, they only allow).
* A connection needs both halves: egress from the source pod and ingress to the destination pod.
* A rule with no ``from``/``to`` (or an empty list) admits every peer; with no ``ports`` (or an empty
  list) every port. A rule ``{}`` therefore admits everything.
* A peer with only ``podSelector`` selects pods of the policy's namespace; with only
  ``namespaceSelector``, every pod of the selected namespaces; with both (one peer), pods matching the
  pod selector *in* namespaces matching the namespace selector (AND); two peers are OR. An ``ipBlock``
  matches the source's (ingress) or destination's (egress) IP: inside ``cidr``, outside every ``except``.
* A port entry: ``protocol`` (default ``TCP``); ``port`` absent: every port of that protocol; a number;
  a name (the destination container's port of that name and protocol); ``endPort``: the inclusive range
  ``port..endPort`` (numeric ``port`` only).
* Label selectors: ``matchLabels`` and ``matchExpressions`` (``In``, ``NotIn``, ``Exists``,
  ``DoesNotExist``), ANDed; ``{}`` selects everything. Every namespace carries the label
  ``kubernetes.io/metadata.name=<name>`` (the API server sets it).

Out of scope (no policy of kvfleet depends on it): traffic from the node itself (kubelet probes, which
CNI plugins admit whatever the policies say), traffic inside one pod (its loopback is never governed:
that is why LMCache binds it), Services (policies see pod IPs after DNAT), and SCTP/UDP specifics
beyond matching the protocol name. Malformed input (a peer with no selector, ``ipBlock`` combined with a
selector, ``endPort`` with a named port or below ``port``, an unknown operator) raises ``ValueError``,
as the API server would refuse it.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]

#: The label the API server puts on every namespace (Kubernetes 1.22+), naming it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Namespace:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        """Its labels as the API server stores them: with ``kubernetes.io/metadata.name`` set to its name."""
        return {**self.labels, NAMESPACE_NAME_LABEL: self.name}


@dataclass(frozen=True)
class ContainerPort:
    port: int
    name: str | None = None
    protocol: str = "TCP"


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Ports its containers declare (only named-port rules read them).
    ports: tuple[ContainerPort, ...] = ()
    ip: str | None = None


def _check_operator(operator: str) -> None:
    if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
        raise ValueError(f"unknown label selector operator {operator!r}")


def selector_matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector selects an object with ``labels`` (``{}`` selects everything)."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"not a label selector: unknown fields {sorted(unknown)}")
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, operator, values = expr["key"], expr["operator"], list(expr.get("values") or [])
        _check_operator(operator)
        if operator in ("In", "NotIn") and not values:
            raise ValueError(f"{operator} needs values (key {key!r})")
        if operator in ("Exists", "DoesNotExist") and values:
            raise ValueError(f"{operator} takes no values (key {key!r})")
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def policy_types(policy: Obj) -> set[str]:
    """The directions a policy isolates (``policyTypes``, or its default)."""
    spec = policy["spec"]
    if spec.get("policyTypes"):
        return set(spec["policyTypes"])
    return {"Ingress", "Egress"} if "egress" in spec else {"Ingress"}


def _selects(policy: Obj, pod: Pod) -> bool:
    return policy["metadata"]["namespace"] == pod.namespace and selector_matches(
        policy["spec"].get("podSelector") or {}, pod.labels
    )


def _ip_in_block(ip: str | None, block: Obj) -> bool:
    if ip is None:
        return False
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"], strict=False):
        return False
    return not any(address in ipaddress.ip_network(e, strict=False) for e in block.get("except") or [])


def peer_matches(peer: Obj, policy_namespace: str, other: Pod, namespaces: Mapping[str, Namespace]) -> bool:
    """Whether one ``from``/``to`` entry of a policy in ``policy_namespace`` matches the pod ``other``."""
    has_pods, has_namespaces = "podSelector" in peer, "namespaceSelector" in peer
    if "ipBlock" in peer:
        if has_pods or has_namespaces:
            raise ValueError("an ipBlock peer cannot have a pod or namespace selector")
        return _ip_in_block(other.ip, peer["ipBlock"])
    if not (has_pods or has_namespaces):
        raise ValueError(f"a peer needs podSelector, namespaceSelector or ipBlock: {dict(peer)}")
    if has_namespaces:
        namespace = namespaces.get(other.namespace, Namespace(other.namespace))
        if not selector_matches(peer["namespaceSelector"] or {}, namespace.all_labels()):
            return False
    elif other.namespace != policy_namespace:
        return False
    return not has_pods or selector_matches(peer["podSelector"] or {}, other.labels)


def port_matches(entry: Obj, port: int, protocol: str, destination: Pod) -> bool:
    """Whether one ``ports`` entry admits ``port``/``protocol`` on ``destination``."""
    if entry.get("protocol", "TCP") != protocol:
        return False
    wanted = entry.get("port")
    end = entry.get("endPort")
    if isinstance(wanted, str):
        if end is not None:
            raise ValueError("endPort needs a numeric port")
        return any(p.name == wanted and p.protocol == protocol and p.port == port for p in destination.ports)
    if wanted is None:
        if end is not None:
            raise ValueError("endPort needs a port")
        return True
    if end is None:
        return bool(wanted == port)
    if end < wanted:
        raise ValueError(f"endPort {end} is below port {wanted}")
    return bool(wanted <= port <= end)


def _rule_admits(
    rule: Obj, peers_key: str, policy_namespace: str, peer: Pod, port: int, protocol: str, destination: Pod,
    namespaces: Mapping[str, Namespace],
) -> bool:  # fmt: skip
    peers = rule.get(peers_key) or []
    if peers and not any(peer_matches(p, policy_namespace, peer, namespaces) for p in peers):
        return False
    ports = rule.get("ports") or []
    return not ports or any(port_matches(e, port, protocol, destination) for e in ports)


def _direction_allows(
    policies: Sequence[Obj], direction: str, subject: Pod, peer: Pod, port: int, protocol: str,
    destination: Pod, namespaces: Mapping[str, Namespace],
) -> bool:  # fmt: skip
    """``direction`` of ``subject`` (``Ingress``: it receives from ``peer``; ``Egress``: it sends to it)."""
    section, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    isolating = [p for p in policies if direction in policy_types(p) and _selects(p, subject)]
    if not isolating:
        return True
    return any(
        _rule_admits(
            rule, peers_key, p["metadata"]["namespace"], peer, port, protocol, destination, namespaces
        )
        for p in isolating
        for rule in p["spec"].get(section) or []
    )


def is_allowed(
    policies: Iterable[Obj],
    namespaces: Iterable[Namespace],
    source: Pod,
    destination: Pod,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether ``source`` may open a connection to ``destination`` on ``port``/``protocol`` under
    ``policies`` (NetworkPolicy objects as the API server stores them; others' kinds are ignored)."""
    network = [p for p in policies if p.get("kind") == "NetworkPolicy"]
    by_name = {n.name: n for n in namespaces}
    return _direction_allows(
        network, "Egress", source, destination, port, protocol, destination, by_name
    ) and _direction_allows(network, "Ingress", destination, source, port, protocol, destination, by_name)


def allowed_ports(
    policies: Iterable[Obj],
    namespaces: Iterable[Namespace],
    source: Pod,
    destination: Pod,
    protocol: str = "TCP",
) -> set[int]:
    """Every port (1-65535) on which ``source`` may connect to ``destination``.

    Whether a port is admitted can only change where some port entry starts or ends (a number, a range's
    ends, a named container port), so it is evaluated at those boundaries and holds until the next."""
    listed = [p for p in policies if p.get("kind") == "NetworkPolicy"]
    known = list(namespaces)
    cuts = {1, 65536}
    for policy in listed:
        for rule in [*(policy["spec"].get("ingress") or []), *(policy["spec"].get("egress") or [])]:
            for entry in rule.get("ports") or []:
                if isinstance(entry.get("port"), int):
                    cuts |= {entry["port"], entry.get("endPort", entry["port"]) + 1}
    cuts |= {q for p in destination.ports for q in (p.port, p.port + 1)}
    bounds = sorted(c for c in cuts if 1 <= c <= 65536)
    allowed: set[int] = set()
    for start, stop in itertools.pairwise(bounds):
        if is_allowed(listed, known, source, destination, start, protocol):
            allowed.update(range(start, stop))
    return allowed
