"""Pipeline stages inside a DP rank at serving time (docs/PIPELINE-PARALLEL.md, "Serving"):
the leader (pipeline stage 0, the DP rank's `RankWorker`, `PipelineLeader`) and its stage
workers (stages 1..P-1, `stage_worker.StageWorker`).

The DP rank stays one rank for the roster, the step graph and the engine: only its leader is
seen. The leader holds stage 0's layers and the routed experts of its MoE layers (its expert
slots of the other stages' layers are one shared zero expert, never called); stage s holds
its layers, a KV cache of them and the routed experts of its MoE layers, placed over its own
expert-parallel group: stage s of every DP rank, joined whenever the leaders join a step
group (same epoch, same group rank; `PipelineLeader.join`). Its placement is the leader's
restricted to its MoE layers (`stage_placement`): each step carries the leader's live token
(epoch, origin, rank, size) and, when that changed (an activate, a revert, an EPLB commit),
the placement; the stage follows it (`StageWorker.follow`: experts it holds or held before
are kept, the others read from the model source). A placement the leader stages (a resize's
Transferring, an EPLB rebalance, a recovery: `ExpertSlots.stage_experts`) is prefetched by
every stage meanwhile (`prefetch`, beside the steps: the leaders' moves of its layers run
between the same stage of the DP ranks over a stage transfer group, joined with the leaders'
transfer group of each epoch; what no move brings is read from the source), so the step that
switches reads nothing; a warm spare's stages pre-stage the experts
of their layers that the grows it may serve give it (`prestage`, as its leader pre-stages its
own), so that prefetch then finds them. So resizes and recovery of the leaders carry
the stages along.

A step with tokens on any DP rank: the leader runs stage 0 (also with no token of its own:
its stages must join their experts' collectives) and hands its hidden states to stage 1, ...,
the last stage's logits come back to the leader, which samples (`Stages.chain`: a lane of the
compiled step graph per micro-batch, or one call per stage per micro-batch). Each stage returns its expert load; the leader adds it at its MoE layers.

Failures: a stage actor that died or hangs fails its leader (`StageLost`, as a lost TP
follower: the DP rank is lost); a failed step aborts every stage's group (no peer waits in a
collective for a stage that will not come).

Nothing here knows about Ray: the leader reaches its stages through `Stages`
(`executor.ray_pipeline` implements it over stage actors).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, pipeline
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.rank import tensor_group

log = logging.getLogger(__name__)

#: Seconds a stage group's join, and each of its collectives, may take.
GROUP_TIMEOUT_S = 60.0
#: Seconds the leader waits for its stages' load.
LOAD_TIMEOUT_S = 600.0
#: Seconds the leader waits for its stages' part of one step.
STEP_TIMEOUT_S = 120.0
#: New tokens on the busiest DP rank from which a step goes through the stages as micro-batches
#: (`micro_batches`; `--pipeline-micro-batch-tokens`): prefills, not decodes.
MICRO_BATCH_TOKENS = 256


#: What the leader serves with, sent with each step: ((epoch, origin, rank, num_ranks), the
#: placement of every MoE layer, or None when the stages were sent this token's already).
Token = tuple[int, int | None, int, int]
Live = tuple[Token, policy.Placement | None]
#: What the last stage samples a sequence's next token by (`Stepper.start`): its sampling
#: params and tokens generated so far (`sampling.sample`).
Sampling = tuple[Any, int]


class StageLost(tensor_group.FollowerLost):
    """A pipeline stage actor died or hangs: its DP rank cannot step again."""


@dataclasses.dataclass(frozen=True)
class Sent:
    """A step's micro-batches in the stages (`PipelineLeader.send`; `receive` waits)."""

    pending: list[Any]
    expert_load: torch.Tensor
    device: Any


