"""What a step's outputs do to the requests (`Outputs`, a part of `core.Engine`, run on the
engine thread): sampled tokens appended, requests finished (stop, length, abort, error), and
the sequences of a failed step re-prefilled, or failed after `EngineConfig.max_step_retries`
failed steps in a row. The outputs the consumers see (text deltas, finished outputs) are
queued to `delivery.Delivery`, which makes their text and streams them off the step path.
`land` takes a step's outcome (`flight.Flight`) on the engine thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from moe_runtime import step as step_types
from moe_runtime.engine import delivery as delivery_mod
from moe_runtime.engine import flight as flight_mod
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.engine import scheduler as scheduler_mod

log = logging.getLogger(__name__)


class Outputs:
    """Applies step outputs to the scheduler's sequences and finishes requests.

    scheduler: the engine's sequences and ranks; delivery: where outputs go; stop_token_ids:
    the tokenizer's stop ids; max_model_len, max_step_retries: `core.EngineConfig`'s;
    observer(): the engine's current step observer (metrics), or None.
    """

    def __init__(
        self,
        *,
        scheduler: scheduler_mod.Scheduler,
        delivery: delivery_mod.Delivery,
        stop_token_ids: tuple[int, ...],
        max_model_len: int,
        max_step_retries: int,
        observer: Callable[[], Any],
    ) -> None:
        self._scheduler = scheduler
        self._delivery = delivery
        self._eos = frozenset(stop_token_ids)
        self._max_model_len = max_model_len
        self._max_step_retries = max_step_retries
        self._observer = observer

    def land(self, flight: flight_mod.Flight) -> flight_mod.Landed:
        """A step has ended: its outputs applied (`apply`), or, when `execute_step` raised,
        its KV frees owed again, its step controls failed and its sequences re-prefilled."""
        step, work = flight.step, flight.work
        if flight.assumed is not None:  # launched ahead: only what still holds is applied
            work = [w for w in work if self._holds(w.seq, flight.assumed)]
        try:
            outputs, elapsed = flight.future.result()
        except Exception as exc:
            log.exception(
                "engine: step %d failed (ranks %s, %d sequences, control %s)",
                step.step_id,
                sorted(step.batches),
                len(work),
                sorted(step.control),
            )
            for rank, batch in step.batches.items():
                self._scheduler.free_later(rank, batch.free)
            for cf in flight.control_futures:
                cf.set_exception(exc)
            message = f"{type(exc).__name__}: {exc}"
            for w in work:
                self.step_failed(w, message)
            return flight_mod.Landed(exception=exc, message=message)
        by_rank = {out.rank: out for out in outputs}
        produced, errors = self.apply(step.step_id, work, by_rank, step.batches)
        return flight_mod.Landed(outputs=outputs, elapsed=elapsed, produced=produced, errors=errors)

    def _holds(self, seq: scheduler_mod.Seq, assumed: dict[str, tuple[int, int, int]]) -> bool:
        """`seq` is running in the state a step launched ahead assumed for it."""
        if self._scheduler.running.get(seq.seq_id) is not seq:
            return False  # finished (a stop token), aborted, failed
        return (seq.rank, seq.num_computed, len(seq.tokens)) == assumed.get(seq.seq_id)

    def drop(self, flight: flight_mod.Flight) -> None:
        """A step launched ahead of one that failed: its outputs are not applied (its
        sequences are re-prefilled or go on from what the engine holds: the next step's start
        positions cut what it added to their KV); the KV frees it carried are owed again."""
        try:
            flight.future.result()
        except Exception as exc:  # noqa: BLE001 - dropped either way
            log.info("engine: step %d, launched ahead, dropped: %s", flight.step.step_id, exc)
        else:
            log.info(
                "engine: step %d, launched ahead of a failed step, dropped", flight.step.step_id
            )
        for rank, batch in flight.step.batches.items():
            self._scheduler.free_later(rank, batch.free)
        for w in flight.work:
            seq = w.seq
            if seq.dirty and not self._holds(seq, flight.assumed or {}):
                self._scheduler.free_later(seq.rank, [seq.seq_id])
                seq.num_computed = 0
                seq.dirty = False

    def apply(
        self,
        step_id: int,
        work: list[scheduler_mod.Work],
        by_rank: dict[int, step_types.StepOutput],
        batches: dict[int, step_types.RankBatch],
    ) -> tuple[bool, dict[int, str]]:
        """Appends the sampled tokens; returns (any token produced, {failed rank: message})."""
        errors: dict[int, str] = {}
        for rank in batches:
            out = by_rank.get(rank)
            if out is None:
                errors[rank] = f"rank {rank} returned no output for step {step_id}"
            elif out.error is not None:
                errors[rank] = f"rank {rank}: {out.error}"
        for rank, message in errors.items():
            log.error("engine: step %d failed on rank %d: %s", step_id, rank, message)
            self._scheduler.free_later(rank, batches[rank].free)
        produced = False
        for w in work:
            if w.rank in errors:
                self.step_failed(w, errors[w.rank])
                continue
            seq = w.seq
            seq.num_computed += w.num_tokens
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk: its sampled token is not used
            token = by_rank[w.rank].tokens.get(seq.seq_id)
            if token is None:
                seq.num_computed -= w.num_tokens
                self.step_failed(w, f"rank {w.rank} returned no token for {seq.seq_id}")
                continue
            seq.failures = 0
            produced = True
            self._append_token(seq, token)
        return produced, errors

    def _append_token(self, seq: scheduler_mod.Seq, token: int) -> None:
        request = seq.handle.request
        seq.tokens.append(token)
        is_eos = not request.ignore_eos and token in self._eos
        # Stop strings: the text decides whether the sequence goes on, so it is made here.
        here = bool(request.stop)
        delta = seq.text.append(token) if here and not is_eos else ""
        reason: req.FinishReason | None = None
        if is_eos or (here and seq.text.stopped):
            reason = req.FinishReason.STOP
        elif seq.num_generated >= request.max_tokens or len(seq.tokens) >= self._max_model_len:
            reason = req.FinishReason.LENGTH
        if reason is None:
            self._delivery.put(
                delivery_mod.Emit(
                    handle=seq.handle,
                    text=None if here else seq.text,
                    token=token,
                    decode=not is_eos,
                    new_text=delta,
                    num_prompt_tokens=seq.prompt_len,
                    num_generated_tokens=seq.num_generated,
                )
            )
            return
        self.finish(seq, reason, token=token, decode=not is_eos, new_text=delta)

    def step_failed(self, w: scheduler_mod.Work, message: str) -> None:
        """The step failed for this work: re-prefill its sequence, or fail it past the
        retries."""
        seq = w.seq
        seq.failures += 1
        if seq.dirty:
            self._scheduler.free_later(seq.rank, [seq.seq_id])
        seq.num_computed = 0
        seq.dirty = False
        if seq.failures > self._max_step_retries:
            log.error(
                "engine: request %s failed after %d failed steps on rank %d: %s",
                seq.seq_id,
                seq.failures,
                w.rank,
                message,
            )
            self.finish(
                seq,
                req.FinishReason.ERROR,
                error=f"step failed {seq.failures} times in a row: {message}",
            )
        else:
            log.warning(
                "engine: request %s will be re-prefilled on rank %d after a failed step: %s",
                seq.seq_id,
                seq.rank,
                message,
            )

    def finish(
        self,
        seq: scheduler_mod.Seq,
        reason: req.FinishReason,
        *,
        token: int | None = None,
        decode: bool = True,
        new_text: str = "",
        error: str | None = None,
    ) -> None:
        """The request of a running sequence ends (its last output, its KV freed later).

        token: the last sampled token, if any (decode: it goes into the text); new_text: its
        text when made already (stop strings)."""
        self._scheduler.remove(seq)  # running, or waiting for room
        if seq.dirty:
            self._scheduler.free_later(seq.rank, [seq.seq_id])
            seq.dirty = False
        here = bool(seq.handle.request.stop)
        self._delivery.put(
            delivery_mod.Emit(
                handle=seq.handle,
                text=None if here else seq.text,
                token=token,
                decode=decode,
                new_text=new_text + seq.text.flush() if here else new_text,
                finish_reason=reason,
                error=error,
                num_prompt_tokens=seq.prompt_len,
                num_generated_tokens=seq.num_generated,
            )
        )
        observer = self._observer()
        if observer is not None:
            observer.observe_finished(
                reason=reason,
                num_prompt_tokens=seq.prompt_len,
                num_generated_tokens=seq.num_generated,
            )

    def finish_unstarted(
        self, handle: req.RequestHandle, reason: req.FinishReason, error: str | None
    ) -> None:
        """A request that never ran ends (aborted in the queue, refused, or the engine
        stopped)."""
        n = len(handle.request.prompt_token_ids)
        self._delivery.put(
            delivery_mod.Emit(
                handle=handle, text=None, finish_reason=reason, error=error, num_prompt_tokens=n
            )
        )
        observer = self._observer()
        if observer is not None:
            observer.observe_finished(reason=reason, num_prompt_tokens=n, num_generated_tokens=0)

    def end_all(
        self,
        queued: Iterable[req.RequestHandle],
        running: Iterable[scheduler_mod.Seq],
        error: str,
    ) -> None:
        """Every queued request and every sequence ends with `error` (the engine stopped)."""
        for handle in queued:
            self.finish_unstarted(handle, req.FinishReason.ERROR, error)
        for seq in list(running):
            self.finish(seq, req.FinishReason.ERROR, error=error)

    def abort(self, aborts: set[str], queue: queue_mod.RequestQueue) -> None:
        """End the requests `aborts` names, queued or running (finish_reason "abort")."""
        if not aborts:
            return
        self.abort_queued(aborts, queue)
        for rid in aborts:
            seq = self._scheduler.find(rid)
            if seq is not None:
                self.finish(seq, req.FinishReason.ABORT)

    def abort_queued(self, aborts: set[str], queue: queue_mod.RequestQueue) -> None:
        """End the queued requests `aborts` names (while a step runs: the running ones end
        once it is applied, with `abort`)."""
        if aborts:
            for handle in queue.remove(aborts):
                self.finish_unstarted(handle, req.FinishReason.ABORT, None)
