"""Where a deployment's model lives in its pods (pure): a ``pvc://CLAIM/PATH`` source is the
claim mounted read-only at ``/models/CLAIM`` in the head and in every worker (warm spares
included: they are workers), and the runtime is given the directory inside the pod,
``/models/CLAIM/PATH``: it opens a local directory as it always did (every rank opens the
same path on its own pod), and knows nothing of claims. Other sources pass through.

A read-only mount needs no write access on the volume, so a ReadOnlyMany claim works, and so
does a ReadWriteOnce claim as long as every Ray pod lands on the claim's one node (one-node
clusters). Most volume plugins change no file ownership on a read-only mount (the pod's
``fsGroup`` is not applied), so the checkpoint's files must be readable by the runtime's
uid 1000 or gid 100: world-readable files (``huggingface-cli download`` writes them so) are.
"""

from __future__ import annotations

from typing import Any, Final

from moe_operator.api import spec as spec_
from moe_operator.api import storage

VOLUME: Final = "model"
#: The claim ``C`` is mounted at ``MOUNT_ROOT/C``.
MOUNT_ROOT: Final = "/models"


def claim(spec: spec_.MoEDeploymentSpec) -> storage.PvcSource | None:
    """The claim and path of the spec's ``pvc://`` source (``None`` for other sources)."""
    return storage.parse_pvc(spec.model.source)


def model_path(spec: spec_.MoEDeploymentSpec) -> str:
    """What the runtime's ``--model`` gets: the in-pod directory of a ``pvc://`` source, any
    other source as it is."""
    pvc = claim(spec)
    if pvc is None:
        return spec.model.source
    root = f"{MOUNT_ROOT}/{pvc.claim}"
    return f"{root}/{pvc.path}" if pvc.path else root


def volumes(spec: spec_.MoEDeploymentSpec) -> list[dict[str, Any]]:
    """The pod volume of the model's claim (none for other sources)."""
    pvc = claim(spec)
    if pvc is None:
        return []
    return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": pvc.claim, "readOnly": True}}]


def mounts(spec: spec_.MoEDeploymentSpec) -> list[dict[str, Any]]:
    """The container mount of the model's claim (none for other sources)."""
    pvc = claim(spec)
    if pvc is None:
        return []
    return [{"name": VOLUME, "mountPath": f"{MOUNT_ROOT}/{pvc.claim}", "readOnly": True}]
