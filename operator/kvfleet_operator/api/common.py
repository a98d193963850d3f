"""Pieces both custom resources share: the base model, conditions, references and CEL rule plumbing.

A cross-field rule is written once as a :class:`CelRule` (expression, message, field path). The CRD
generator copies it into ``x-kubernetes-validations``; the pydantic model implements the same check in
Python and raises the same message, so one invalid manifest fails in both places naming the same field.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
#: Node label (and taint key) of a dedicated GPU group; the value is the group's name. Nodes carrying it
#: belong to one dedicated Tenant: shared pools never run there.
GPU_GROUP_LABEL = "kvfleet.io/gpu-group"

#: Kubernetes object names (RFC 1123 subdomain) and label-like names (RFC 1123 label).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

ShortText = Annotated[str, Field(max_length=256)]
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
LabelName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]


@dataclass(frozen=True)
class CelRule:
    """One CEL ``x-kubernetes-validations`` entry and the message its pydantic mirror raises.

    ``field_path`` is relative to the object the rule sits on (``.dedicated``); Kubernetes reports the
    error at that path. ``transition`` marks rules that compare with ``oldSelf`` (updates only).
    """

    rule: str
    message: str
    field_path: str | None = None
    transition: bool = False
    #: Kubernetes error type: FieldValueInvalid (the default), FieldValueRequired, FieldValueForbidden.
    reason: str | None = None

    def to_schema(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        if self.reason is not None:
            entry["reason"] = self.reason
        return entry


def cel_rules_schema(*rules: CelRule) -> dict[str, Any]:
    """The ``json_schema_extra`` that attaches ``rules`` to a model's or field's schema."""
    return {"x-kubernetes-validations": [rule.to_schema() for rule in rules]}


class CrdModel(BaseModel):
    """Base of every API model: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_enum_values=False,
        validate_default=False,
    )


class ConditionStatus(StrEnum):
    """Kubernetes condition status."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(CrdModel):
    """One observation of the object's state (Kubernetes condition convention)."""

    type: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            description="Condition type: Ready, Progressing or Degraded.",
        ),
    ]
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
            description="One CamelCase word a program can match on, e.g. ModelDeploymentNotFound.",
        ),
    ]
    message: Annotated[
        str,
        Field(max_length=4096, description="What happened and, if something is wrong, what to do about it."),
    ] = ""
    observed_generation: Annotated[
        int, Field(ge=0, description="The metadata.generation this condition was computed from.")
    ] = 0
    last_transition_time: Annotated[
        str,
        Field(
            max_length=64,
            description="When status last changed (RFC 3339).",
            json_schema_extra={"format": "date-time"},
        ),
    ]


Conditions = Annotated[
    list[Condition],
    Field(
        max_length=16,
        description="Current conditions: Ready, Progressing, Degraded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]


class LocalObjectReference(CrdModel):
    """A reference to an object in the same namespace."""

    name: ObjectName = Field(description="Name of the object in this namespace.")
