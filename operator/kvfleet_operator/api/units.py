"""Units the API speaks: Kubernetes quantities, Go-style durations and percentages.

Each unit has a parse function (pure, raises ``ValueError`` with a message a user can act on) and an
annotated pydantic type whose JSON schema is exactly what the generated CRD carries, so the API server
(schema pattern + CEL) and the pydantic models accept the same strings.

* Quantity: ``256Gi``, ``2Ti``, ``500M``, ``1024`` (a plain integer is also accepted, as in Kubernetes
  resource fields). Binary suffixes Ki..Ei, decimal suffixes k..E. No negative values, no exponents,
  no milli suffix: these are byte sizes.
* Duration: the subset of Go's ``time.ParseDuration`` that CEL's ``duration()`` parses: ``30s``,
  ``10m``, ``24h``, ``1h30m``, ``500ms``. No sign: a negative duration is never valid here.
* Percent: ``50%``, ``12.5%`` of something; parsed to a fraction (``0.5``).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
RESOURCE_QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
PERCENT_PATTERN = r"^[0-9]{1,3}(\.[0-9]{1,4})?%$"

QUANTITY_MAX_LENGTH = 32
DURATION_MAX_LENGTH = 32
PERCENT_MAX_LENGTH = 9

_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_RESOURCE_QUANTITY_RE = re.compile(RESOURCE_QUANTITY_PATTERN)
_DURATION_RE = re.compile(DURATION_PATTERN)
_DURATION_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_PERCENT_RE = re.compile(PERCENT_PATTERN)

_SUFFIX_MULTIPLIER: dict[str, int] = {
    "": 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_DURATION_UNIT_SECONDS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}


def parse_quantity(value: str | int) -> int:
    """Return the number of bytes a Kubernetes quantity such as ``256Gi`` stands for (rounded up).

    Raises ``ValueError`` for anything that is not a non-negative quantity with a known suffix.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a quantity such as 256Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    text = value.strip()
    if not _QUANTITY_RE.match(text) or len(text) > QUANTITY_MAX_LENGTH:
        raise ValueError(
            f"{value!r} is not a size: write a number with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei "
            "(powers of 1024) or k, M, G, T, P, E (powers of 1000), e.g. 256Gi"
        )
    suffix_at = len(text.rstrip("KMGTPEik"))
    number, suffix = text[:suffix_at], text[suffix_at:]
    try:
        amount = Decimal(number) * _SUFFIX_MULTIPLIER[suffix]
    except (InvalidOperation, KeyError) as error:  # unreachable after the regex; kept for safety
        raise ValueError(f"{value!r} is not a size") from error
    return math.ceil(amount)


def parse_duration(value: str) -> float:
    """Return the seconds a Go-style duration such as ``30s``, ``10m``, ``24h`` or ``1h30m`` stands for."""
    text = value.strip()
    if not _DURATION_RE.match(text) or len(text) > DURATION_MAX_LENGTH:
        raise ValueError(
            f"{value!r} is not a duration: write a number with a unit ms, s, m or h, e.g. 30s, 10m, 24h "
            "(no sign: durations here cannot be negative)"
        )
    total = sum(
        (Decimal(number) * _DURATION_UNIT_SECONDS[unit] for number, unit in _DURATION_PART_RE.findall(text)),
        Decimal(0),
    )
    return float(total)


def parse_percent(value: str) -> float:
    """Return the fraction a percentage such as ``50%`` stands for (``0.5``). Values above 100% parse;
    callers that need a share of something check the bound themselves."""
    text = value.strip()
    if not _PERCENT_RE.match(text):
        raise ValueError(f"{value!r} is not a percentage: write a number followed by %, e.g. 50% or 12.5%")
    return float(Decimal(text[:-1]) / 100)


def _normalise_quantity(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"expected a size such as 256Gi, got {value!r}")
    parse_quantity(value)
    return str(value)


def _check_resource_quantity(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"expected a resource quantity such as 500m or 1Gi, got {value!r}")
    text = str(value)
    if not _RESOURCE_QUANTITY_RE.match(text) or len(text) > QUANTITY_MAX_LENGTH:
        raise ValueError(f"{text!r} is not a resource quantity: write e.g. 500m or 2 (CPU), 512Mi (memory)")
    return text


def _check_duration(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a duration string such as 30s, 10m or 24h, got {value!r}")
    parse_duration(value)
    return value


def _check_positive_duration(value: Any) -> str:
    text = _check_duration(value)
    if parse_duration(text) <= 0:
        raise ValueError(f"{text!r} is zero: a TTL must be longer than 0s")
    return text


def _check_percent(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a percentage string such as 50%, got {value!r}")
    parse_percent(value)
    return value


def _check_share(value: Any) -> str:
    text = _check_percent(value)
    if parse_percent(text) > 1:
        raise ValueError(f"{text} is more than 100%: a share of the pool is at most 100%")
    return text


#: A byte size; accepted as int or string, stored as the string the user wrote.
Quantity = Annotated[
    str,
    BeforeValidator(_normalise_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "maxLength": QUANTITY_MAX_LENGTH,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

#: A container resource amount (CPU ``500m``, memory ``512Mi``), as in Kubernetes resource lists.
ResourceQuantity = Annotated[
    str,
    BeforeValidator(_check_resource_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": RESOURCE_QUANTITY_PATTERN,
            "maxLength": QUANTITY_MAX_LENGTH,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

#: A Go-style duration (``30s``); zero allowed.
Duration = Annotated[
    str,
    BeforeValidator(_check_duration),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": DURATION_MAX_LENGTH}),
]

DURATION_POSITIVE_RULE = "duration(self) > duration('0s')"

#: A Go-style duration that must be longer than zero (TTLs).
PositiveDuration = Annotated[
    str,
    BeforeValidator(_check_positive_duration),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": DURATION_PATTERN,
            "maxLength": DURATION_MAX_LENGTH,
            "x-kubernetes-validations": [
                {"rule": DURATION_POSITIVE_RULE, "message": "a TTL must be longer than 0s, e.g. 30s"}
            ],
        }
    ),
]

SHARE_AT_MOST_100_RULE = "double(self.replace('%', '')) <= 100.0"

#: A share of a pool: a percentage between 0% and 100%.
Share = Annotated[
    str,
    BeforeValidator(_check_share),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": PERCENT_PATTERN,
            "maxLength": PERCENT_MAX_LENGTH,
            "x-kubernetes-validations": [
                {"rule": SHARE_AT_MOST_100_RULE, "message": "a share of the pool is at most 100%"}
            ],
        }
    ),
]


def _check_hbm_amount(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a share such as 20% or a number of tokens, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a number of tokens cannot be negative, got {value}")
        return value
    return _check_share(value)


HBM_AMOUNT_RULE = "type(self) == string ? double(self.replace('%', '')) <= 100.0 : self >= 0"

#: HBM (GPU memory) quota: a share of the pool (``20%``) or a number of tokens (``500000``).
HbmAmount = Annotated[
    int | str,
    BeforeValidator(_check_hbm_amount),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": PERCENT_PATTERN,
            "maxLength": PERCENT_MAX_LENGTH,
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": HBM_AMOUNT_RULE,
                    "message": "give a share of the pool of at most 100% (e.g. 20%) or a non-negative "
                    "number of tokens",
                }
            ],
        }
    ),
]
