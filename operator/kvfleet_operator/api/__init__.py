"""The kvfleet API (group kvfleet.io, version v1alpha1): pydantic models, the source of truth for the CRDs.

Public names:

* models: :class:`ModelDeployment` (``ModelDeploymentSpec``/``ModelDeploymentStatus``), :class:`Tenant`
  (``TenantSpec``/``TenantStatus``), :class:`Condition`;
* parsing: :func:`parse_manifest` (dict -> model, with the update check when ``old`` is given;
  raises :class:`ManifestError` naming the fields), :func:`parse_quantity` (``256Gi`` -> bytes),
  :func:`parse_duration` (``10m`` -> seconds), :func:`parse_percent` (``50%`` -> 0.5);
* CRD generation: :mod:`kvfleet_operator.api.crdgen` (``build_crds``, ``build_crd_reference``;
  ``make generate`` writes them).

The table of invalid manifests every admission path must reject is test data: ``tests/invalid_manifests.py``.
"""

from kvfleet_operator.api.common import API_VERSION, GROUP, VERSION, Condition, ConditionStatus
from kvfleet_operator.api.manifest import ManifestError, parse_manifest
from kvfleet_operator.api.modeldeployment import (
    ArchitecturePreset,
    ArchitectureSpec,
    KvCacheDtype,
    ModelDeployment,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    WeightDtype,
)
from kvfleet_operator.api.tenant import Tenant, TenantSpec, TenantStatus, check_tenant_transition
from kvfleet_operator.api.units import parse_duration, parse_percent, parse_quantity

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "ArchitecturePreset",
    "ArchitectureSpec",
    "Condition",
    "ConditionStatus",
    "KvCacheDtype",
    "ManifestError",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "ModelDeploymentStatus",
    "Tenant",
    "TenantSpec",
    "TenantStatus",
    "WeightDtype",
    "check_tenant_transition",
    "parse_duration",
    "parse_manifest",
    "parse_percent",
    "parse_quantity",
]
