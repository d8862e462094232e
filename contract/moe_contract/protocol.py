"""The rank protocol version: what the head's runtime and its rank actors must agree on.

Each rank actor runs the ``moe_runtime`` installed in its own pod's image, not the head's. A
RayCluster whose pods come from two images would run two versions of the rank protocol side
by side; the operator never builds one (a template change rolls over to a second RayCluster),
and the runtime refuses a rank that says another version (:func:`check`) instead of
misbehaving. Bump :data:`VERSION` whenever a rank call, a step payload or a transfer format
changes incompatibly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: The rank protocol this installation speaks. 2: the step graph's hold (a reserved step id the
#: actor waits in, `release_hold` on its health lane).
VERSION: Final = 2
#: The key of a rank's ``ready()`` / ``info()`` answer that carries it.
INFO_KEY: Final = "protocol"


class ProtocolMismatch(RuntimeError):
    """A rank speaks another protocol version than the head (another image)."""


def check(info: Mapping[str, Any], *, where: str) -> None:
    """Raise :class:`ProtocolMismatch` when the rank that answered ``info`` speaks another
    version (a rank that says none predates the check: version 0)."""
    theirs = info.get(INFO_KEY, 0)
    if theirs != VERSION:
        raise ProtocolMismatch(
            f"{where} (pod {info.get('pod') or '?'}) speaks rank protocol version {theirs}, "
            f"this runtime speaks {VERSION}: its pod runs another image than the head. The "
            "rank is refused; a RayCluster must run one image (change spec.ray.image through "
            "the operator, which rolls over to a new RayCluster)"
        )
