"""Which watch events of a MoEDeployment need a reconcile, and whether a watched body is current.

Purely computational, no side effects: ``handlers`` keeps the state (one fingerprint per
deployment, the resourceVersions of its own status writes) and asks these functions.

- A reconcile follows what kopf's create, update and resume handlers used to: the object is new
  to this process (the initial listing after a start, or ``ADDED``), or its spec (its
  ``metadata.generation``), labels or annotations changed. An event that changed only
  ``status`` (the operator's own write, most of the time) brings none.
- The operator reconciles from the watched body instead of reading the object again, unless
  its own last status write has not come back on the watch yet: watch events arrive in
  resourceVersion order, so until that write's event is seen every body predates it (a stale
  ``status.resize`` would lose its ``resizeId``), and the object is read again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from moe_operator.api import group

#: Annotations that say nothing about what the operator should do: kubectl's copy of the last
#: applied object, and the diff base kopf's update handler kept (older operators wrote it).
IGNORED_ANNOTATIONS: Final = frozenset(
    {
        "kubectl.kubernetes.io/last-applied-configuration",
        f"{group.GROUP}/last-handled-configuration",
    }
)

Fingerprint = tuple[Any, ...]


def fingerprint(body: Mapping[str, Any]) -> Fingerprint:
    """What a reconcile depends on besides the children and ``status``: the uid, the
    generation (every spec change bumps it), the labels and the annotations."""
    meta = body.get("metadata") or {}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k not in IGNORED_ANNOTATIONS
    }
    return (
        meta.get("uid"),
        meta.get("generation"),
        tuple(sorted((meta.get("labels") or {}).items())),
        tuple(sorted(annotations.items())),
    )


def needs_reconcile(
    *, event_type: str | None, body: Mapping[str, Any], last: Fingerprint | None
) -> bool:
    """Whether a watch event (``event_type`` ``None``: kopf's initial listing) asks for a
    reconcile, given the fingerprint of the last one reconciled (``None``: none yet)."""
    if event_type == "DELETED":
        return False
    if event_type in (None, "ADDED") or last is None:
        return True
    return fingerprint(body) != last


@dataclasses.dataclass
class OwnWrites:
    """The resourceVersion of each deployment's last status write that the watch has not
    delivered yet (keyed by whatever the caller uses: ``(namespace, name)``)."""

    pending: dict[Any, str] = dataclasses.field(default_factory=dict)

    def wrote(self, key: Any, resource_version: str | None) -> None:
        """A status write returned ``resource_version``."""
        if resource_version:
            self.pending[key] = resource_version

    def seen(self, key: Any, resource_version: str | None) -> None:
        """The watch delivered ``resource_version``: when it is the last write, bodies from the
        watch are current again."""
        if resource_version is not None and self.pending.get(key) == resource_version:
            del self.pending[key]

    def read(self, key: Any) -> None:
        """The object was read after the last write (a GET sees every earlier write)."""
        self.pending.pop(key, None)

    def current(self, key: Any) -> bool:
        """Whether the last body the watch delivered holds every status write of ours."""
        return key not in self.pending
