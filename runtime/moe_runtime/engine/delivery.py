"""Async output processing: a step's sampled tokens become text deltas and stream outputs on
a thread of their own (`Delivery`, a part of `core.Engine`), while the ranks run the next step.

The engine thread decides everything that changes what the ranks compute: the token is
appended to its sequence, EOS, `max_tokens` and the context's end finish the request there,
at the step that produced the token, exactly as before. What is left, turning the token into
text (`text.IncrementalText`) and handing `req.RequestOutput`s to the consumers
(`RequestHandle.push`: a lock, a wake-up of the server's event loop), is an `Emit` the engine
thread queues here; the delivery thread does it in queue order, so every request's outputs
stay in order and its finished output stays last. Every output of the engine goes through
this queue (finishes, aborts and errors too): an output pushed past it could overtake
deltas still queued.

Stop strings are the exception: whether a sequence with stop strings goes on depends on its
text, so its tokens are detokenised on the engine thread (`Emit.text` is None, the delta made
there); no token past a stop string is ever computed or sent.

`threaded=False` runs every `Emit` at once on the caller's thread (the synchronous step loop
of before, kept for the benchmark's comparison).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from moe_runtime.engine import request as req
from moe_runtime.engine import text as text_mod

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Emit:
    """One output of one request, its text still to be made when `text` is given.

    token: the sampled token (None: an output without one); decode: feed it to `text` (False
    for EOS, which stays out of the text); new_text: text made already (on the engine thread),
    put before what `text` adds; finished outputs end with `text.flush()` (the text held back).
    """

    handle: req.RequestHandle
    text: text_mod.IncrementalText | None
    token: int | None = None
    decode: bool = True
    new_text: str = ""
    finish_reason: req.FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    def output(self) -> req.RequestOutput:
        """Makes the text (detokenising) and the output; called once, in queue order."""
        delta = self.new_text
        finished = self.finish_reason is not None
        if self.text is not None:
            if self.token is not None and self.decode:
                delta += self.text.append(self.token)
            if finished:
                delta += self.text.flush()
        return req.RequestOutput(
            request_id=self.handle.request_id,
            new_token_ids=[] if self.token is None else [self.token],
            new_text=delta,
            finished=finished,
            finish_reason=self.finish_reason,
            error=self.error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
        )


class Delivery:
    """The queue of `Emit`s and the thread that runs them.

    `put` (engine thread only) collects the outputs of a step; `send` hands them to the thread
    in one batch; `close` runs what is left and ends the thread.
    """

    def __init__(self, *, threaded: bool = True) -> None:
        self.threaded = threaded
        self._pending: list[Emit] = []  # engine thread only
        self._cond = threading.Condition()
        self._queue: collections.deque[list[Emit]] = collections.deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()  # requests whose output failed: the rest is dropped
        #: Seconds the delivery thread spent running outputs (figures for the benchmark).
        self.busy_seconds = 0.0

    def start(self) -> None:
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="moe-engine-outputs", daemon=True
            )
            self._thread.start()

    def put(self, emit: Emit) -> None:
        """Queues one output (sent with the next `send`)."""
        self._pending.append(emit)

    def send(self) -> None:
        """Hands the queued outputs to the delivery thread (runs them now when not threaded,
        or when the thread is not running)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if self._thread is None:
            _run_batch(batch, self._failed)
            return
        with self._cond:
            self._queue.append(batch)
            self._cond.notify_all()

    def close(self, timeout: float | None = 30.0) -> None:
        """Sends what is queued, lets the thread push everything, and ends it."""
        self.send()
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.error("engine: output thread did not stop within %s s", timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing, and everything is pushed
                batch = self._queue.popleft()
            started = time.perf_counter()
            _run_batch(batch, self._failed)
            self.busy_seconds += time.perf_counter() - started


def _run_batch(batch: list[Emit], failed: set[str]) -> None:
    for emit in batch:
        rid = emit.handle.request_id
        if rid in failed:  # already ended with an error; the engine's finish comes later
            if emit.finish_reason is not None:
                failed.discard(rid)
            continue
        try:
            output = emit.output()
        except Exception:  # a decoder's failure ends that request, never the thread
            log.exception("engine: making the output of %s failed", rid)
            if emit.finish_reason is None:
                failed.add(rid)
            output = req.RequestOutput(
                request_id=rid,
                new_token_ids=[] if emit.token is None else [emit.token],
                new_text="",
                finished=True,
                finish_reason=req.FinishReason.ERROR,
                error="detokenising the output failed",
                num_prompt_tokens=emit.num_prompt_tokens,
                num_generated_tokens=emit.num_generated_tokens,
            )
        try:
            emit.handle.push(output)
        except Exception:  # a consumer's failure ends nothing else
            log.exception("engine: pushing an output of %s failed", rid)
