"""The JSON merge patch (RFC 7386) between two JSON objects (pure): what the operator sends to write
only what changed (`status.build_status_patch`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch from `old` to `new` (objects merged member by member, arrays replaced)."""
    out: dict[str, Any] = {}
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            inner = merge_patch(a, b)
            if inner:
                out[key] = inner
        else:
            out[key] = b
    return out
