"""One lockstep step on a rank (`Stepper`, a part of `RankWorker`): the step's control, the KV
frees, the forward pass of this rank's batch through the live experts, and sampling.

Failures a step reports beyond its error (`StepOutput.failure`): the step group failed
(`semantics.GroupFailed`: a peer gone, an op timed out, the group aborted; NCCL shows it only
at the host read of the sampled tokens, so the group is checked after it; and a forward pass
that raised on this rank aborts the step group, whose peers may wait for it in a collective)
and the rank ran out of memory (`torch.cuda.OutOfMemoryError`, `MemoryError`): a rank
failure; the rank leaves every group at once (`RankContext.fail`), so no peer waits for it."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.comm import semantics
from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import pipeline_group as pipeline_mod
from moe_runtime.rank import sampling
from moe_runtime.rank import slots as slots_mod
from moe_runtime.rank import tensor_group as tensor_mod

log = logging.getLogger(__name__)

#: Seconds `Stepper.end` waits for its step's `begin`, and a `begin` with placeholders for the
#: steps begun before it to end.
END_WAIT_S = 300.0
#: Steps `Stepper.start` keeps for `settle` (the driver settles a step before it sends the one
#: P after it: P steps in flight, P <= 8 as the operator bounds it).
STARTED_KEPT = 8


@dataclasses.dataclass(eq=False)
class _Begun:
    """A step between `Stepper._begin` and `_end`: its output so far, and what sampling
    needs (`fwd` None: no forward pass to sample, or it failed and was undone)."""

    out: step_mod.StepOutput
    started: float
    errors: list[str] = dataclasses.field(default_factory=list)
    seqs: list[step_mod.SeqWork] = dataclasses.field(default_factory=list)
    fwd: kv_mod.ForwardBatch | None = None
    load: torch.Tensor | None = None
    kv: kv_mod.KVCache | None = None
    group: group_mod.StatelessGroup | None = None
    logits: torch.Tensor | None = None
    #: At P > 1: its micro-batches in the stages (`PipelineLeader.send`).
    sent: pipeline_mod.Sent | None = None


class Stepper:
    """Runs steps on one rank, one at a time (see `execute`), with the weights and KV cache of
    `ctx.loaded` and the live experts of `slots` (the backend, the rank; the EPLB commit a
    step's control carries)."""

    def __init__(
        self,
        ctx: context_mod.RankContext,
        *,
        slots: slots_mod.ExpertSlots,
        tensor: tensor_mod.TensorLeader | None = None,
        pipeline: pipeline_mod.PipelineLeader | None = None,
        parts: mesh_mod.MeshParts | None = None,
    ) -> None:
        self._ctx = ctx
        self._slots = slots
        #: In the mesh expert layout the followers' parts of the experts (`rank.mesh`): the
        #: followers join every step with a token anywhere (the expert collectives).
        self._parts = parts
        #: The rank's TP followers (T > 1): each forward pass with tokens runs on them too.
        self._tensor = tensor
        #: The rank's pipeline stages 1..P-1 (P > 1): every forward pass runs through them,
        #: an empty one too (their expert collectives need every DP rank's stage).
        self._pipeline = pipeline
        #: One step at a time: after a step timed out in the driver, the rebuilt step path
        #: (plain calls, another thread) must not start the next step on this rank while the
        #: old one still runs in the compiled graph's loop: both would use the step group at
        #: once and gloo aborts the process on the mismatched messages.
        self._lock = threading.RLock()
        #: Steps run since the rank started.
        self.steps = 0
        #: The token each sequence of the last step sampled: a `step.PLACEHOLDER` of the next
        #: step takes it (the engine sent that step before the last one's outputs came back).
        #: A step takes the entries of its sequences, so a failed step leaves none to take.
        self._sampled: dict[str, int] = {}
        #: torch's intra-op threads as set where the rank was built (Ray: the actor's CPUs).
        #: A step may run on another thread (a compiled graph's loop, an executor's pool),
        #: whose OpenMP team would otherwise take every core: on a busy machine each small
        #: op then waits for a descheduled thread (a 16-element cos took 5 ms, not 2 us).
        self._threads = torch.get_num_threads()
        self._threaded = threading.local()
        #: Steps `begin` started and `end` has not finished (`--pipeline-interleave`).
        self._begun: dict[int, _Begun] = {}
        self._ended = threading.Condition()
        #: The last steps `start` sent to the stages, for `settle` (newest last).
        self._started: collections.OrderedDict[int, _Begun] = collections.OrderedDict()

    def execute(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """Apply step.control, free KV, run this rank's batch, sample; never raises.

        An idle rank (no batch) still runs the forward pass with no tokens, so it joins the
        expert collectives; when no rank has a token, no rank runs it (and `expert_load` is
        None). When the control fails, or the batch is bad, the rank runs an empty
        batch instead (its peers must not hang in a collective) and reports the problem in
        StepOutput.error, as it does any exception (`StepOutput.failure` says when the step
        group or the rank itself is lost: module docstring). A failed forward pass leaves each
        sequence's KV cache as it was before the step, so the step can be retried as it was. An EPLB
        commit in the control is voted on by every rank (`StepOutput.committed` says whether
        this step committed it), whatever else fails on this rank.
        """
        self._set_threads()
        with self._lock:
            return self._end(self._begin(step))

    def begin(self, step: step_mod.StepInput) -> None:
        """`execute`'s first part at P > 1 (`--pipeline-interleave`): the step's control, KV
        frees and stage 0, its micro-batches handed to the stages; `end` (another thread)
        waits for them and samples. So this leader runs stage 0 of the next step while the
        stages run this one. A step that fills a placeholder waits for the steps begun
        before it to end first (it needs the tokens they sample)."""
        self._set_threads()
        mine = step.batches.get(-1 if self._slots.rank is None else self._slots.rank)
        if mine is not None and any(s.token_ids[-1:] == [step_mod.PLACEHOLDER] for s in mine.seqs):
            with self._ended:
                if not self._ended.wait_for(lambda: not self._begun, END_WAIT_S):
                    log.warning(
                        "step %d: steps %s never ended (%s)",
                        step.step_id,
                        sorted(self._begun),
                        self._ctx.where(),
                    )
        with self._lock:
            with self._ended:
                earlier = bool(self._begun)  # still in the later stages
            begun = self._begin(step)
            begun.out.overlapped = earlier and begun.sent is not None
        with self._ended:
            self._begun[step.step_id] = begun
            self._ended.notify_all()

    def end(self, step_id: int, timeout: float = END_WAIT_S) -> step_mod.StepOutput:
        """The output of step `step_id` that `begin` started (waits for its begin, at most
        `timeout` s, then for its stages; samples)."""
        with self._ended:
            if not self._ended.wait_for(lambda: step_id in self._begun, timeout):
                raise TimeoutError(f"step {step_id} was not begun on this rank in {timeout:.0f} s")
            begun = self._begun[step_id]
        try:
            return self._end(begun)
        finally:
            with self._ended:
                del self._begun[step_id]
                self._ended.notify_all()

    def start(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """An interleaved step of the step graph at P > 1 (`ray_graph`): `begin` whose last
        stage samples. Returns once stage 0 handed every micro-batch to the stages, with the
        leader's part of the output (control, errors, stage 0's expert load); the driver adds
        the last stage's tokens and the stages' loads (`ray_mesh.merged`). So this leader's
        graph loop never waits for a later stage and runs the next step's stage 0 beside
        this one's. A step whose stages failed is `settle`d."""
        assert self._pipeline is not None, "start: a pipeline leader's step"
        self._set_threads()
        with self._lock:
            begun = self._begin(step, staged=True)
            out = begun.out
            if begun.fwd is not None and begun.load is not None:
                out.expert_load = begun.load.cpu()  # stage 0's layers: the driver adds theirs
                if self._ctx.loaded.total_load is not None:
                    self._ctx.loaded.total_load += out.expert_load
                out.prefetch_reads = self._pipeline.take_prefetch_reads()
                self._started[step.step_id] = begun
                while len(self._started) > STARTED_KEPT:
                    self._started.popitem(last=False)
            self.steps += 1
        if begun.errors:
            out.error = "; ".join(begun.errors)
        out.started_at = begun.started
        out.seconds = time.monotonic() - begun.started
        return out

    def settle(self, step_id: int, error: str, *, lost: bool = False) -> str | None:
        """A `start`ed step whose stages failed (`error`, as the driver read it from the
        graph): each of its sequences' KV cache back to before the step (the engine sends it
        again), the step group and the stages' groups let go; `lost`: a stage lost a TP
        follower (so is this DP rank). What the failure broke (`StepOutput.failure`)."""
        assert self._pipeline is not None, "settle: a pipeline leader's step"
        exc = (pipeline_mod.StageLost if lost else RuntimeError)(error)
        with self._lock:
            begun = self._started.pop(step_id, None)
            if begun is not None and begun.fwd is not None:
                self._undo(begun, exc)
            else:
                log.warning("step %d: not kept, nothing undone (%s)", step_id, self._ctx.where())
        self._pipeline.failed(f"a pipeline stage's step failed: {error}")
        log.error("step %d failed in the stages: %s (%s)", step_id, error, self._ctx.where())
        return self._failure(exc)

    def _set_threads(self) -> None:
        if not getattr(self._threaded, "set", False):
            torch.set_num_threads(self._threads)
            self._threaded.set = True

    def _begin(self, step: step_mod.StepInput, *, staged: bool = False) -> _Begun:
        slots = self._slots
        rank = -1 if slots.rank is None else slots.rank
        out = step_mod.StepOutput(rank=rank, step_id=step.step_id)
        begun = _Begun(out=out, started=time.monotonic())
        errors = begun.errors
        batch = step.batches.get(rank) or step_mod.RankBatch()
        run_batch = True
        filled = self._filled(batch.seqs)
        try:
            self._ctx.check("execute_step")
        except Exception as exc:  # noqa: BLE001 - reported; the rank still joins the step
            log.exception(
                "step %d: failing as armed, running empty (%s)", step.step_id, self._ctx.where()
            )
            errors.append(f"{type(exc).__name__}: {exc}")
            run_batch = False
        if step.control:
            try:
                out.committed = self._apply_control(step.control)
            except Exception as exc:  # noqa: BLE001 - reported; the rank still joins the step
                log.exception(
                    "step %d: control failed, running empty (%s)", step.step_id, self._ctx.where()
                )
                errors.append(f"{type(exc).__name__}: {exc}")
                run_batch = False
        try:
            cfg, model = self._ctx.loaded.require(self._ctx.where())
            backend, kv = slots.backend, self._ctx.loaded.kv
            if backend is None or kv is None:
                raise RuntimeError(f"rank not activated ({self._ctx.where()})")
            for seq_id in batch.free:
                kv.free(seq_id)
                self._sampled.pop(seq_id, None)
            if self._tensor is not None:
                self._tensor.free(batch.free)
            if self._pipeline is not None:
                self._pipeline.free(batch.free)
            seqs = filled if run_batch else []
            bad = _invalid(seqs, cfg, kv)
            if bad:
                errors.append(f"invalid sequences, step ran empty: {bad}")
                seqs = []
            # When no rank has a token, every rank reads that from the same StepInput and all
            # of them skip the forward pass and its expert collectives: none waits for a peer.
            if any(b.seqs for b in step.batches.values()):
                self._forward(step, begun, seqs, model, kv, backend, cfg, staged=staged)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, never kills the actor
            self._failed(step.step_id, begun, exc)
        return begun

    def _forward(
        self,
        step: step_mod.StepInput,
        begun: _Begun,
        seqs: list[step_mod.SeqWork],
        model: Any,
        kv: kv_mod.KVCache,
        backend: Any,
        cfg: config_mod.ModelConfig,
        *,
        staged: bool = False,
    ) -> None:
        """The forward pass of `seqs` (at P > 1: stage 0, the rest handed to the stages;
        `staged`: the last stage samples, `start`)."""
        slots = self._slots
        fwd = kv_mod.ForwardBatch(
            seq_ids=[s.seq_id for s in seqs],
            token_ids=[list(s.token_ids) for s in seqs],
            start_pos=[s.start_pos for s in seqs],
        )
        # counted where the routing runs: no host read per layer
        load = torch.zeros(
            cfg.num_moe_layers, cfg.num_experts, dtype=torch.int64, device=self._ctx.device
        )
        step_group = getattr(backend, "group", None)
        if not isinstance(step_group, group_mod.StatelessGroup):
            step_group = None
        begun.seqs, begun.fwd, begun.load, begun.kv, begun.group = seqs, fwd, load, kv, step_group
        following = None
        # no token: no TP collective; in the mesh layout the followers join the
        # expert collectives of every step with a token anywhere
        mesh = self._parts is not None
        tensor = self._tensor if seqs or mesh else None
        # the live state the stages or the mesh layout's followers follow
        epoch, placement = slots.epoch, slots.placement
        rank = -1 if slots.rank is None else slots.rank
        token = (epoch or 0, slots.origin, rank, slots.num_ranks or 0)
        try:
            self._ctx.check("forward")
            if tensor is not None and self._pipeline is None:
                assert not mesh or placement is not None
                live = (token, placement) if mesh else None
                following = tensor.begin(model, fwd, live=live)
            if self._pipeline is not None:
                assert epoch is not None and placement is not None
                begun.out.micro_batches = self._micro_batches(step)
                begun.sent = self._pipeline.send(
                    model,
                    fwd,
                    kv,
                    backend,
                    epoch=epoch,
                    token=token,
                    placement=placement,
                    expert_load=load,
                    parts=begun.out.micro_batches,
                    tensor=tensor,  # stage 0's TP followers, per micro-batch
                    sample={s.seq_id: (s.sampling, s.num_generated) for s in seqs}
                    if staged
                    else None,
                )
            else:
                begun.logits = model.forward(fwd, kv, backend, expert_load=load)
            if tensor is not None and following is not None:
                tensor.end(following)
                following = None
        except Exception as exc:
            raised: Exception = exc
            if tensor is not None and following is not None:
                try:
                    tensor.end(following, failed=exc)
                except tensor_mod.FollowerLost as lost:
                    raised = lost  # what broke: the DP rank is lost
            self._undo(begun, exc)
            if raised is not exc:
                raise raised from exc
            raise

    def _undo(self, begun: _Begun, exc: Exception) -> None:
        """A failed forward pass: the KV state back to before the step (the same step can be
        sent again); the step group let go (peers may wait for this rank in an expert
        collective it will not join: gloo raises at once there; a new epoch's groups replace
        it)."""
        assert begun.kv is not None and begun.fwd is not None
        with self._lock:  # `end` runs beside a later `begin`, which uses the cache
            tensor_mod.restore_kv(begun.kv, begun.fwd)
        begun.fwd = None  # nothing to sample
        if begun.group is not None:
            begun.group.abort(f"the forward pass failed: {type(exc).__name__}")

    def _end(self, begun: _Begun) -> step_mod.StepOutput:
        """The step's sampling (at P > 1 once its last stage answered) and its output."""
        out = begun.out
        try:
            if begun.fwd is not None:
                self._sample(begun)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, never kills the actor
            self._failed(out.step_id, begun, exc)
        finally:
            self.steps += 1
        if begun.errors:
            out.error = "; ".join(begun.errors)
        out.seconds = time.monotonic() - begun.started
        return out

    def _sample(self, begun: _Begun) -> None:
        out, seqs, load = begun.out, begun.seqs, begun.load
        assert load is not None and begun.fwd is not None
        try:
            if begun.sent is not None:
                assert self._pipeline is not None
                begun.logits = self._pipeline.receive(begun.sent)
            assert begun.logits is not None
            # One host read: the tokens (it waits for the step's collectives).
            tokens = sampling.sample(
                begun.logits, [s.sampling for s in seqs], [s.num_generated for s in seqs]
            )
            if begun.group is not None:
                begun.group.check()  # NCCL's errors show only now (module docstring)
        except Exception as exc:
            self._undo(begun, exc)
            raise
        out.tokens = {s.seq_id: token for s, token in zip(seqs, tokens, strict=True)}
        self._sampled.update(out.tokens)
        if self._pipeline is not None:
            out.source_reads = self._pipeline.step_reads
            out.prefetch_reads = self._pipeline.take_prefetch_reads()
        elif self._parts is not None and self._tensor is not None:
            out.source_reads = self._tensor.step_reads
            out.prefetch_reads = self._parts.take_prefetch_reads()
        out.expert_load = load.cpu()
        if self._ctx.loaded.total_load is not None:
            self._ctx.loaded.total_load += out.expert_load

    def _failed(self, step_id: int, begun: _Begun, exc: Exception) -> None:
        log.exception("step %d failed (%s)", step_id, self._ctx.where(), exc_info=exc)
        begun.errors.append(f"{type(exc).__name__}: {exc}")
        begun.out.failure = self._failure(exc)

    def _filled(self, seqs: Sequence[step_mod.SeqWork]) -> list[step_mod.SeqWork]:
        """The batch with each `step.PLACEHOLDER` replaced by the token this rank sampled for
        that sequence in its last step; every sequence's entry is taken (a step that fails
        records none, so the step sent after it finds none: `_invalid` names it)."""
        out = []
        for s in seqs:
            sampled = self._sampled.pop(s.seq_id, None)
            if s.token_ids and s.token_ids[-1] == step_mod.PLACEHOLDER and sampled is not None:
                s = dataclasses.replace(s, token_ids=[*s.token_ids[:-1], sampled])
            out.append(s)
        return out

    def _micro_batches(self, step: step_mod.StepInput) -> int:
        """The micro-batches of this step through the stages (`pipeline_group.
        micro_batches`), from every DP rank's batch: the same on all of them."""
        assert self._pipeline is not None
        return pipeline_mod.micro_batches(
            self._pipeline.size,
            [[len(s.token_ids) for s in b.seqs] for b in step.batches.values()],
            self._pipeline.micro_batch_tokens,
        )

    def _failure(self, exc: BaseException) -> str | None:
        """What a step's exception broke (`StepOutput.failure`); out of memory fails the rank
        here (it leaves every group: no peer waits for it)."""
        if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
            self._ctx.fail(f"out of memory in a step: {type(exc).__name__}: {exc}")
            return step_mod.FAILURE_RANK
        if isinstance(exc, pipeline_mod.StageLost):
            self._ctx.fail(f"a pipeline stage is lost: {exc}")
            return step_mod.FAILURE_RANK
        if isinstance(exc, tensor_mod.FollowerLost):
            self._ctx.fail(f"a tensor-parallel follower is lost: {exc}")
            return step_mod.FAILURE_RANK
        step_group = getattr(self._slots.backend, "group", None)
        failed = isinstance(step_group, group_mod.StatelessGroup) and step_group.failure is not None
        if failed or isinstance(exc, semantics.GroupFailed):
            return step_mod.FAILURE_GROUP
        return None

    def _apply_control(self, control: Mapping[str, Any]) -> int | None:
        """Apply a step's control; returns the staging id committed in this step, if any."""
        committed = None
        for key, value in control.items():
            if key == step_mod.CONTROL_EXPERT_EPOCH:
                if self._slots.commit_vote(int(value)):
                    committed = int(value)
            else:
                log.debug("ignoring unknown control %r (%s)", key, self._ctx.where())
        return committed


def _invalid(
    seqs: Sequence[step_mod.SeqWork],
    cfg: config_mod.ModelConfig,
    kv: kv_mod.KVCache,
) -> list[str]:
    """The sequences of a batch this rank cannot run, each with its problem."""
    bad: list[str] = []
    seen: set[str] = set()
    for s in seqs:
        problem = None
        if s.seq_id in seen:
            problem = "duplicate"
        elif not s.token_ids:
            problem = "no tokens"
        elif s.token_ids[-1] == step_mod.PLACEHOLDER:
            problem = "no token sampled in the last step to fill its placeholder"
        elif min(s.token_ids) < 0 or max(s.token_ids) >= cfg.vocab_size:
            problem = f"token ids outside [0, {cfg.vocab_size})"
        elif s.start_pos < 0 or s.start_pos > kv.num_tokens(s.seq_id):
            problem = f"start_pos {s.start_pos} but {kv.num_tokens(s.seq_id)} cached"
        elif s.start_pos + len(s.token_ids) > cfg.max_position_embeddings:
            problem = f"longer than {cfg.max_position_embeddings} positions"
        seen.add(s.seq_id)
        if problem is not None:
            bad.append(f"{s.seq_id}: {problem}")
    return bad
