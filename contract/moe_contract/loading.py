"""Load progress and load failures, shared by the runtime and the operator.

- ``GET /ready`` (docs/RUNTIME.md) answers :class:`ReadyBody`. While the model loads (``status``
  ``loading``) it carries :class:`LoadProgress`: for each rank, the tensors and bytes it has
  read of those it holds (the non-expert weights and the experts of its own slots). The
  runtime serves it from the moment ``moe-runtime serve`` starts, before the model is open;
  ``/health`` answers 503 until the model serves, so the head's startup probe still bounds
  the load (``model.loadTimeoutSeconds``).
- A ``serve`` that cannot start writes its reason, one line of at most
  :data:`MAX_TERMINATION_MESSAGE` characters, to the container's termination log
  (:data:`TERMINATION_LOG_ENV`, default :data:`DEFAULT_TERMINATION_LOG`); the operator reads
  it from the head pod's status.

:meth:`LoadProgress.message` is the one wording of progress: the runtime's ``/ready`` reason
and the operator's condition message (``kubectl get moed``) both use it.
"""

from __future__ import annotations

from typing import Final

import pydantic

from moe_contract import status as payload

#: ``ReadyBody.status`` values.
READY: Final = "ready"
NOT_READY: Final = "not_ready"
LOADING: Final = "loading"

#: ``LoadProgress.activity``: ranks are being started (no counts yet); weights are being read;
#: the weights are in and the ranks build their groups (the step path follows).
ACTIVITY_STARTING: Final = "starting ranks"
ACTIVITY_WEIGHTS: Final = "weights"
ACTIVITY_GROUPS: Final = "communication groups"

#: Where ``moe-runtime serve`` writes why it stopped (Kubernetes' default
#: ``terminationMessagePath``); written only when the file exists and is writable.
TERMINATION_LOG_ENV: Final = "MOE_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"
#: The kubelet keeps at most 4096 bytes of a termination message; the runtime writes less.
MAX_TERMINATION_MESSAGE: Final = 1024


class RankLoad(payload.Payload):
    """What one rank has read of what it holds (counts in the dtype it serves in)."""

    rank: int
    tensors_loaded: int = 0
    tensors_total: int = 0
    bytes_loaded: int = 0
    bytes_total: int = 0
    #: Every tensor of this rank is in.
    done: bool = False


class LoadProgress(payload.Payload):
    """The load of a ``serve`` that does not serve yet."""

    activity: str = ACTIVITY_STARTING
    #: The ranks being loaded (``ranks`` lists those that answered so far).
    ranks_total: int = 0
    ranks: list[RankLoad] = pydantic.Field(default_factory=list)

    @property
    def bytes_loaded(self) -> int:
        return sum(r.bytes_loaded for r in self.ranks)

    @property
    def bytes_total(self) -> int:
        return sum(r.bytes_total for r in self.ranks)

    @property
    def ranks_ready(self) -> int:
        return sum(r.done for r in self.ranks)

    def slowest(self) -> RankLoad | None:
        """The rank still loading that is furthest behind (``None``: none is)."""
        loading = [r for r in self.ranks if not r.done]
        if not loading:
            return None
        return min(loading, key=lambda r: (r.bytes_loaded / max(r.bytes_total, 1), r.rank))

    def message(self) -> str:
        """``loading weights 12.4/60.1 MB, rank 1/2 (1 of 2 ranks loaded)``: bytes of every
        rank, and the rank furthest behind of ``ranks_total``."""
        if self.activity == ACTIVITY_STARTING or not self.ranks:
            return f"starting {self.ranks_total} ranks, opening the model"
        if self.activity == ACTIVITY_GROUPS:
            return f"weights loaded on {self.ranks_total} ranks, building communication groups"
        text = f"loading weights {amount(self.bytes_loaded, self.bytes_total)}"
        slow = self.slowest()
        if slow is not None:
            text += f", rank {slow.rank}/{self.ranks_total}"
        return text + f" ({self.ranks_ready} of {self.ranks_total} ranks loaded)"


class ReadyBody(payload.Payload):
    """``GET /ready``: 200 with ``status`` ``ready``; else 503 with ``not_ready`` (a serving
    runtime without a step path) or ``loading`` (and ``loading``)."""

    status: str
    reason: str = ""
    loading: LoadProgress | None = None


def amount(done: int, total: int) -> str:
    """``12.4/60.1 MB`` (GB from 1 GB on, the unit of the total)."""
    scale, unit = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
    return f"{done / scale:.1f}/{total / scale:.1f} {unit}"
