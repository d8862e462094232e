"""Async scheduling: step N+1 prepared while the ranks run step N (`EngineConfig.
async_scheduling`), so that the ranks wait only for N's outputs to be applied and N+1 patched.

- `prepare(scheduler, inflight)` is pure (it reads the scheduler and changes nothing): it plans
  the next step as if the step in flight succeeds for every sequence. A sequence whose tokens
  are all computed by then samples one more token in flight: its next slice is a one-token
  decode at a known position whose id is not known yet (`PLACEHOLDER` in `SeqWork.token_ids`);
  a prefill chunk that is not the last is followed by the next chunk (its tokens are known); a
  sequence the step does not run (admitted meanwhile, or beyond a rank's token budget) gets its
  slice as `Scheduler.schedule` would. Per-rank token budgets are `Scheduler.plan`'s.
- `commit(prepared, scheduler)` runs once N's outputs are applied (tokens appended, finishes
  decided, frees owed): the prepared step becomes the real one, the placeholders filled with
  the sampled tokens, the sequences no longer running (finished, aborted, failed past their
  retries) dropped, the KV frees owed taken as `schedule` takes them. When anything differs
  from what the preparation assumed (the active ranks, a sequence's rank, computed tokens or
  length: a retry, a migration, a relabel) it returns None and changes nothing: the caller
  falls back to `Scheduler.schedule`. So a committed step is what `schedule` would send for
  each sequence it holds; only the split of the token budget may differ.
- `launch_ahead(prepared, scheduler, max_model_len=)` (two steps in flight,
  `EngineConfig.overlap_steps`) makes the prepared step the real one *before* the step in
  flight lands: its placeholders stay for the ranks to fill with the tokens they sample, a
  sequence the step in flight ends by length is left out, and each slice carries the state
  its sequence must have once the step in flight is applied (`Ahead.assumed`): where it has
  not (it finished on a stop token, was aborted or re-prefilled), its slice's output is not
  applied (`outputs.Outputs.land`) and its KV past that state is cut by the next step's
  start position.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from moe_runtime import step as step_types
from moe_runtime.engine import scheduler as scheduler_mod
from moe_runtime.engine import step_groups as groups_mod

log = logging.getLogger(__name__)

#: The id of a token sampled by the step in flight, in a prepared `SeqWork.token_ids`.
PLACEHOLDER = step_types.PLACEHOLDER


@dataclasses.dataclass(frozen=True)
class Entry:
    """One sequence's slice of the prepared step, and the state it assumes.

    rank, start, length: the sequence's rank, computed tokens and token count once the step
    in flight is applied; work: its `SeqWork` (a `PLACEHOLDER` last when the step in flight
    samples that token).
    """

    seq: scheduler_mod.Seq
    rank: int
    start: int
    length: int
    work: step_types.SeqWork


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The next step planned while one runs; `active`: the ranks it was planned for."""

    active: tuple[int, ...]
    entries: list[Entry]
    #: The interleaved step group it takes (None: every sequence; `engine.step_groups`).
    group: int | None = None


def prepare(scheduler: scheduler_mod.Scheduler, inflight: Sequence[scheduler_mod.Work]) -> Prepared:
    """The step after the ones running `inflight`, assuming they succeed (pure)."""
    running = scheduler.running
    after: dict[str, int] = {}
    for w in inflight:  # a sequence in two steps in flight: both slices
        after[w.seq.seq_id] = after.get(w.seq.seq_id, w.seq.num_computed) + w.num_tokens
    views: list[tuple[scheduler_mod.Seq, int, int]] = []
    for seq in running.values():
        computed = after.get(seq.seq_id, seq.num_computed)
        length = len(seq.tokens)
        if seq.seq_id in after and computed >= length:
            length += 1  # the step in flight samples its next token
        views.append((seq, computed, length))
    lengths = {seq.seq_id: length for seq, _, length in views}
    group = scheduler.group_of(views)
    entries: list[Entry] = []
    for seq, start, n in scheduler.plan(groups_mod.of(views, group)):
        length = lengths[seq.seq_id]
        ids = seq.tokens[start : start + n]
        ids += [PLACEHOLDER] * (start + n - len(seq.tokens))  # at most one, last
        work = step_types.SeqWork(
            seq_id=seq.seq_id,
            token_ids=ids,
            start_pos=start,
            sampling=seq.handle.request.sampling,
            num_generated=length - seq.prompt_len,
        )
        entries.append(Entry(seq=seq, rank=seq.rank, start=start, length=length, work=work))
    return Prepared(active=tuple(scheduler.active), entries=entries, group=group)


