"""Elasticity of one serving process: coordinator + stage mechanics + EPLB + recovery + status +
metrics + routes.

`ElasticService.attach(...)` is what `moe-runtime serve` calls once its engine and executor
serve; it returns the admin router to mount, the readiness check of `GET /ready`, and keeps
the Prometheus figures of resizes and recoveries. Status reads only what the heartbeat already
knows: it never calls a rank (so it never blocks the server's event loop).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import fastapi
import prometheus_client

from moe_contract import status as contract
from moe_runtime.elastic import admin, rebalance, records, recovery, resize, settings, stages
from moe_runtime.elastic import coordinator as coord_mod
from moe_runtime.elastic import ops as ops_mod
from moe_runtime.elastic import rank_pool as rank_pool_mod
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.elastic import spares as spares_mod
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import health as executor_health
from moe_runtime.model import config as config_mod

log = logging.getLogger(__name__)

_RESIZE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_BLACKOUT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ElasticMetrics:
    """Prometheus figures of resizes and EPLB, in the server's registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        r = registry
        self.resizes = prometheus_client.Counter(
            "moe_resizes", "Finished resizes by outcome.", ["outcome", "direction"], registry=r
        )
        self.resize_seconds = prometheus_client.Histogram(
            "moe_resize_seconds", "Duration of a resize.", buckets=_RESIZE_BUCKETS, registry=r
        )
        self.stage_seconds = prometheus_client.Histogram(
            "moe_resize_stage_seconds",
            "Duration of one resize stage.",
            ["stage"],
            buckets=_RESIZE_BUCKETS,
            registry=r,
        )
        self.blackout_seconds = prometheus_client.Histogram(
            "moe_resize_blackout_seconds",
            "Longest interval of a resize in which no request made progress.",
            buckets=_BLACKOUT_BUCKETS,
            registry=r,
        )
        self.bytes_moved = prometheus_client.Counter(
            "moe_resize_bytes_moved", "Weight bytes moved by resizes.", ["kind"], registry=r
        )
        self.scaling = prometheus_client.Gauge(
            "moe_is_scaling", "1 while a resize runs.", registry=r
        )
        self.target = prometheus_client.Gauge(
            "moe_target_data_parallel_size", "DP size being resized to.", registry=r
        )
        self.balancedness = prometheus_client.Gauge(
            "moe_eplb_balancedness",
            "Mean over max tokens per EP rank, over the EPLB window (1 = perfect).",
            registry=r,
        )
        self.rebalances = prometheus_client.Gauge(
            "moe_eplb_rebalances", "Dynamic EPLB placement changes applied.", registry=r
        )
        self.recoveries = prometheus_client.Counter(
            "moe_recoveries",
            "Finished recoveries from lost ranks by outcome.",
            ["outcome"],
            registry=r,
        )
        self.recovery_seconds = prometheus_client.Histogram(
            "moe_recovery_seconds",
            "From the detection of a lost rank to serving again on the survivors.",
            buckets=_BLACKOUT_BUCKETS,
            registry=r,
        )
        self.ranks_lost = prometheus_client.Counter(
            "moe_ranks_lost", "Ranks found dead or hung (and fenced).", registry=r
        )
        self.rank_pool = prometheus_client.Gauge(
            "moe_rank_pool_ready",
            "Rank processes started ahead, weightless, that a grow can take now (--rank-pool).",
            registry=r,
        )
        self.spare_failures = prometheus_client.Counter(
            "moe_warm_spare_failures",
            "Failed passes of the warm spares' upkeep (start, standby groups, weights, "
            "pre-staging); each is retried from what is live.",
            registry=r,
        )
        self.requests_rerun = prometheus_client.Counter(
            "moe_recovery_requests_rerun",
            "Sequences of lost ranks re-run on survivors from prompt + generated tokens.",
            registry=r,
        )

    def on_record(self, record: records.ResizeRecord) -> None:
        self.scaling.set(0 if record.done else 1)
        self.target.set(record.to_size)
        if not record.done:
            return
        if record.recovery is not None:
            info = record.recovery
            self.recoveries.labels(outcome="completed" if record.succeeded else "failed").inc()
            if info.recovered_at is not None:
                self.recovery_seconds.observe(info.recovered_at - info.detected_at)
            self.ranks_lost.inc(len(info.ranks_lost))
            self.requests_rerun.inc(info.requests_rerun)
            return
        direction = "up" if record.to_size > record.from_size else "down"
        outcome = "completed" if record.succeeded else "failed"
        self.resizes.labels(outcome=outcome, direction=direction).inc()
        if record.duration_s is not None:
            self.resize_seconds.observe(record.duration_s)
        for stage, seconds in record.stage_durations().items():
            self.stage_seconds.labels(stage=stage).observe(seconds)
        self.blackout_seconds.observe(record.blackout_s)
        self.bytes_moved.labels(kind="non_expert").inc(record.bytes_non_expert)
        self.bytes_moved.labels(kind="expert").inc(record.bytes_expert)


