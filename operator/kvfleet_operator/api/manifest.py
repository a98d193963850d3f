"""Parse a manifest (a dict as read from YAML or from the API server) into its API model.

:func:`parse_manifest` is the pydantic-side admission: it checks what the CRD schema and its CEL rules
check, including the transition rules when the previous version of the object is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvfleet_operator.api.common import API_VERSION
from kvfleet_operator.api.modeldeployment import KIND_MODEL_DEPLOYMENT, ModelDeployment
from kvfleet_operator.api.tenant import KIND_TENANT, ImmutableFieldError, Tenant, check_tenant_transition

ApiObject = ModelDeployment | Tenant


class ManifestError(ValueError):
    """A manifest is invalid. ``errors`` holds one ``"<field.path>: <what to fix>"`` line per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def format_field_path(loc: tuple[int | str, ...]) -> str:
    """Kubernetes-style field path: ``spec.pool.tolerations[0].operator``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def format_validation_error(error: ValidationError) -> list[str]:
    """One ``field.path: message`` line per pydantic error, paths in camelCase as written in YAML."""
    lines = []
    for item in error.errors():
        path = format_field_path(item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}" if path else message)
    return lines


def parse_manifest(manifest: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> ApiObject:
    """Validate ``manifest`` (and, for an update, the transition from ``old``) and return the model.

    Raises :class:`ManifestError` naming every offending field.
    """
    if manifest.get("apiVersion") != API_VERSION:
        raise ManifestError([f"apiVersion: expected {API_VERSION}, got {manifest.get('apiVersion')!r}"])
    kind = manifest.get("kind")
    model: type[ApiObject]
    if kind == KIND_MODEL_DEPLOYMENT:
        model = ModelDeployment
    elif kind == KIND_TENANT:
        model = Tenant
    else:
        raise ManifestError([f"kind: expected {KIND_MODEL_DEPLOYMENT} or {KIND_TENANT}, got {kind!r}"])
    try:
        parsed = model.model_validate(dict(manifest))
        previous = model.model_validate(dict(old)) if old is not None else None
    except ValidationError as error:
        raise ManifestError(format_validation_error(error)) from error
    if isinstance(parsed, Tenant) and isinstance(previous, Tenant):
        try:
            check_tenant_transition(previous, parsed)
        except ImmutableFieldError as error:
            raise ManifestError([f"{error.field}: {error}"]) from error
    return parsed
