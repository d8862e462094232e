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
  prefill chunks in arrival order), and the KV frees owed to each rank. With interleaved
  step groups (`step_groups` > 1, `engine.step_groups`) only the sequences of one set, the
  sets in turn.
- The changes a resize or a recovery makes at a step boundary (`set_active`, `migrate`,
  `drain`, `relabel`): sequences on leaving ranks are re-prefilled on others with prompt +
  generated tokens (same `num_generated`, so seeded sampling goes on identically); after an
  executor switch renumbers its workers, sequences, KV frees and marks follow their worker.
- The KV budget (`kv_budgets`: positions per active rank, from `kv_budget(ranks, slots)`,
  re-derived by `set_active` from the expert slots each rank will hold). A migrated sequence
  that no survivor has room for (a sequence slot and its KV reservation), and a sequence a
  new, smaller budget no longer holds before it has computed anything on its rank, waits in
  `waiting`, ahead of the request queue, with its tokens; `place_waiting` (admission) re-places
  it when room frees, re-prefilled with prompt + generated tokens like any migration. So no
  rank's reservations exceed its budget except those of sequences already running when the
  budget shrank (they keep theirs).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from moe_runtime import step as step_types
from moe_runtime.engine import request as req
from moe_runtime.engine import step_groups as groups_mod
from moe_runtime.engine import text as text_mod

log = logging.getLogger(__name__)

