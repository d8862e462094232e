"""Does a stored object already hold everything we would apply?

Server-side apply of an unchanged object is a no-op, but not free: for a RayCluster the API
server validates it against KubeRay's very large schema. When the stored object already
contains every field of the desired one (extra fields set by the server or by others are fine),
the operator skips the write. A false "no" only costs a redundant apply.
"""

from __future__ import annotations

from typing import Any


def contains(actual: Any, desired: Any) -> bool:
    """True when every field of ``desired`` is in ``actual`` with the same value (lists must
    match element by element)."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return False
        return all(key in actual and contains(actual[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return False
        return all(contains(a, d) for a, d in zip(actual, desired, strict=True))
    return bool(actual == desired) and type(actual) is type(desired)
