"""Value objects that cross the engine/executor/worker seam: one lockstep step and its results.

They are plain dataclasses of builtins and tensors so that they pickle cheaply through Ray
compiled-graph channels. See docs/INTERNALS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: StepInput.control key: every rank commits the experts staged under this staging id at the
#: start of that step, all or none (a vote over the step group; see `moe_runtime.rank.slots`).
CONTROL_EXPERT_EPOCH = "expert_epoch"

#: StepOutput.failure: the rank's step group failed (a peer gone, an op timed out, aborted): it
#: serves no more steps; the executor leaves no step path and a new epoch's groups replace it.
FAILURE_GROUP = "group"
#: StepOutput.failure: the rank itself cannot step again (out of device memory in a step): the
#: executor reports it lost (the recovery shrinks around it), as if its process had died.
FAILURE_RANK = "rank"

#: A token id in `SeqWork.token_ids` that the rank replaces with the token it sampled for that
#: sequence in its previous step: the engine launched this step before that one's outputs came
#: back (docs/ENGINE.md, "Two steps in flight"). Only ever the last id of a one-token decode.
PLACEHOLDER = -1


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature == 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class SeqWork:
    """New tokens of one sequence to run on one rank in one step.

    token_ids: the whole prompt (plus tokens already generated, after a migration) on prefill,
    one token on decode. start_pos: tokens already in this rank's KV cache for the sequence.
    num_generated: tokens generated so far; a seeded sample depends only on (seed, num_generated),
    so a migrated sequence produces the same tokens on any rank.
    """

    seq_id: str
    token_ids: list[int]
    start_pos: int
    sampling: SamplingParams
    num_generated: int = 0


@dataclass
class RankBatch:
    """What one rank does in a step: run `seqs`, and first drop the KV cache of `free`."""

    seqs: list[SeqWork] = field(default_factory=list)
    free: list[str] = field(default_factory=list)


@dataclass
class StepInput:
    """One lockstep step over every rank; each rank reads `batches.get(rank)` (absent = idle).

    control: instructions every rank applies at the start of this step, before running it, so
    that all ranks change together at one step boundary (e.g. {"expert_epoch": 3} swaps in the
    expert placement staged under epoch 3).
    """

    step_id: int
    batches: dict[int, RankBatch] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)

    def most_tokens(self) -> int:
        """New tokens of the busiest rank (what the step's duration follows)."""
        return max(
            (sum(len(s.token_ids) for s in b.seqs) for b in self.batches.values()), default=0
        )


@dataclass
class StepOutput:
    """A rank's result: the sampled token of each of its sequences, and its expert load.

    expert_load: tokens routed to each logical expert by this rank's sequences, int64 [L, E].
    committed: the staging id whose experts this rank committed at the start of this step
    (`CONTROL_EXPERT_EPOCH`); None when the step carried no commit or the vote refused it.
    failure: with `error`, what the error broke (`FAILURE_GROUP`, `FAILURE_RANK`); None when
    the same step may simply be sent again.
    source_reads: experts the rank's pipeline stages read from the model source inside this
    step (a placement change they had not prefetched: it stalls the step); 0 at P = 1.
    prefetch_reads: experts the rank's pipeline stages read from the model source ahead of a
    placement change (a prefetch, or a warm spare's pre-staging, reported at its first step)
    since its last step (what no peer's stage moved to them: a lost rank's experts); 0 at
    P = 1.
    micro_batches: how many micro-batches the step went through the rank's pipeline stages
    as (`pipeline_group.micro_batches`: a prefill at P > 1); 1 when it went whole.
    overlapped: the rank's stage 0 ran this step while an earlier step was still in its later
    pipeline stages (`--pipeline-interleave`: `Stepper.begin`; in the step graph the driver
    finds it, `ray_mesh.merged`).
    seconds: the rank's own time on the step (`Stepper.execute`: control, KV frees, forward
    pass, sampling), without the executor's call and transport around it.
    started_at: when the rank began the step (monotonic, its node's clock; an interleaved
    graph step's, `Stepper.start`; 0.0 otherwise).
    """

    rank: int
    step_id: int
    tokens: dict[str, int] = field(default_factory=dict)
    expert_load: Any = None
    error: str | None = None
    committed: int | None = None
    failure: str | None = None
    source_reads: int = 0
    prefetch_reads: int = 0
    micro_batches: int = 1
    overlapped: bool = False
    seconds: float = 0.0
    started_at: float = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # A CPU expert-load tensor travels as raw bytes: pickling a torch tensor costs ~170 us
        # (bytes: ~2 us), and through a Ray compiled-graph channel a tensor or numpy array in
        # the output adds ~1 ms per step at DP=2 (bench/step.py).
        state = self.__dict__.copy()
        state["expert_load"] = _pack(self.expert_load)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["expert_load"] = _unpack(state.get("expert_load"))
        self.__dict__.update(state)


_PACKED = "moe_runtime.step/packed-tensor"


def _pack(value: Any) -> Any:
    """A CPU tensor as (marker, numpy dtype, shape, bytes); anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    try:
        array = value.detach().contiguous().numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16): pickle the tensor itself
        return value
    return (_PACKED, array.dtype.str, array.shape, array.tobytes())


def _unpack(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _PACKED:
        _, dtype, shape, data = value
        return torch.from_numpy(np.frombuffer(bytearray(data), dtype=dtype).reshape(shape))
    return value
