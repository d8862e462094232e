"""What a caller gives the engine (a request) and gets back (a stream of outputs).

The engine thread produces outputs; a `RequestHandle` hands them to an asyncio consumer (the
server) through the consumer's event loop, or to a thread (tests, the benchmark) through a
condition variable.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from moe_runtime import step as step_types

log = logging.getLogger(__name__)


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the OpenAI `finish_reason` values, plus abort and error)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # the caller went away
    ERROR = "error"  # the engine could not run it (see RequestOutput.error)


@dataclass(frozen=True)
class Request:
    """One generation request, already tokenised and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: step_types.SamplingParams = step_types.SamplingParams()
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RequestOutput:
    """A delta of one request: the tokens generated since the previous output, and their text."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


@dataclass(frozen=True)
class CompletedRequest:
    """The whole answer of a finished request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    error: str | None = None


class RequestFailed(RuntimeError):
    """The engine gave up on a request (the message says why)."""


class RequestHandle:
    """The consumer's end of one request: iterate it (async or sync) or wait for the result.

    Created by `Engine.add_request`. When created inside a running event loop, outputs are
    delivered to that loop (`async for out in handle`); the blocking `iter_outputs()` and
    `result()` work from any thread in every case.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self._cond = threading.Condition()
        self._outputs: list[RequestOutput] = []
        self._waker: _LoopWaker | None
        self._queue: asyncio.Queue[RequestOutput] | None
        try:
            self._waker = _LoopWaker.of(asyncio.get_running_loop())
            self._queue = asyncio.Queue()
        except RuntimeError:
            self._waker = None
            self._queue = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        with self._cond:
            return bool(self._outputs) and self._outputs[-1].finished

    def push(self, output: RequestOutput) -> None:
        """Called by the engine thread for every delta (the last one has finished=True)."""
        with self._cond:
            self._outputs.append(output)
            self._cond.notify_all()
        if self._waker is not None and self._queue is not None:
            self._waker.deliver(self._queue, output)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._queue is None:
            raise RuntimeError("this handle was created outside an event loop: use iter_outputs()")
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return

    def iter_outputs(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Blocking iteration over the deltas; `timeout` bounds the wait for each one."""
        index = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._has_output, index), timeout):
                    raise TimeoutError(f"request {self.request_id}: no output in {timeout} s")
                out = self._outputs[index]
            index += 1
            yield out
            if out.finished:
                return

    def _has_output(self, index: int) -> bool:
        return len(self._outputs) > index

    def result(self, timeout: float | None = None) -> CompletedRequest:
        """Waits for the end of the request and returns the whole answer (errors included)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: bool(self._outputs) and self._outputs[-1].finished, timeout
            ):
                raise TimeoutError(f"request {self.request_id}: not finished in {timeout} s")
            outputs = list(self._outputs)
        return collect(self.request, outputs)


class _LoopWaker:
    """Hands outputs from the engine thread to one event loop, waking the loop once per burst.

    An engine step pushes one output to each of its (say 64) streams. One
    `call_soon_threadsafe` per output costs a write to the loop's self-pipe and a loop wake-up
    each, which together were the largest part of the engine thread's own time at 64 streams
    (bench/engine.py --profile). Here outputs wait in a list and only the first of a burst
    schedules the loop callback that drains them all, in push order.
    """

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = (
        weakref.WeakKeyDictionary()
    )
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # not a strong one: the registry entry dies with the loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        """The waker of `loop` (one per loop, gone with the loop)."""
        with cls._registry_lock:
            waker = cls._by_loop.get(loop)
            if waker is None:
                waker = cls._by_loop[loop] = cls(loop)
            return waker

    def deliver(self, queue: asyncio.Queue[RequestOutput], output: RequestOutput) -> None:
        """Called from any thread: `queue.put_nowait(output)` soon, on the loop."""
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:
                return  # the drain scheduled by the first of this burst will take it
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._drain)
                return
            except RuntimeError:
                log.debug("consumer loop closed while waking it")  # it closed just now
        # The loop is closed or gone: nobody will read these streams any more.
        with self._lock:
            dropped, self._pending = len(self._pending), []
        log.debug("consumer loop closed: %d outputs dropped", dropped)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, output in batch:
            queue.put_nowait(output)


def check(request: Request, *, max_model_len: int, kv_tokens_per_rank: int | None) -> None:
    """ValueError, naming the field, when the engine cannot run `request`: an empty prompt,
    max_tokens < 1, a prompt that fills the context or exceeds a rank's KV cache."""
    n = len(request.prompt_token_ids)
    if not n:
        raise ValueError("prompt_token_ids must not be empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens; the context is {max_model_len} tokens")
    if kv_tokens_per_rank is not None and n > kv_tokens_per_rank:
        raise ValueError(f"prompt has {n} tokens; a rank's KV cache holds {kv_tokens_per_rank}")


def collect(request: Request, outputs: list[RequestOutput]) -> CompletedRequest:
    """Joins the deltas of a finished request into its whole answer."""
    last = outputs[-1]
    return CompletedRequest(
        request_id=request.request_id,
        token_ids=[t for out in outputs for t in out.new_token_ids],
        text="".join(out.new_text for out in outputs),
        finish_reason=last.finish_reason or FinishReason.ERROR,
        num_prompt_tokens=len(request.prompt_token_ids),
        error=last.error,
    )