class Stages(Protocol):
    """How a leader reaches its stage actors (stages 1..P-1, in order)."""

    def send(self, method: str, *args: Any) -> Any:
        """Start `StageWorker.<method>(*args)` on every stage; a handle for `wait`."""

    def chain(
        self,
        epoch: int,
        frees: Sequence[str],
        batch: Any,
        hidden: Any,
        live: Live,
        sample: Sequence[Sampling] | None = None,
    ) -> Any:
        """Start one step through the stages: stage 1 gets `hidden`, stage s + 1 what stage s
        returns, each `live`; a handle for `wait`, whose last result is the last stage's
        answer. `sample` (one entry per sequence of `batch`): the last stage samples and
        answers the tokens (a step the leader `Stepper.start`ed: the step graph's interleaved
        steps); None: it answers the logits."""

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        """The stages' results; StageLost naming a dead one, RuntimeError for a call that
        raised, TimeoutError for one still running after `timeout` s."""

    def abort(self, reason: str) -> None:
        """Abort every stage's groups now (their health lane: never queued behind a step)."""

    def abort_join(self, epoch: int) -> None:
        """Call off every stage's joins of `epoch` (their health lane; returns at once)."""

    def alive(self) -> str | None:
        """None while every stage answers pings, else why not."""

    def pids(self) -> list[int]:
        """The stage actors' process ids."""

    def follower_pids(self) -> list[int]:
        """The process ids of the stages' TP followers (stage by stage; none at T = 1)."""


def add_loads(expert_load: torch.Tensor, loads: Sequence[tuple[int, int, Any]]) -> None:
    """The stages' expert loads (a last stage's answer's "loads": (first, stop, load) of each
    stage's MoE layers) added into a DP rank's `expert_load` [L, E] at their layers."""
    for first, stop, load in loads:
        if load is not None and stop > first:
            expert_load[first:stop] += load.to(expert_load.device)


def micro_batches(size: int, batches: Sequence[Sequence[int]], min_tokens: int) -> int:
    """How many micro-batches a step goes through the P = `size` stages as, the same on every
    DP rank: `batches` is each DP rank's new tokens per sequence (all of the step's, which
    every rank sees). A step whose largest DP rank batch has at least `min_tokens` new
    tokens (a prefill: compute-bound, where two stages working at once pay) goes as up to P
    micro-batches, no more than that batch has sequences; a smaller one (decodes: reading
    the weights dominates, and each micro-batch reads them again) goes whole. `min_tokens`
    0: always whole."""
    if size <= 1 or min_tokens <= 0 or not batches or max(map(sum, batches)) < min_tokens:
        return 1
    return min(size, max(map(len, batches)))


def split(batch: kv_mod.ForwardBatch, parts: int) -> list[kv_mod.ForwardBatch]:
    """`batch` as `parts` micro-batches of whole sequences, in order, each about 1/`parts`
    of its new tokens (some may be empty: a DP rank with fewer sequences than `parts` still
    runs every round of its stages' collectives)."""
    if parts <= 1:
        return [batch]
    cum = [0]
    for tokens in batch.token_ids:
        cum.append(cum[-1] + len(tokens))
    # cut k after the sequence whose running token count is nearest k / parts of the total
    # (the later one on a tie: the first micro-batch starts the stages with work)
    bounds = [0]
    for k in range(1, parts):
        target = k * cum[-1] / parts
        bounds.append(min(range(bounds[-1], len(cum)), key=lambda i: (abs(cum[i] - target), -i)))
    bounds.append(len(cum) - 1)
    return [
        kv_mod.ForwardBatch(
            seq_ids=batch.seq_ids[a:b],
            token_ids=batch.token_ids[a:b],
            start_pos=batch.start_pos[a:b],
        )
        for a, b in itertools.pairwise(bounds)
    ]


def stage_spec(spec: group_mod.GroupSpec, stage: int) -> group_mod.GroupSpec:
    """The rendezvous of stage `stage`'s expert-parallel group, derived from the leaders' step
    group `spec` (same members, epoch and group ranks): a FileStore of its own beside the
    leaders' (every DP rank on one host), or its own keys in the leaders' TCPStore, which the
    leader of group rank 0 hosts while its step group of that epoch lives (DP ranks on
    several hosts: the stages of a DP rank share their leader's host)."""
    if spec.store_path is not None:
        return dataclasses.replace(spec, store_path=f"{spec.store_path}.pp{stage}")
    return dataclasses.replace(spec, namespace=f"pp{stage}/", hosted=False)


