"""Prometheus metrics of the runtime, in a registry of their own (one per server).

The registry lives as long as the server process: a resize changes label sets (ranks come and
go) but never resets a counter, unlike vLLM, whose metrics restart on scale-up.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import prometheus_client

from moe_runtime import step as step_types
from moe_runtime.engine import request as req
from moe_runtime.engine import seam

#: Steps over which the per-rank expert load gauge is summed.
LOAD_WINDOW_STEPS = 100

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class RuntimeMetrics:
    """The runtime's metrics; an `engine.seam.StepObserver` plus request-level observations.

    `stats`: where queue depth and running sequences are read at scrape time (Engine.stats).
    """

    def __init__(
        self,
        *,
        registry: prometheus_client.CollectorRegistry | None = None,
        stats: Callable[[], seam.EngineStats] | None = None,
    ) -> None:
        self.registry = registry or prometheus_client.CollectorRegistry()
        r = self.registry
        self._stats = stats
        self.requests = prometheus_client.Counter(
            "moe_requests",
            "Completion requests by outcome (stop, length, abort, error; rejected: invalid, "
            "queue_full: refused with 429 because the queue was at its bound).",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = prometheus_client.Counter(
            "moe_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = prometheus_client.Counter(
            "moe_generation_tokens", "Tokens generated for finished requests.", registry=r
        )
        self.waiting = prometheus_client.Gauge(
            "moe_requests_waiting", "Requests in the queue, not yet running.", registry=r
        )
        self.running = prometheus_client.Gauge(
            "moe_requests_running", "Sequences in the running batch.", registry=r
        )
        self.ranks = prometheus_client.Gauge(
            "moe_data_parallel_size", "Active DP ranks stepped by the engine.", registry=r
        )
        self.waiting.set_function(lambda: self._stat("num_waiting"))
        self.running.set_function(lambda: self._stat("num_running"))
        self.ranks.set_function(lambda: self._stat("active_ranks"))
        self.step_seconds = prometheus_client.Histogram(
            "moe_step_seconds", "Duration of one lockstep step.", buckets=_STEP_BUCKETS, registry=r
        )
        self.batch_size = prometheus_client.Histogram(
            "moe_step_batch_size",
            "Sequences run in one step (all ranks).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.steps = prometheus_client.Counter("moe_steps", "Lockstep steps run.", registry=r)
        self.steps_ahead = prometheus_client.Counter(
            "moe_steps_ahead",
            "Steps launched before the step ahead of them landed (two steps in flight: the "
            "ranks filled their placeholders).",
            registry=r,
        )
        self.source_reads = prometheus_client.Counter(
            "moe_pipeline_source_reads",
            "Experts pipeline stages (or, in the mesh expert layout, TP followers) read from "
            "the model source: when=step inside a step (a placement change they had not "
            "prefetched; it stalls that step), when=prefetch ahead of a placement change, a "
            "warm spare's pre-staging included (what no peer could move or hand to them).",
            ["when"],
            registry=r,
        )
        self.micro_batched = prometheus_client.Counter(
            "moe_pipeline_micro_batched_steps",
            "Steps that went through the pipeline stages as micro-batches, the stages working "
            "at once (prefills at --pipeline-parallel-size > 1: "
            "--pipeline-micro-batch-tokens).",
            registry=r,
        )
        self.overlapped = prometheus_client.Counter(
            "moe_pipeline_overlapped_steps",
            "Steps whose stage 0 ran while the step before was still in the later pipeline "
            "stages (--pipeline-interleave): path=graph down the compiled step graph (the "
            "last stage sampling), path=calls by plain Ray calls.",
            ["path"],
            registry=r,
        )
        self.ttft = prometheus_client.Histogram(
            "moe_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = prometheus_client.Histogram(
            "moe_request_latency_seconds",
            "Time from arrival to the end of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.expert_load = prometheus_client.Gauge(
            "moe_rank_expert_load",
            f"Token-to-expert assignments routed by each rank over the last {LOAD_WINDOW_STEPS} "
            "steps (summed over layers and experts).",
            ["rank"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._load_window: dict[int, collections.deque[int]] = {}

    def _stat(self, name: str) -> float:
        if self._stats is None:
            return 0.0
        value = getattr(self._stats(), name)
        return float(len(value) if isinstance(value, tuple) else value)

    # -- engine.seam.StepObserver ----------------------------------------------------------

    def observe_step(
        self,
        *,
        seconds: float,
        num_seqs: int,
        num_tokens: int,
        outputs: list[step_types.StepOutput],
        ahead: bool = False,
    ) -> None:
        self.steps.inc()
        if ahead:
            self.steps_ahead.inc()
        self.step_seconds.observe(seconds)
        self.batch_size.observe(num_seqs)
        self.source_reads.labels(when="step").inc(sum(out.source_reads for out in outputs))
        self.source_reads.labels(when="prefetch").inc(sum(o.prefetch_reads for o in outputs))
        if any(o.micro_batches > 1 for o in outputs):
            self.micro_batched.inc()
        if any(o.overlapped for o in outputs):
            graph = any(o.started_at for o in outputs)  # `Stepper.start`: the graph's
            self.overlapped.labels(path="graph" if graph else "calls").inc()
        with self._lock:
            seen = set()
            for out in outputs:
                seen.add(out.rank)
                load = 0 if out.expert_load is None else int(out.expert_load.sum())
                window = self._load_window.setdefault(
                    out.rank, collections.deque(maxlen=LOAD_WINDOW_STEPS)
                )
                window.append(load)
                self.expert_load.labels(rank=str(out.rank)).set(sum(window))
            for rank in set(self._load_window) - seen:
                del self._load_window[rank]
                self.expert_load.remove(str(rank))

    def observe_finished(
        self, *, reason: req.FinishReason, num_prompt_tokens: int, num_generated_tokens: int
    ) -> None:
        self.requests.labels(outcome=reason.value).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)

    # -- request level (the server) --------------------------------------------------------

    def observe_rejected(self) -> None:
        self.requests.labels(outcome="rejected").inc()

    def observe_queue_full(self) -> None:
        self.requests.labels(outcome="queue_full").inc()

    def render(self) -> bytes:
        return bytes(prometheus_client.generate_latest(self.registry))