def prepare_or_none(
    scheduler: scheduler_mod.Scheduler, inflight: Sequence[scheduler_mod.Work], step_id: int
) -> Prepared | None:
    """`prepare`, or None where it raised (logged): the step is then scheduled afresh (the
    preparation is pure: nothing to undo)."""
    try:
        return prepare(scheduler, inflight)
    except Exception:
        log.exception("engine: preparing step %d failed", step_id)
        return None


def commit(
    prepared: Prepared, scheduler: scheduler_mod.Scheduler
) -> tuple[dict[int, step_types.RankBatch], list[scheduler_mod.Work]] | None:
    """The prepared step as the real one (the step in flight applied), or None, changing
    nothing, when it might be wrong or holds no sequence (then `schedule`)."""
    keep = _running(prepared, scheduler)
    if not keep:
        return None
    for entry in keep:
        seq = entry.seq
        if (seq.rank, seq.num_computed, len(seq.tokens)) != (
            entry.rank,
            entry.start,
            entry.length,
        ):
            return None  # retried, migrated, relabelled: not the state it was planned for
    for entry in keep:
        ids = entry.work.token_ids
        if ids[-1] == PLACEHOLDER:
            ids[-1] = entry.seq.tokens[entry.start + len(ids) - 1]
    return _made(keep, scheduler, prepared.group)


def _running(prepared: Prepared, scheduler: scheduler_mod.Scheduler) -> list[Entry] | None:
    """The prepared slices whose sequence still runs (one that finished or was aborted has its
    KV free owed: `Outputs.finish`); None when the active ranks changed."""
    if tuple(scheduler.active) != prepared.active:
        return None
    running = scheduler.running
    return [e for e in prepared.entries if running.get(e.seq.seq_id) is e.seq]


def _made(
    keep: list[Entry], scheduler: scheduler_mod.Scheduler, group: int | None
) -> tuple[dict[int, step_types.RankBatch], list[scheduler_mod.Work]]:
    """The step of `keep`'s slices (of step group `group`), with the KV frees owed (taken)."""
    batches = scheduler.take_frees()
    work: list[scheduler_mod.Work] = []
    for entry in keep:
        batches[entry.rank].seqs.append(entry.work)
        entry.seq.dirty = True
        work.append(
            scheduler_mod.Work(seq=entry.seq, rank=entry.rank, num_tokens=len(entry.work.token_ids))
        )
    scheduler.took(group)
    return batches, work


@dataclasses.dataclass(frozen=True)
class Ahead:
    """A prepared step made real before the step in flight lands (`launch_ahead`)."""

    batches: dict[int, step_types.RankBatch]
    work: list[scheduler_mod.Work]
    #: {seq_id: (rank, computed tokens, token count)} once the step in flight is applied.
    assumed: dict[str, tuple[int, int, int]]


def launch_ahead(
    prepared: Prepared,
    scheduler: scheduler_mod.Scheduler,
    *,
    max_model_len: int,
    placeholders: bool = True,
) -> Ahead | None:
    """The prepared step as the real one while the step it follows is still in flight, or
    None, changing nothing, when it holds no sequence or the ranks changed (see the module
    docstring). `placeholders` False (an executor whose ranks may not fill them: an
    interleaved step graph's leaders never sample): without the sequences of the step in
    flight, which wait for it."""
    keep: list[Entry] = []
    for entry in _running(prepared, scheduler) or []:
        seq = entry.seq
        if entry.work.token_ids[-1] == PLACEHOLDER:
            if not placeholders:
                continue
            request = seq.handle.request
            if entry.length - seq.prompt_len >= request.max_tokens:
                continue  # the step in flight samples its last token
            if entry.length >= max_model_len:
                continue  # ... or fills its context
        keep.append(entry)
    if not keep:
        return None
    batches, work = _made(keep, scheduler, prepared.group)
    assumed = {e.seq.seq_id: (e.rank, e.start, e.length) for e in keep}
    return Ahead(batches=batches, work=work, assumed=assumed)
