"""Read one field of a built Kubernetes object by path, for table-driven builder tests.

``field_at(obj, "spec.template.spec.containers[0].ports[1].containerPort")``; a path that leads nowhere
gives :data:`MISSING`, so a case can assert that a builder leaves a field out. Keys with dots (label
keys) cannot be addressed: compare the whole label map instead.
"""

from __future__ import annotations

import re
from typing import Any, Final

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


def field_at(obj: Any, path: str) -> Any:
    node = obj
    for match in _PART.finditer(path):
        key, index = match.group(1), match.group(2)
        if key is not None:
            if not isinstance(node, dict) or key not in node:
                return MISSING
            node = node[key]
        else:
            position = int(index)
            if not isinstance(node, list) or position >= len(node):
                return MISSING
            node = node[position]
    return node
