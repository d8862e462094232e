"""The engine's seam as types: what it needs (`StepRunner`: an executor, `Tokenizer`,
`StepObserver`: metrics) and what it is given and gives (`EngineConfig`, `EngineStats`,
`StepFailure`). Imported by the engine's parts (`core`, `scheduler`, `outputs`) and its users."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from moe_runtime import step as step_types
from moe_runtime.engine import request as req

StepCallback = Callable[[list[step_types.StepOutput]], None]


class StepRunner(Protocol):
    """What the engine needs of an executor (moe_runtime.executor.Executor satisfies it)."""

    @property
    def num_ranks(self) -> int: ...

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]: ...


class OverlappingStepRunner(StepRunner, Protocol):
    """An executor that takes a step before the last one's outputs came back: `submit_step`
    sends it (the ranks run steps in the order they were sent) and returns what
    `collect_step` waits on (moe_runtime.executor.RayExecutor satisfies it)."""

    def submit_step(self, step: step_types.StepInput) -> object: ...

    def collect_step(self, sent: object) -> list[step_types.StepOutput]: ...


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (moe_runtime.model.tokenizer.Tokenizer)."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (the model's eos ids)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...


class StepObserver(Protocol):
    """Receives figures of every step (moe_runtime.metrics implements it)."""

    def observe_step(
        self,
        *,
        seconds: float,
        num_seqs: int,
        num_tokens: int,
        outputs: list[step_types.StepOutput],
        ahead: bool = False,
    ) -> None: ...

    def observe_finished(
        self, *, reason: req.FinishReason, num_prompt_tokens: int, num_generated_tokens: int
    ) -> None: ...


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Limits of the engine.

    max_model_len: the model's context (max_position_embeddings); a sequence ends with
    finish_reason "length" when it is full. max_tokens_per_step: token budget of one rank in
    one step (bounds the prefill chunk, hence the step latency decodes see). max_step_retries:
    how many failed steps in a row a sequence survives (it is re-prefilled after each) before
    it fails with an error. kv_tokens_per_rank: KV positions one rank's cache holds (its
    memory budget, `model.kv`); a request is admitted to a rank only while the sequences there
    reserve (prompt + max_tokens, in blocks of kv_block_size) no more; None: no bound.
    kv_budget: that bound per serving rank from the expert slots each holds
    (`model.kv_budget.KVBudget.per_rank`), re-derived whenever the ranks that step or their
    placement change; when set, it gives kv_tokens_per_rank.
    async_outputs: detokenise and stream a step's outputs on a thread of their own, while the
    ranks run the next step (`delivery`); False: on the step loop's thread, between steps.
    async_scheduling: run each step on a thread of its own while the engine thread admits and
    prepares the next one (`prepare`); False: schedule, step and apply in turn on one thread.
    overlap_steps: with async scheduling and an executor that can take it
    (`OverlappingStepRunner`), launch the prepared step before the one in flight lands: the
    ranks fill each placeholder with the token they sampled, so they never wait for the engine
    to apply a step (docs/ENGINE.md, "Two steps in flight").
    """

    max_model_len: int
    max_num_seqs_per_rank: int = 64
    max_tokens_per_step: int = 2048
    max_step_retries: int = 2
    kv_tokens_per_rank: int | None = None
    kv_block_size: int = 16
    kv_budget: Callable[[Sequence[int], Mapping[int, int] | None], dict[int, int]] | None = None
    async_outputs: bool = True
    async_scheduling: bool = True
    overlap_steps: bool = True

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_seqs_per_rank < 1:
            raise ValueError("max_model_len and max_num_seqs_per_rank must be >= 1")
        if self.max_tokens_per_step < self.max_num_seqs_per_rank:
            raise ValueError("max_tokens_per_step must be >= max_num_seqs_per_rank")
        if self.kv_block_size < 1 or (
            self.kv_tokens_per_rank is not None and self.kv_tokens_per_rank < self.kv_block_size
        ):
            raise ValueError("kv_tokens_per_rank must hold at least one block of kv_block_size")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's progress (monotonic clock times)."""

    alive: bool
    num_waiting: int = 0
    num_running: int = 0
    active_ranks: tuple[int, ...] = ()
    draining_ranks: tuple[int, ...] = ()
    seqs_per_rank: dict[int, int] = dataclasses.field(default_factory=dict)
    step_count: int = 0
    last_step_seconds: float = 0.0
    last_token_time: float | None = None


@dataclasses.dataclass(frozen=True)
class StepFailure:
    """A step that failed on some ranks (its sequences there will be re-prefilled).

    ranks: the ranks that failed (every stepped rank when `execute_step` raised without naming
    any); exception: what `execute_step` raised, None when ranks reported StepOutput.error.
    """

    step_id: int
    ranks: tuple[int, ...]
    message: str
    exception: BaseException | None = None


FailureCallback = Callable[[StepFailure], None]
