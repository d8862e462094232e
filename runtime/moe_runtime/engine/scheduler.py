"""Which sequence runs where, and what each rank does in the next step (`Scheduler`, a part of
`core.Engine`, owned by the engine thread).

- Sequences (`Seq`): a request's running state: its tokens, the rank whose KV cache holds it,
  how many of its tokens are computed. Its uncomputed tokens are `tokens[num_computed:]`,
  which covers prefill (the prompt), decode (the last sampled token) and re-prefill after a
  migration (prompt + generated so far) with one rule.
- Ranks: the active ones step (every one gets a `RankBatch` in every step, empty when idle:
  expert parallelism needs every rank in the collectives); draining ones take no new
  sequence. A new sequence goes to the least loaded assignable rank.
- One step's batches (`schedule`): every running sequence gets the next slice of its
  uncomputed tokens within the per-rank token budget (decodes first, one token each; then
  prefill chunks in arrival order), and the KV frees owed to each rank.
- The changes a resize or a recovery makes at a step boundary (`set_active`, `migrate`,
  `drain`, `relabel`): sequences on leaving ranks are re-prefilled on others with prompt +
  generated tokens (same `num_generated`, so seeded sampling goes on identically); after an
  executor switch renumbers its workers, sequences, KV frees and marks follow their worker.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from moe_runtime import step as step_types
from moe_runtime.engine import request as req
from moe_runtime.engine import text as text_mod

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Seq:
    """One running request on one rank (see the module docstring)."""

    handle: req.RequestHandle
    tokens: list[int]
    prompt_len: int
    text: text_mod.IncrementalText
    rank: int
    num_computed: int = 0
    #: KV positions held for it on its rank (`Scheduler.kv_need`), counted against the budget
    kv_reserved: int = 0
    dirty: bool = False  # this rank may hold KV of the sequence
    failures: int = 0

    @property
    def seq_id(self) -> str:
        return self.handle.request_id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class Work:
    """What one sequence runs in one step: `num_tokens` of its tokens on `rank`."""

    seq: Seq
    rank: int
    num_tokens: int


class Scheduler:
    """Running sequences, the ranks they run on, and the batches of the next step.

    max_num_seqs_per_rank: sequences a rank takes; max_tokens_per_step: token budget of one
    rank in one step; kv_tokens_per_rank: KV positions a rank's cache holds (None: no bound),
    counted in blocks of kv_block_size (`core.EngineConfig`); kv_budget: that bound for a
    number of active ranks, re-derived when they change (a shrink gives survivors more
    experts: less room on a GPU; sequences already running keep their reservations, new ones
    wait for room).
    """

    def __init__(
        self,
        *,
        ranks: Iterable[int],
        max_num_seqs_per_rank: int,
        max_tokens_per_step: int,
        kv_tokens_per_rank: int | None = None,
        kv_block_size: int = 16,
        kv_budget: Callable[[int], int] | None = None,
    ) -> None:
        self.max_num_seqs_per_rank = max_num_seqs_per_rank
        self.max_tokens_per_step = max_tokens_per_step
        self.kv_block_size = kv_block_size
        self.kv_budget = kv_budget
        self.active: list[int] = sorted(set(ranks))
        self.kv_tokens_per_rank = (
            kv_tokens_per_rank if kv_budget is None else kv_budget(len(self.active))
        )
        self.draining: set[int] = set()
        self.running: dict[str, Seq] = {}
        #: KV frees owed to each rank, sent with its next batch.
        self.pending_free: dict[int, list[str]] = {}

    def free_later(self, rank: int, seq_ids: Iterable[str]) -> None:
        """Free those sequences' KV on `rank` in the next step that reaches it."""
        ids = list(seq_ids)
        if ids:
            self.pending_free.setdefault(rank, []).extend(ids)

    def must_step(self) -> bool:
        """A step has work: running sequences or KV frees owed."""
        return bool(self.running or any(self.pending_free.values()))

    # -- placing sequences ---------------------------------------------------------------
    def load(self) -> dict[int, int]:
        """Running sequences per active rank."""
        load = dict.fromkeys(self.active, 0)
        for seq in self.running.values():
            load[seq.rank] = load.get(seq.rank, 0) + 1
        return load

    def kv_need(self, num_tokens: int) -> int:
        """KV positions a sequence of up to `num_tokens` tokens reserves: whole blocks, at
        most a rank's budget."""
        bs = self.kv_block_size
        need = -(-num_tokens // bs) * bs
        return need if self.kv_tokens_per_rank is None else min(need, self.kv_tokens_per_rank)

    def kv_used(self) -> dict[int, int]:
        """KV positions reserved per active rank."""
        used = dict.fromkeys(self.active, 0)
        for seq in self.running.values():
            used[seq.rank] = used.get(seq.rank, 0) + seq.kv_reserved
        return used

    def least_loaded(self, exclude: set[int] | None = None, *, kv: int = 0) -> int | None:
        """The active, not draining rank with room (a sequence slot and `kv` KV positions)
        and the fewest sequences (None: none)."""
        load = self.load()
        used = self.kv_used()
        budget = self.kv_tokens_per_rank
        candidates = [
            (load[r], r)
            for r in self.active
            if r not in self.draining
            and (exclude is None or r not in exclude)
            and load[r] < self.max_num_seqs_per_rank
            and (budget is None or used[r] + kv <= budget)
        ]
        return min(candidates)[1] if candidates else None

    def admit(
        self, handle: req.RequestHandle, max_model_len: int, tokenizer: text_mod.Decoder
    ) -> bool:
        """Runs `handle`'s request on the least loaded rank with a sequence slot and KV room
        for its prompt + max_tokens (True), or does nothing (False: no rank has room)."""
        request = handle.request
        kv_need = self.kv_need(
            min(len(request.prompt_token_ids) + request.max_tokens, max_model_len)
        )
        rank = self.least_loaded(kv=kv_need)
        if rank is None:
            return False
        self.running[request.request_id] = Seq(
            handle=handle,
            tokens=list(request.prompt_token_ids),
            prompt_len=len(request.prompt_token_ids),
            text=text_mod.IncrementalText(tokenizer, stop=request.stop),
            rank=rank,
            kv_reserved=kv_need,
        )
        return True

    def schedule(self) -> tuple[dict[int, step_types.RankBatch], list[Work]]:
        """The next step's batch of every active rank, and the work it carries."""
        batches = self.take_frees()
        work: list[Work] = []
        views = [(s, s.num_computed, len(s.tokens)) for s in self.running.values()]
        for seq, start, n in self.plan(views):
            batches[seq.rank].seqs.append(
                step_types.SeqWork(
                    seq_id=seq.seq_id,
                    token_ids=seq.tokens[start : start + n],
                    start_pos=start,
                    sampling=seq.handle.request.sampling,
                    num_generated=seq.num_generated,
                )
            )
            seq.dirty = True
            work.append(Work(seq=seq, rank=seq.rank, num_tokens=n))
        return batches, work

    def take_frees(self) -> dict[int, step_types.RankBatch]:
        """An empty batch for every active rank carrying the KV frees owed to it (taken)."""
        batches = {rank: step_types.RankBatch() for rank in self.active}
        for rank, ids in self.pending_free.items():
            if rank in batches:
                batches[rank].free.extend(ids)
        self.pending_free = {}
        return batches

    def plan(self, views: Iterable[tuple[Seq, int, int]]) -> list[tuple[Seq, int, int]]:
        """Which tokens run in a step, given each sequence as (seq, tokens computed, tokens
        it has): (seq, start, count) within every active rank's token budget, decodes first
        (one token each), then prefill chunks in arrival order. Pure: `schedule` passes the
        sequences as they are, `prepare` as they will be after the step in flight."""
        budget = dict.fromkeys(self.active, self.max_tokens_per_step)
        views = list(views)
        decodes = [v for v in views if v[2] - v[1] == 1]
        prefills = [v for v in views if v[2] - v[1] > 1]
        slices: list[tuple[Seq, int, int]] = []
        for seq, computed, length in decodes + prefills:
            left = budget.get(seq.rank, 0)
            if left <= 0:
                continue
            n = min(length - computed, left)
            budget[seq.rank] = left - n
            slices.append((seq, computed, n))
        return slices

    # -- what a resize changes (at a step boundary) ----------------------------------------
    def drain(self, leaving: set[int]) -> list[str]:
        """Those ranks take no new sequence; returns the ids of the sequences on them."""
        self.draining |= leaving & set(self.active)
        return [s.seq_id for s in self.running.values() if s.rank in leaving]

    def migrate(self, leaving: set[int]) -> list[str]:
        """Move the sequences of `leaving` to other active ranks (re-prefilled there); those
        ranks are marked draining. Returns the ids moved."""
        self.draining |= leaving & set(self.active)
        moved: list[str] = []
        for seq in list(self.running.values()):
            if seq.rank not in leaving:
                continue
            target = self.least_loaded(exclude=leaving, kv=seq.kv_reserved)
            if target is None:
                # Over capacity: the survivors take it anyway (the limits are a batching
                # preference and an admission bound; a rank's cache grows past its budget
                # rather than lose the request).
                survivors = [r for r in self.active if r not in leaving and r not in self.draining]
                if not survivors:
                    raise RuntimeError(f"no rank left to take the sequences of ranks {leaving}")
                load = self.load()
                target = min(survivors, key=lambda r: (load[r], r))
            if seq.dirty:
                self.free_later(seq.rank, [seq.seq_id])
            log.info(
                "engine: migrating %s from rank %d to rank %d (%d tokens to re-prefill)",
                seq.seq_id,
                seq.rank,
                target,
                len(seq.tokens),
            )
            seq.rank = target
            seq.num_computed = 0
            seq.dirty = False
            moved.append(seq.seq_id)
        return moved

    def set_active(self, ranks: list[int]) -> None:
        """Step exactly `ranks` from now on; sequences on leaving ranks migrate first."""
        old = list(self.active)
        leaving = set(old) - set(ranks)
        # While migrating, the leaving ranks still count as active (their KV is freed in the
        # next step, which they still receive); then only `ranks` step.
        self.active = sorted(set(ranks) | leaving)
        if leaving:
            self.migrate(leaving)
        self.active = list(ranks)
        self.draining = set()
        if self.kv_budget is not None and self.active:
            budget = self.kv_budget(len(self.active))
            if budget != self.kv_tokens_per_rank:
                log.info(
                    "engine: KV budget %s -> %d positions a rank at %d ranks",
                    self.kv_tokens_per_rank,
                    budget,
                    len(self.active),
                )
            self.kv_tokens_per_rank = budget
        # Ranks that no longer step read no StepInput: their KV goes away with them.
        dropped = {r: ids for r, ids in self.pending_free.items() if r not in ranks and ids}
        self.pending_free = {r: ids for r, ids in self.pending_free.items() if r in ranks}
        if dropped:
            log.info("engine: KV frees for leaving ranks dropped: %s", dropped)
        log.info("engine: active ranks %s -> %s", old, self.active)

    def relabel(self, mapping: dict[int, int]) -> None:
        """Rank `old` is now `mapping[old]` (others keep theirs); ValueError, and nothing
        changes, when two known ranks would get one label."""

        def new(rank: int) -> int:
            return mapping.get(rank, rank)

        known = set(self.active) | self.draining | set(self.pending_free)
        known |= {seq.rank for seq in self.running.values()}
        if len({new(r) for r in known}) != len(known):
            raise ValueError(
                f"relabel mapping {mapping} sends two of ranks {sorted(known)} to one label"
            )
        self.active = sorted(new(r) for r in self.active)
        self.draining = {new(r) for r in self.draining}
        for seq in self.running.values():
            seq.rank = new(seq.rank)
        self.pending_free = {new(r): ids for r, ids in self.pending_free.items()}
        log.info("engine: ranks relabelled %s; active ranks %s", mapping, self.active)
