"""Engine overhead at 64 concurrent streams: per-token engine time and tokens/s, before/after.

The engine runs over a LocalExecutor (in-process ranks, no Ray) serving synthetic://tiny;
`--streams` greedy requests (prompt of `--prompt-len` tokens, exactly `--max-tokens`
generated) are consumed the way the HTTP server consumes them: `async for` over each handle in
one asyncio event loop. The step runner is wrapped to time `execute_step` (the ranks' forward
pass and sampling) on the engine thread, so the rest of the engine thread's time is the
engine's own Python work: scheduling, appending tokens, and, in the step loop of before
issue 23's async output processing, detokenising and pushing outputs. Those now run on the
engine's output thread (`engine.delivery`), outside this figure, in every variant;
`bench/engine_vs_hf.py --outputs async sync` compares the two loops.

Printed per variant: output tokens/s, engine time per generated token outside
`execute_step` (wall, and the engine thread's CPU time), and `execute_step` time per token.
Variants, interleaved in one run on the same machine state:

- before: the detokeniser as it was (a full decode of the whole output at every token) and
  one event-loop wake-up (`call_soon_threadsafe`) per output;
- detok: the incremental detokeniser (`engine.text.IncrementalText`), one wake-up per output;
- after: both as they are now (outputs of a burst handed to the loop with one wake-up).

With `--profile`, the engine thread of the "after" run runs under cProfile and the top
functions by own time are printed (where the engine's own time goes).

    .venv/bin/python bench/engine.py                  # ~1 min on 2 busy cores
    .venv/bin/python bench/engine.py --max-tokens 512 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import torch

from moe_runtime import step as step_types
from moe_runtime.engine import core, text
from moe_runtime.engine import request as req
from moe_runtime.executor import local

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import local_engine  # noqa: E402
from tests.support import text_oracle  # noqa: E402  (the old detokeniser, kept as oracle)

SOURCE = "synthetic://tiny?seed=0"


class TimedRunner:
    """Wraps the executor; adds up the wall and engine-thread CPU time spent in execute_step."""

    def __init__(self, inner: local.LocalExecutor) -> None:
        self.inner = inner
        self.step_wall = 0.0
        self.step_cpu = 0.0
        self.steps = 0
        self.first: float | None = None
        self.last = 0.0
        self.thread_cpu_at_first = 0.0
        self.thread_cpu_at_last = 0.0

    @property
    def num_ranks(self) -> int:
        return self.inner.num_ranks

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        wall, cpu = time.perf_counter(), time.thread_time()
        if self.first is None:
            self.first, self.thread_cpu_at_first = wall, cpu
        outs = self.inner.execute_step(step)
        self.last, self.thread_cpu_at_last = time.perf_counter(), time.thread_time()
        self.step_wall += self.last - wall
        self.step_cpu += self.thread_cpu_at_last - cpu
        self.steps += 1
        return outs


def _push_waking_per_output(self: req.RequestHandle, output: req.RequestOutput) -> None:
    """RequestHandle.push as it was: one call_soon_threadsafe (a loop wake-up) per output."""
    with self._cond:
        self._outputs.append(output)
        self._cond.notify_all()
    waker, queue = self._waker, self._queue
    loop = None if waker is None else waker._loop()
    if loop is not None and queue is not None:
        loop.call_soon_threadsafe(queue.put_nowait, output)


@contextlib.contextmanager
def old_code(*, detokeniser: bool, wakeups: bool) -> Iterator[None]:
    """Puts back the old detokeniser (a full decode per token) and/or the old per-output loop
    wake-ups while active, so "before" and "after" run in one process on one machine state."""
    saved_text, saved_push = text.IncrementalText, req.RequestHandle.push
    if detokeniser:
        text.IncrementalText = text_oracle.FullDecodeText  # type: ignore[misc,assignment]
    if wakeups:
        req.RequestHandle.push = _push_waking_per_output  # type: ignore[method-assign]
    try:
        yield
    finally:
        text.IncrementalText = saved_text  # type: ignore[misc]
        req.RequestHandle.push = saved_push  # type: ignore[method-assign]


VARIANTS = {  # name: (old detokeniser, old wake-ups)
    "before": (True, True),
    "detok": (False, True),
    "after": (False, False),
}


class ProfiledEngine(core.Engine):
    """An Engine whose step thread runs under cProfile."""

    profile: cProfile.Profile | None = None

    def _run(self) -> None:
        self.profile = cProfile.Profile()
        self.profile.enable()
        try:
            super()._run()
        finally:
            self.profile.disable()


def run_variant(name: str, args: argparse.Namespace, *, profile: bool) -> dict[str, float]:
    engine_cls = ProfiledEngine if profile else core.Engine
    served = local_engine.start(
        SOURCE, ranks=args.ranks, streams=args.streams, wrap=TimedRunner, engine_cls=engine_cls
    )
    engine, runner = served.engine, served.runner
    try:
        old_text, old_wakeups = VARIANTS[name]
        with old_code(detokeniser=old_text, wakeups=old_wakeups):
            start = time.perf_counter()
            tokens = asyncio.run(
                local_engine.consume(
                    engine,
                    streams=args.streams,
                    prompt_len=args.prompt_len,
                    max_tokens=args.max_tokens,
                    vocab=served.source.config.vocab_size,
                )
            )
            wall = time.perf_counter() - start
    finally:
        served.stop()
    assert runner.first is not None
    loop_wall = runner.last - runner.first
    loop_cpu = runner.thread_cpu_at_last - runner.thread_cpu_at_first
    result = {
        "tokens_per_s": tokens / wall,
        "engine_us_per_token": 1e6 * (loop_wall - runner.step_wall) / tokens,
        "engine_cpu_us_per_token": 1e6 * (loop_cpu - runner.step_cpu) / tokens,
        "step_us_per_token": 1e6 * runner.step_wall / tokens,
        "tokens_per_step": tokens / runner.steps,
    }
    print(
        f"  {name:<7} {result['tokens_per_s']:8.0f} tok/s | engine {result['engine_us_per_token']:6.1f}"
        f" us/token wall, {result['engine_cpu_us_per_token']:6.1f} us/token CPU | execute_step"
        f" {result['step_us_per_token']:6.1f} us/token ({result['tokens_per_step']:.0f} tokens/step)"
    )
    if profile and isinstance(engine, ProfiledEngine) and engine.profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(engine.profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.profile_top)
        print(out.getvalue())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--profile", action="store_true", help="cProfile the 'after' engine")
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{args.streams} streams x {args.max_tokens} tokens (prompt {args.prompt_len}), "
        f"{SOURCE}, LocalExecutor with {args.ranks} rank(s); median of {args.repeats} runs "
        f"(threads alive: {threading.active_count()})"
    )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for i in range(args.repeats):  # interleaved, so machine load drifts hit both alike
        for name in results:
            results[name].append(
                run_variant(name, args, profile=args.profile and name == "after" and i == 0)
            )
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for name, rs in results.items()
    }
    b, a = med["before"], med["after"]
    print("median:")
    for name, m in med.items():
        print(
            f"  {name:<7} {m['tokens_per_s']:8.0f} tok/s | engine {m['engine_us_per_token']:6.1f}"
            f" us/token wall, {m['engine_cpu_us_per_token']:6.1f} us/token CPU"
        )
    print(
        f"after/before: tokens/s x{a['tokens_per_s'] / b['tokens_per_s']:.2f}, engine time per "
        f"token x{a['engine_us_per_token'] / b['engine_us_per_token']:.2f}"
    )


if __name__ == "__main__":
    main()