@dataclasses.dataclass
class ElasticService:
    """Everything a serving process needs to resize; build it with `attach`."""

    coordinator: coord_mod.Coordinator
    ops: ops_mod.EngineResizeOps
    rebalancer: rebalance.Rebalancer
    recovery: recovery.Recovery
    engine: engine_core.Engine
    executor: executor_base.Executor
    live: settings.LiveSettings
    metrics: ElasticMetrics | None = None
    spares: spares_mod.SparePool | None = None
    rank_pool: rank_pool_mod.RankPool | None = None

    @classmethod
    def attach(
        cls,
        *,
        engine: engine_core.Engine,
        executor: executor_base.Executor,
        model_config: config_mod.ModelConfig,
        placement: policy.Placement,
        config: serving_mod.ElasticConfig,
        limits: coord_mod.Limits,
        registry: prometheus_client.CollectorRegistry | None = None,
        epoch: int = 0,
        drain_timeout: float = 0.0,
    ) -> ElasticService:
        serving = serving_mod.Serving(
            placement=placement, num_ranks=executor.num_ranks, epoch=epoch, next_epoch=epoch + 1
        )
        rebalancer = rebalance.Rebalancer(
            engine=engine,
            executor=executor,
            serving=serving,
            load=serving_mod.LoadTracker(model_config, config.eplb_window_size),
            config=config,
            mechanics=threading.Lock(),
        )
        engine.on_step(rebalancer.on_step)
        # What resizes and recoveries change, shared by both (its spares come below).
        ctx = resize.ResizeContext(
            engine=engine,
            executor=executor,
            model_config=model_config,
            serving=serving,
            config=config,
            rebalancer=rebalancer,
        )
        mechanics = ops_mod.EngineResizeOps(ctx)

        def busy() -> bool:
            stats = engine.stats()
            return stats.num_running + stats.num_waiting > 0

        coord = coord_mod.Coordinator(
            mechanics, limits=limits, busy=busy, drain_timeout=drain_timeout
        )
        # A resize or recovery never causes a 429: arrivals meanwhile are queued unbounded.
        engine.queue.set_exempt(lambda: coord.is_scaling)
        fault = recovery.Recovery(ctx, coordinator=coord)
        # Always there (its thread only while it keeps spares): warm_spare_ranks is live.
        pool = spares_mod.SparePool(
            executor=executor,
            serving=serving,
            config=config,
            mechanics=ctx.mechanics,
            busy=lambda: coord.current is not None,
        )
        ctx.spares = pool
        ctx.rank_pool = rank_pool = rank_pool_mod.RankPool(
            executor=executor,
            size=config.rank_pool,
            busy=lambda: coord.current is not None,
            timeout=config.rpc_timeout,
        )
        pool.prestager.target_for = ctx.target_for
        pool.prestager.fits = ctx.fits
        pool.prestager.max_size = lambda: coord.limits.max_size
        service = cls(
            coordinator=coord,
            ops=mechanics,
            rebalancer=rebalancer,
            recovery=fault,
            engine=engine,
            executor=executor,
            live=settings.LiveSettings(
                coordinator=coord,
                engine=engine,
                ops=mechanics,
                rebalancer=rebalancer,
                recovery=fault,
                spares=pool,
            ),
            spares=pool,
            rank_pool=rank_pool,
        )
        engine.on_step(lambda outputs: coord.tracker.on_step(_produced(outputs), busy()))
        if registry is not None:
            service.metrics = ElasticMetrics(registry)
            coord.on_change(service.metrics.on_record)
            service.metrics.balancedness.set_function(ctx.balancedness)
            service.metrics.rebalances.set_function(lambda: rebalancer.rebalances)
            service.metrics.rank_pool.set_function(lambda: len(rank_pool.ready()))
            pool.on_failure = service.metrics.spare_failures.inc
        coord.on_change(_log_stage)
        fault.attach()
        pool.start()
        rank_pool.start()
        return service

    def close(self) -> None:
        """Stop the spares' and the rank pool's upkeep, the heartbeat and the grow-back loop
        (before the executor shuts down)."""
        if self.spares is not None:
            self.spares.close()
        if self.rank_pool is not None:
            self.rank_pool.close()
        self.recovery.close()

    def router(self, *, token: str | admin.TokenSource | None = None) -> fastapi.APIRouter:
        return admin.build_router(
            self.coordinator,
            status_fn=self.status,
            token=token,
            fail_rank=self.fail_rank,
            live=self.live,
        )

    def fail_rank(self, rank: int, operation: str) -> None:
        """Test hook: the next `operation` of rank `rank` fails (`RankWorker.fail_next`)."""
        self.executor.collective_rpc("fail_next", operation, ranks=[rank], timeout=30)

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for GET /ready: the engine loop runs and a step path exists."""
        if not self.engine.is_alive():
            return False, "the engine loop is not running"
        if self.executor.has_step_path():
            return True, "serving"
        lost = sorted(self.executor.lost_ranks())
        if self.coordinator.recovering:
            return False, f"no step path: recovering from lost ranks {lost}"
        return False, f"no step path (lost ranks {lost}); the next step rebuilds it"

    def status(self) -> dict[str, Any]:
        """The body of GET /elastic_ep/status (docs/RUNTIME.md): ``moe_contract.status.ElasticStatus``,
        built strictly (a key the contract does not declare is an error, not a silent extra)."""
        current = self.coordinator.current
        last = self.coordinator.last()
        serving = self.ops.ctx.serving
        active = set(self.executor.ranks)
        infos = self.executor.rank_infos()
        health = self.executor.health()
        placement, num_ranks = serving.layout()
        slots = placement.slots_per_rank(num_ranks)
        spared = self.spares.labels() if self.spares is not None else set()
        ranks = []
        for label, info in sorted(infos.items()):
            if label in spared:
                continue  # listed under "spares"
            h = health.get(label)
            ranks.append(
                contract.Rank(
                    rank=label,
                    active=label in active,
                    node_id=info.get("node_id"),
                    pod=info.get("pod"),
                    pid=info.get("pid"),
                    tp_pids=list(info.get("tp_pids") or []),
                    pp_pids=list(info.get("pp_pids") or []),
                    healthy=h is not None and h.state == executor_health.HEALTH_OK,
                    state=h.state if h is not None else executor_health.HEALTH_OK,
                    num_experts=slots if label in active else 0,
                )
            )
        if self.recovery.degraded():
            # Lost ranks stay listed (unhealthy) until the size before the loss is back; their
            # label is gone (survivors were renumbered), so they carry it as lost_rank.
            for lost in self.recovery.lost:
                ranks.append(
                    contract.Rank(
                        rank=None,
                        lost_rank=lost["rank"],
                        active=False,
                        node_id=lost.get("node_id"),
                        pod=lost.get("pod"),
                        pid=lost.get("pid"),
                        healthy=False,
                        state=lost.get("state", executor_health.HEALTH_DEAD),
                        num_experts=0,
                    )
                )
        ready, reason = self.readiness()
        engine_stats = self.engine.stats()
        stage = current.stage if current is not None else stages.Stage.IDLE
        if current is None and last is not None:
            stage = last.stage
        spares: dict[str, Any] = (
            self.spares.status()
            if self.spares is not None
            else {"warm_spare_ranks": 0, "spares": []}
        )
        return contract.ElasticStatus(
            data_parallel_size=self.executor.num_ranks,
            target_data_parallel_size=current.to_size if current else self.executor.num_ranks,
            is_scaling=current is not None,
            stage=stage.value,
            resize=contract.Resize.exact(last.to_json()) if last is not None else None,
            history=[contract.Resize.exact(r.to_json()) for r in self.coordinator.history()],
            ranks=ranks,
            ready=ready,
            ready_reason=reason,
            auto_recover=contract.AutoRecover.exact(self.recovery.status()),
            warm_spare_ranks=spares["warm_spare_ranks"],
            spares=[contract.Spare.exact(s) for s in spares["spares"]],
            # What the operator's autoscaler decides on: sequences running + queued.
            load=contract.Load(
                running=engine_stats.num_running,
                waiting=engine_stats.num_waiting,
                in_flight=engine_stats.num_running + engine_stats.num_waiting,
            ),
            eplb=contract.Eplb(
                balancedness=self.ops.ctx.balancedness(),
                num_physical_experts=serving.placement.num_physical,
                rebalances=self.rebalancer.rebalances,
                last_rebalance=self.rebalancer.last_rebalance,
            ),
        ).to_json()


def _produced(outputs: list[Any]) -> int:
    return sum(len(o.tokens) for o in outputs)


def _log_stage(record: records.ResizeRecord) -> None:
    log.info(
        "resize %s %d->%d: %s%s",
        record.resize_id,
        record.from_size,
        record.to_size,
        record.stage.value,
        f" ({record.message})" if record.message else "",
    )