#: positions per rank for `ranks` serving, rank -> its expert slots (None: an even share):
#: `model.kv_budget.KVBudget.per_rank`.
KVBudgetFn = Callable[[Sequence[int], Mapping[int, int] | None], dict[int, int]]


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
    #: Its interleaved step group (`step_groups`; 0 with one).
    group: int = 0

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
    counted in blocks of kv_block_size (`core.EngineConfig`); kv_budget: that bound per rank
    for the active ranks and the expert slots each holds, re-derived when they change (a
    shrink gives survivors more experts: less room on a GPU; sequences already running keep
    their reservations, new and migrated ones wait for room: module docstring).
    """

    def __init__(
        self,
        *,
        ranks: Iterable[int],
        max_num_seqs_per_rank: int,
        max_tokens_per_step: int,
        kv_tokens_per_rank: int | None = None,
        kv_block_size: int = 16,
        kv_budget: KVBudgetFn | None = None,
        step_groups: int = 1,
    ) -> None:
        self.max_num_seqs_per_rank = max_num_seqs_per_rank
        #: Interleaved step groups (`engine.step_groups`): each step takes one set's sequences.
        self.step_groups = max(1, step_groups)
        #: The set of the last step made (-1: none yet).
        self.turn = -1
        self.max_tokens_per_step = max_tokens_per_step
        self.kv_block_size = kv_block_size
        self.kv_budget = kv_budget
        self.active: list[int] = sorted(set(ranks))
        #: KV positions each active rank's cache may hold (None: no bound).
        self.kv_budgets: dict[int, int] | None = (
            kv_budget(self.active, None)
            if kv_budget is not None
            else None
            if kv_tokens_per_rank is None
            else dict.fromkeys(self.active, kv_tokens_per_rank)
        )
        self._kv_default = kv_tokens_per_rank  # a fixed bound, for ranks added later
        self.draining: set[int] = set()
        self.running: dict[str, Seq] = {}
        #: Sequences with no rank, waiting for room ahead of the request queue (migrated with
        #: no survivor room, or parked by a smaller budget): re-placed by `place_waiting`.
        self.waiting: collections.deque[Seq] = collections.deque()
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

    def sequences(self) -> list[Seq]:
        """Every sequence the engine holds: running, then waiting for room."""
        return [*self.running.values(), *self.waiting]

    def find(self, seq_id: str) -> Seq | None:
        """The running or waiting sequence `seq_id`, or None."""
        seq = self.running.get(seq_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
        return seq

    def remove(self, seq: Seq) -> None:
        """`seq` ends: it is neither running nor waiting any more."""
        if self.running.get(seq.seq_id) is seq:
            del self.running[seq.seq_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # -- placing sequences ---------------------------------------------------------------
    def load(self) -> dict[int, int]:
        """Running sequences per active rank."""
        load = dict.fromkeys(self.active, 0)
        for seq in self.running.values():
            load[seq.rank] = load.get(seq.rank, 0) + 1
        return load

    @property
    def kv_tokens_per_rank(self) -> int | None:
        """The largest active rank's budget in KV positions (None: no bound): the most one
        sequence may reserve."""
        budgets = self.kv_budgets  # replaced whole, never changed in place: any thread
        if budgets is None:
            return None
        return max(budgets.values(), default=self._kv_default)

    def kv_budget_of(self, rank: int) -> int | None:
        """KV positions `rank` may hold (None: no bound)."""
        if self.kv_budgets is None:
            return None
        return self.kv_budgets.get(rank, self.kv_tokens_per_rank)

    def kv_need(self, num_tokens: int) -> int:
        """KV positions a sequence of up to `num_tokens` tokens reserves: whole blocks, at
        most a rank's budget."""
        bs = self.kv_block_size
        need = -(-num_tokens // bs) * bs
        cap = self.kv_tokens_per_rank
        return need if cap is None else min(need, cap)

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
        candidates = []
        for r in self.active:
            budget = self.kv_budget_of(r)
            if (
                r not in self.draining
                and (exclude is None or r not in exclude)
                and load[r] < self.max_num_seqs_per_rank
                and (budget is None or used[r] + kv <= budget)
            ):
                candidates.append((load[r], r))
        return min(candidates)[1] if candidates else None

    def place_waiting(self) -> bool:
        """Re-place the waiting sequences, in order, on ranks with room (re-prefilled there:
        prompt + generated tokens); True when none is left waiting (the request queue may be
        admitted), False when the first still finds no room (first come, first served)."""
        while self.waiting:
            seq = self.waiting[0]
            need = self.kv_need(seq.kv_reserved)
            target = self.least_loaded(kv=need)
            if target is None:
                return False
            self.waiting.popleft()
            seq.rank, seq.kv_reserved = target, need
            seq.num_computed, seq.dirty = 0, False
            self.running[seq.seq_id] = seq
            log.info(
                "engine: %s placed on rank %d after waiting for room (%d tokens to re-prefill)",
                seq.seq_id,
                target,
                len(seq.tokens),
            )
        return True

    def _park(self, seq: Seq) -> None:
        """`seq` leaves its rank (its KV there freed) and waits for room (`place_waiting`)."""
        if seq.dirty:
            self.free_later(seq.rank, [seq.seq_id])
        self.running.pop(seq.seq_id, None)
        seq.num_computed, seq.dirty = 0, False
        self.waiting.append(seq)

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
            group=groups_mod.join(self.running.values(), self.step_groups),
        )
        return True

    def schedule(self) -> tuple[dict[int, step_types.RankBatch], list[Work]]:
        """The next step's batch of every active rank, and the work it carries."""
        batches = self.take_frees()
        work: list[Work] = []
        views = [(s, s.num_computed, len(s.tokens)) for s in self.running.values()]
        group = self.group_of(views)
        for seq, start, n in self.plan(groups_mod.of(views, group)):
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
        self.took(group)
        return batches, work

    def group_of(self, views: Sequence[tuple[Seq, int, int]]) -> int | None:
        """The step group the next step takes (None: every sequence), given each sequence as
        (seq, tokens computed, tokens it has) (pure)."""
        return groups_mod.pick(views, self.step_groups, self.turn)

    def took(self, group: int | None) -> None:
        """A step of `group` was made (the next one takes the set after it)."""
        if group is not None:
            self.turn = group

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
            target = self.least_loaded(exclude=leaving, kv=self.kv_need(seq.kv_reserved))
            if target is None:
                # Over capacity: it waits for room, ahead of the queue, with its tokens (a
                # survivor's budget is never exceeded; nothing is lost).
                log.info(
                    "engine: %s leaves rank %d and waits for room (%d tokens to re-prefill)",
                    seq.seq_id,
                    seq.rank,
                    len(seq.tokens),
                )
                self._park(seq)
                moved.append(seq.seq_id)
                continue
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
            seq.kv_reserved = self.kv_need(seq.kv_reserved)
            seq.num_computed = 0
            seq.dirty = False
            moved.append(seq.seq_id)
        return moved

    def set_active(self, ranks: list[int], slots: Mapping[int, int] | None = None) -> None:
        """Step exactly `ranks` from now on; sequences on leaving ranks migrate first.

        slots: the expert slots each of `ranks` holds in the placement it serves from now on
        (None: an even share): the KV budget of each is re-derived from them."""
        old = list(self.active)
        leaving = set(old) - set(ranks)
        # While migrating, the leaving ranks still count as active (their KV is freed in the
        # next step, which they still receive); then only `ranks` step.
        self.active = sorted(set(ranks) | leaving)
        if leaving:
            self.migrate(leaving)
        self.active = list(ranks)
        self.draining = set()
        self._rederive_budget(slots)
        # Ranks that no longer step read no StepInput: their KV goes away with them.
        dropped = {r: ids for r, ids in self.pending_free.items() if r not in ranks and ids}
        self.pending_free = {r: ids for r, ids in self.pending_free.items() if r in ranks}
        if dropped:
            log.info("engine: KV frees for leaving ranks dropped: %s", dropped)
        log.info("engine: active ranks %s -> %s", old, self.active)

    def _rederive_budget(self, slots: Mapping[int, int] | None) -> None:
        """The budget of every active rank from the slots it holds. On a rank whose
        reservations now exceed its budget, sequences that have computed nothing there yet
        wait for room again (newest first) until they fit; those running keep theirs."""
        if not self.active or self.kv_budgets is None:
            return
        if self.kv_budget is None:
            fixed = self.kv_tokens_per_rank
            assert fixed is not None
            self.kv_budgets = {r: self.kv_budgets.get(r, fixed) for r in self.active}
        else:
            budgets = self.kv_budget(self.active, slots)
            if budgets != self.kv_budgets:
                log.info(
                    "engine: KV budget %s -> %s positions per rank (expert slots %s)",
                    self.kv_budgets,
                    budgets,
                    dict(slots) if slots is not None else "an even share",
                )
            self.kv_budgets = budgets
        used = self.kv_used()
        parked: set[str] = set()
        for rank in self.active:
            unstarted = [s for s in self.running.values() if s.rank == rank and not s.dirty]
            for seq in reversed(unstarted):  # the newest wait first
                if used[rank] <= self.kv_budgets[rank]:
                    break
                used[rank] -= seq.kv_reserved
                parked.add(seq.seq_id)
        for seq in [s for s in self.running.values() if s.seq_id in parked]:
            self._park(seq)  # in admission order

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
        if self.kv_budgets is not None:
            self.kv_budgets = {new(r): b for r, b in self.kv_budgets.items()}
        self.draining = {new(r) for r in self.draining}
        for seq in self.running.values():
            seq.rank = new(seq.rank)
        self.pending_free = {new(r): ids for r, ids in self.pending_free.items()}
        log.info("engine: ranks relabelled %s; active ranks %s", mapping, self.active)
