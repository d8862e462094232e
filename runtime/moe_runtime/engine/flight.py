"""A step in flight (`Flight`) and the thread that runs steps (`StepThread`, a part of
`core.Engine`): with async scheduling `execute_step` runs on the dedicated `moe-engine-step`
thread, so the engine thread takes arrivals, admits and prepares the next step meanwhile
(`prepare`); without it, the step runs on the caller's thread (the synchronous loop).

An executor that can take a step before the last one's outputs came back
(`seam.OverlappingStepRunner`: `submit_step` sends, `collect_step` waits) is called that way:
the engine thread sends (`launch`, so the steps reach the ranks in launch order) and the step
thread collects, in the same order; the engine may then have two steps in flight
(`EngineConfig.overlap_steps`, docs/ENGINE.md "Two steps in flight"). Otherwise the step
thread runs the blocking `execute_step(step)`, one step in flight at a time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from moe_runtime import step as step_types
from moe_runtime.engine import boundary as boundary_mod
from moe_runtime.engine import prepare, seam
from moe_runtime.engine import scheduler as scheduler_mod

#: What a step gives: every rank's output, and the seconds `execute_step` took.
Result = tuple[list[step_types.StepOutput], float]


@dataclasses.dataclass(eq=False)
class Flight:
    """One launched step: its input, the work it carries, the step controls waiting for its
    outputs, and its outcome (`future`)."""

    step: step_types.StepInput
    work: list[scheduler_mod.Work]
    control_futures: list[boundary_mod.ControlFuture]
    future: concurrent.futures.Future[Result]
    #: Launched before the step ahead of it landed: {seq_id: (rank, computed tokens, token
    #: count)} each of its sequences must have once that step is applied, else its slice is
    #: not applied (the sequence finished, was aborted or re-prefilled meanwhile).
    assumed: dict[str, tuple[int, int, int]] | None = None

    def done(self) -> bool:
        return self.future.done()


@dataclasses.dataclass(frozen=True)
class Landed:
    """A step's outcome on the engine thread: its outputs applied (`produced`: a token came;
    `errors`: {rank: message} of ranks that failed it), or the exception `execute_step`
    raised (`message` its text)."""

    outputs: list[step_types.StepOutput] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    produced: bool = False
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    exception: Exception | None = None
    message: str = ""

    def failure(self, step: step_types.StepInput) -> seam.StepFailure | None:
        """What failed `step`: the exception (the ranks it names, else every rank of the
        step), or the ranks that reported an error; None when it succeeded."""
        if self.exception is not None:
            named = tuple(getattr(self.exception, "ranks", None) or ())
            return seam.StepFailure(
                step_id=step.step_id,
                ranks=named or tuple(sorted(step.batches)),
                message=self.message,
                exception=self.exception,
            )
        if not self.errors:
            return None
        return seam.StepFailure(
            step_id=step.step_id,
            ranks=tuple(sorted(self.errors)),
            message="; ".join(self.errors[r] for r in sorted(self.errors)),
        )


class Aheads:
    """The steps launched ahead of the one that lands next (`core.Engine._fly`), oldest
    first: at most `most` of them (one with two steps in flight; with interleaved step groups
    one per set less one, so that every pipeline stage has a step)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.flights: collections.deque[Flight] = collections.deque()

    def room(self) -> bool:
        return len(self.flights) < self.most

    def work(self, flight: Flight) -> list[scheduler_mod.Work]:
        """What `flight` and the steps ahead of it carry (the next step follows all of them)."""
        return [*flight.work, *(w for ahead in self.flights for w in ahead.work)]

    def launch(
        self,
        prepared: prepare.Prepared,
        scheduler: scheduler_mod.Scheduler,
        launch: Callable[..., Flight],
        placeholders: bool,
        max_model_len: int,
    ) -> bool:
        """`prepared` made real and launched ahead (`prepare.launch_ahead`; `launch`: the
        engine's); whether it was. Placeholders (`placeholders`: the ranks fill them) in the
        first step ahead only: a later one would need two of one sequence."""
        ahead = prepare.launch_ahead(
            prepared,
            scheduler,
            max_model_len=max_model_len,
            placeholders=placeholders and not self.flights,
        )
        if ahead is None:
            return False
        self.flights.append(launch(ahead.batches, ahead.work, {}, [], assumed=ahead.assumed))
        return True

    def take(self) -> list[Flight]:
        """Every step ahead, oldest first (none left here)."""
        taken = list(self.flights)
        self.flights.clear()
        return taken


class StepThread:
    """Runs steps: on its own thread (`threaded`), calling `wake()` when one ends, or inline.

    execute(step): the executor's `execute_step`; submit, collect: its `submit_step` and
    `collect_step` when it has them (`overlaps`: two steps may be in flight; threaded only).
    """

    def __init__(
        self,
        execute: Callable[[step_types.StepInput], list[step_types.StepOutput]],
        *,
        threaded: bool,
        wake: Callable[[], None],
        submit: Callable[[step_types.StepInput], object] | None = None,
        collect: Callable[[Any], list[step_types.StepOutput]] | None = None,
    ) -> None:
        self._execute = execute
        self._wake = wake
        self._submit = submit if threaded and collect is not None else None
        self._collect = collect
        #: Steps may be launched before the last one landed.
        self.overlaps = self._submit is not None
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moe-engine-step")
            if threaded
            else None
        )

    def launch(
        self,
        step: step_types.StepInput,
        work: list[scheduler_mod.Work],
        control_futures: list[boundary_mod.ControlFuture],
    ) -> Flight:
        """Starts `step` (threaded: returns at once; inline: returns it done)."""
        if self._pool is not None and self._submit is not None:
            try:
                sent = self._submit(step)  # here: the ranks get the steps in launch order
            except Exception as exc:  # noqa: BLE001 - handed to the engine thread
                future = concurrent.futures.Future[Result]()
                future.set_exception(exc)
            else:
                future = self._pool.submit(self._collected, sent)
            future.add_done_callback(lambda _: self._wake())
        elif self._pool is not None:
            future = self._pool.submit(self._timed, step)
            future.add_done_callback(lambda _: self._wake())
        else:
            future = concurrent.futures.Future()
            try:
                future.set_result(self._timed(step))
            except Exception as exc:  # noqa: BLE001 - handed to the engine thread (`Outputs.land`)
                future.set_exception(exc)
        return Flight(step=step, work=work, control_futures=control_futures, future=future)

    def close(self) -> None:
        """No more steps (a step still running ends on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _collected(self, sent: object) -> Result:
        assert self._collect is not None
        started = time.monotonic()
        outputs = self._collect(sent)
        return outputs, time.monotonic() - started

    def _timed(self, step: step_types.StepInput) -> Result:
        started = time.monotonic()
        outputs = self._execute(step)
        return outputs, time.monotonic() - started