def stage_placement(placement: policy.Placement, stage: pipeline.PipelineStage) -> policy.Placement:
    """The placement of `stage`'s MoE layers only (local MoE layer i: the model's
    `stage.moe_layers[0] + i`)."""
    first, stop = stage.moe_layers
    return policy.Placement.from_phy2log(
        placement.phy2log[first:stop].clone(), int(placement.logcnt.shape[1])
    )


def stage_view(
    stage: pipeline.PipelineStage | None,
) -> Callable[[policy.Placement], policy.Placement] | None:
    """`stage_placement` of `stage` as a function of the placement (None: no stages)."""
    return None if stage is None else functools.partial(stage_placement, stage=stage)


class PipelineLeader:
    """The leader's side of its pipeline: its stages, KV frees still to send."""

    def __init__(
        self,
        stages: Stages,
        *,
        size: int,
        device: str,
        micro_batch_tokens: int | None = None,
    ) -> None:
        self.stages = stages
        self.size = size
        self.device = device
        #: `micro_batches`' threshold (0: every step goes whole; None given: the default)
        self.micro_batch_tokens = (
            MICRO_BATCH_TOKENS if micro_batch_tokens is None else micro_batch_tokens
        )
        self._frees: list[str] = []
        self._lost: str | None = None
        #: The live token every stage has followed (None: send the placement with the next).
        self._sent: Token | None = None
        #: In the mesh layout: the live token and stage 0's rows of its placement, which stage
        #: 0's followers follow (made again only when the token changes)
        self._theirs: Live | None = None
        #: Experts the stages read from the model source in the last step (`StageWorker.
        #: follow`: what no `prefetch` brought), over all stages.
        self.step_reads = 0
        self._prefetch_reads = 0
        self._reads_lock = threading.Lock()

    def plan(self, cfg: Any) -> pipeline.PipelineStage:
        """Stage 0 of `cfg` (ValueError naming the field when P does not fit the model)."""
        return pipeline.plan(cfg, stage=0, size=self.size)

    # -- loading -------------------------------------------------------------------------
    def start_load(
        self,
        source: str,
        dtype: torch.dtype,
        *,
        rank: int,
        num_ranks: int,
        placement: policy.Placement | None,
        placeholder: bool = False,
    ) -> Any:
        """The stages' load of `source` started (a handle for `finish_load`); placeholder:
        zeros for their non-expert tensors (`transfer_non_expert` brings them)."""
        self._frees = []
        self._sent, self._theirs = None, None
        dtype_name = str(dtype).removeprefix("torch.")
        return self.stages.send("load", source, dtype_name, rank, num_ranks, placement, placeholder)

    def finish_load(self, pending: Any) -> None:
        self._wait(pending, LOAD_TIMEOUT_S)

    def transfer_non_expert(
        self, group: group_mod.StatelessGroup, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> Callable[[], int]:
        """Every stage starts its part of the leaders' non-expert transfer over their transfer
        `group` (`StageWorker.transfer_non_expert`, beside the steps: over the stage's group of
        that epoch); returns the wait for it (the bytes the stages received)."""
        epoch = group.spec.epoch
        pending = self.stages.send("transfer_non_expert", epoch, list(src_ranks), list(dst_ranks))
        return lambda: sum(int(n) for n in self._wait(pending, LOAD_TIMEOUT_S))

    def prefetch(
        self,
        placement: policy.Placement,
        *,
        rank: int | None,
        num_ranks: int,
        epoch: int | None = None,
        moves: Sequence[Any] = (),
    ) -> Any:
        """Every stage starts bringing the experts it lacks for DP rank `rank` of `num_ranks`
        under `placement` (`StageWorker.prefetch`, beside the steps: the moves of its layers
        among the leaders' `moves` over its transfer group of `epoch`, the rest from the
        source; rank None: this DP rank leaves, its stages only send): the leader stages its
        own slots meanwhile (`ExpertSlots.stage_experts`); a handle for `finish_prefetch`."""
        return self.stages.send("prefetch", placement, rank, num_ranks, epoch, list(moves))

    def prestage(
        self, keys: Sequence[tuple[int, int]], epoch: int | None = None, moves: Sequence[Any] = ()
    ) -> Any:
        """Every stage starts bringing the experts `keys` ((MoE layer, logical), the model's
        numbering) of its layers that it lacks, kept for a later placement change
        (`StageWorker.prestage`: the pre-staging's `moves` of its layers over its transfer
        group of `epoch`, peer to peer, the rest from the source): a warm spare's leader
        pre-stages the same grows' experts of stage 0's layers meanwhile, and a serving
        leader's stages send theirs (`ExpertSlots.prestage_experts`); a handle for
        `finish_prefetch`."""
        return self.stages.send("prestage", [tuple(k) for k in keys], epoch, list(moves))

    def finish_prefetch(self, pending: Any) -> int:
        """Wait for `prefetch` or `prestage`; the experts the stages read from the source
        (counted for `take_prefetch_reads`)."""
        read = sum(int(n) for n in self._wait(pending, LOAD_TIMEOUT_S))
        with self._reads_lock:  # a staging's lane adds, the step thread takes
            self._prefetch_reads += read
        return read

    def take_prefetch_reads(self) -> int:
        """The experts the stages read from the source ahead of a switch (prefetches and
        pre-staging) since the last call."""
        with self._reads_lock:
            read, self._prefetch_reads = self._prefetch_reads, 0
        return read

    def drop_prestaged(self, keep: Sequence[tuple[int, int]]) -> None:
        """Every stage forgets its pre-staged experts not in `keep` (`StageWorker.
        drop_prestaged`)."""
        self._wait(self.stages.send("drop_prestaged", [tuple(k) for k in keep]), GROUP_TIMEOUT_S)

    # -- groups --------------------------------------------------------------------------
    def join(self, spec: group_mod.GroupSpec, rank: int, role: str = "step") -> None:
        """The leader joined the `role` group of `spec` as `rank`: every stage joins its own
        stage group of that epoch and role as `rank` (blocks until all DP ranks' stages
        joined)."""
        self._wait(self.stages.send("join", spec, rank, role), GROUP_TIMEOUT_S + 10.0)

    def abort(self, reason: str) -> None:
        """Let every stage's groups go now (a stage waiting in a collective stops)."""
        try:
            self.stages.abort(reason)
        except Exception:  # noqa: BLE001 - a dead stage has no group to abort
            log.debug("aborting the stages' groups failed", exc_info=True)

    def abort_join(self, epoch: int) -> None:
        """The leader's joins of `epoch` were called off (a member died before joining): so are
        its stages', which would otherwise wait for that member's stage until their timeout."""
        try:
            self.stages.abort_join(epoch)
        except Exception:  # noqa: BLE001 - a dead stage joins nothing
            log.debug("calling off the stages' joins of epoch %d failed", epoch, exc_info=True)

    # -- steps ---------------------------------------------------------------------------
    def free(self, seq_ids: Sequence[str]) -> None:
        """KV frees to send with the next forward pass (each stage frees them then)."""
        self._frees.extend(seq_ids)

    def send(
        self,
        model: decoder.MoEModel,
        batch: kv_mod.ForwardBatch,
        kv: kv_mod.KVCache,
        experts: experts_mod.ExpertBackend,
        *,
        epoch: int,
        token: Token,
        placement: policy.Placement,
        expert_load: torch.Tensor,
        parts: int = 1,
        tensor: tensor_group.TensorLeader | None = None,
        sample: Mapping[str, Sampling] | None = None,
    ) -> Sent:
        """Stage 0 here, each micro-batch handed to the stages as it is done (`receive`
        waits for their answers; meanwhile this leader may run stage 0 of the next step:
        `RankWorker.begin_step`). Each stage serves `placement` (its MoE layers' rows) as the
        leader's live `token` says: the placement goes with the first step of a new token
        (after an activate, a revert or an EPLB commit; a stage then takes the experts it
        lacks from the model source). On a failure the stages' groups are aborted (their
        peers must not wait for them) and the error raised.

        `parts` > 1: the batch goes through as that many micro-batches (`split`: whole
        sequences, about as many tokens each), stage 0 running micro-batch i + 1 while stage 1
        runs micro-batch i, so the stages work at once. Every DP rank must pass the same
        `parts` (each micro-batch is one round of every stage's expert collectives: an empty
        one still joins them); `micro_batches` derives it from what all of them see.
        `tensor`: stage 0's TP group (T > 1), its followers sent each micro-batch that has
        tokens (`TensorLeader.begin`/`end` around the leader's forward pass of it; in the
        mesh expert layout every micro-batch, with the live token). `sample` (by sequence id):
        the last stage samples each micro-batch and answers its tokens (`Stages.chain`), for
        the step graph's interleaved steps, whose leader never waits for the stages."""
        self.check()
        frees, self._frees = self._frees, []
        live: Live = (token, None if token == self._sent else placement)
        pieces = split(batch, parts)
        pending: list[Any] = []
        # in the mesh layout stage 0's followers follow the live token with stage 0's rows
        mesh = tensor is not None and tensor.mesh
        if mesh and (self._theirs is None or self._theirs[0] != token):
            self._theirs = (token, stage_placement(placement, model.pp))
        theirs = self._theirs if mesh else None
        try:
            for piece in pieces:
                # no token: no TP collective (in the mesh layout the followers join every
                # micro-batch's expert collectives)
                leading = tensor if piece.seq_ids or mesh else None
                following = None if leading is None else leading.begin(model, piece, live=theirs)
                try:
                    hidden = model.forward(piece, kv, experts, expert_load=expert_load)
                except Exception as exc:
                    if leading is not None:
                        leading.end(following, failed=exc)  # FollowerLost: the rank is lost
                    raise
                # frees with the first micro-batch: each stage frees before its first forward
                by = None if sample is None else [sample[i] for i in piece.seq_ids]
                pending.append(
                    self.stages.chain(epoch, [] if pending else frees, piece, hidden, live, by)
                )
                if leading is not None:
                    leading.end(following)
        except Exception as exc:
            if pending:
                self._sent = None  # a stage may have seen it
            else:
                self._frees[:0] = frees  # none sent: they go with the next forward pass
            self.abort(f"the leader's forward pass failed: {type(exc).__name__}")
            raise
        self._sent = token  # the next step's stages see it after this one's (in order)
        return Sent(pending, expert_load, model.device)

    def receive(self, sent: Sent) -> torch.Tensor:
        """The last stage's logits [seqs, vocab] of a step `send` handed to the stages, each
        stage's expert load added at its MoE layers (`sent.expert_load`)."""
        try:
            answers = [self._wait(p, STEP_TIMEOUT_S) for p in sent.pending]
        except Exception as exc:
            self._sent = None  # a stage may not have seen it
            self.abort(f"a pipeline stage's step failed: {type(exc).__name__}")
            raise
        self.step_reads = sum(int(a.get("reads", 0)) for each in answers for a in each)
        for each in answers:
            add_loads(sent.expert_load, each[-1]["loads"])
        outs = [each[-1]["out"] for each in answers]
        logits: torch.Tensor = (outs[0] if len(outs) == 1 else torch.cat(outs)).to(sent.device)
        return logits

    def failed(self, reason: str) -> None:
        """A step `send` handed to the stages failed there, as the step graph's driver found
        (`Stepper.settle`; `receive` does this itself): the stages' groups aborted, the next
        step's stages sent the placement again."""
        self._sent = None
        self.abort(reason)

    # -- health --------------------------------------------------------------------------
    def check(self) -> None:
        """StageLost once a stage died or hangs (its DP rank cannot step again)."""
        if self._lost is None:
            self._lost = self.stages.alive()
        if self._lost is not None:
            raise StageLost(self._lost)

    def _wait(self, pending: Any, timeout: float) -> list[Any]:
        try:
            return self.stages.wait(pending, timeout)
        except StageLost as exc:
            self._lost = str(exc)
            raise

    def close(self) -> None:
        self.abort("the leader shuts down")
