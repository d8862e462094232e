"""Prometheus metrics of the operator (``moe-operator run --metrics HOST:PORT`` serves them on
``/metrics``): reconciles and their latency, resizes by outcome, stage durations, the stage
each deployment is in, sizes, the autoscaler's decisions and the runtime's reachability.

Everything is derived from what a reconcile returns (:class:`moe_operator.reconcile.Outcome`:
the status before and after), so a resize is counted once when its status turns Completed or
Failed, also across operator restarts (the stored status already says it ended).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Final, Protocol

import prometheus_client

from moe_contract import stages
from moe_operator.api import status as status_
from moe_operator.plan import autoscale

_RECONCILE_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STAGE_BUCKETS: Final = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: ``result`` of a reconcile.
RESULT_OK: Final = "ok"
RESULT_ERROR: Final = "error"
RESULT_INVALID_SPEC: Final = "invalid_spec"
#: ``stage`` of ``moe_operator_resize_stage``: Idle, then every resize stage.
STAGES: Final = (stages.Stage.IDLE.value, *(s.value for s in stages.RESIZE_STAGES))


class ReconcileOutcome(Protocol):
    """What :meth:`OperatorMetrics.observe` reads of a ``reconcile.Outcome``."""

    @property
    def previous(self) -> status_.MoEDeploymentStatus | None: ...
    @property
    def status(self) -> status_.MoEDeploymentStatus | None: ...
    @property
    def runtime_reachable(self) -> bool | None: ...
    @property
    def autoscale_decision(self) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class Finished:
    """A resize (or recovery) that ended in this reconcile."""

    direction: str
    outcome: str
    kind: str
    stage_durations: dict[str, float]
    seconds: float | None


def _key(r: status_.ResizeStatus) -> tuple[Any, ...]:
    return (r.resize_id, r.started_at, r.from_size, r.to_size, r.kind)


def finished(
    previous: status_.ResizeStatus | None, new: status_.ResizeStatus | None
) -> Finished | None:
    """The resize ``new`` when this reconcile ended it (it was not already ended before)."""
    if new is None or new.active:
        return None
    if previous is not None and not previous.active and _key(previous) == _key(new):
        return None
    total = None
    if new.stage_durations:
        total = round(sum(new.stage_durations.values()), 3)
    return Finished(
        direction="up" if new.to_size > new.from_size else "down",
        outcome="completed" if new.stage is status_.Stage.COMPLETED else "failed",
        kind=new.kind or status_.KIND_RESIZE,
        stage_durations=dict(new.stage_durations or {}),
        seconds=total,
    )


class OperatorMetrics:
    """The operator's metrics, in a registry of their own."""

    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.registry = registry or prometheus_client.CollectorRegistry()
        r = self.registry
        self.reconciles = prometheus_client.Counter(
            "moe_operator_reconciles",
            "Reconciles of a MoEDeployment by result (ok, error, invalid_spec).",
            ["result"],
            registry=r,
        )
        self.reconcile_seconds = prometheus_client.Histogram(
            "moe_operator_reconcile_seconds",
            "Duration of one reconcile (observe, plan, apply, status write).",
            buckets=_RECONCILE_BUCKETS,
            registry=r,
        )
        self.resizes = prometheus_client.Counter(
            "moe_operator_resizes",
            "Resizes (kind resize) and recoveries (kind recovery) that ended, by direction and "
            "outcome (completed, failed).",
            ["direction", "outcome", "kind"],
            registry=r,
        )
        self.resize_seconds = prometheus_client.Histogram(
            "moe_operator_resize_seconds",
            "Duration of a resize that ended (sum of its stages).",
            ["direction", "outcome"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.stage_seconds = prometheus_client.Histogram(
            "moe_operator_resize_stage_seconds",
            "Duration of each stage of the resizes that ended.",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.stage = prometheus_client.Gauge(
            "moe_operator_resize_stage",
            "1 for the stage a deployment's resize is in now (Idle when none runs), else 0.",
            ["namespace", "deployment", "stage"],
            registry=r,
        )
        self.size = prometheus_client.Gauge(
            "moe_operator_data_parallel_size",
            "Data-parallel ranks serving now (status.dataParallelSize).",
            ["namespace", "deployment"],
            registry=r,
        )
        self.target = prometheus_client.Gauge(
            "moe_operator_target_data_parallel_size",
            "Data-parallel size asked for (spec.dataParallelSize).",
            ["namespace", "deployment"],
            registry=r,
        )
        self.runtime_reachable = prometheus_client.Gauge(
            "moe_operator_runtime_reachable",
            "1 when the runtime answered the last reconcile's GET /elastic_ep/status, else 0.",
            ["namespace", "deployment"],
            registry=r,
        )
        self.runtime_unreachable = prometheus_client.Counter(
            "moe_operator_runtime_unreachable",
            "Reconciles in which a ready head's runtime did not answer.",
            ["namespace", "deployment"],
            registry=r,
        )
        self.decisions = prometheus_client.Counter(
            "moe_operator_autoscaler_decisions",
            "Decisions of the operator's autoscaler (scale_up, scale_down, external: stood "
            "down for another autoscaler, failed: the scale write was refused).",
            ["namespace", "deployment", "decision"],
            registry=r,
        )
        self.in_flight_per_rank = prometheus_client.Gauge(
            "moe_operator_autoscaler_in_flight_per_rank",
            "The autoscaler's metric: running + queued sequences per serving rank.",
            ["namespace", "deployment"],
            registry=r,
        )
        self.desired_size = prometheus_client.Gauge(
            "moe_operator_autoscaler_desired_size",
            "The size the autoscaler wants now (after its stabilisation windows).",
            ["namespace", "deployment"],
            registry=r,
        )
        self.rollouts = prometheus_client.Counter(
            "moe_operator_rollouts",
            "Rollouts of a template change that ended, by outcome (Completed, RolledBack).",
            ["outcome"],
            registry=r,
        )
        self.rollout_ranks = prometheus_client.Gauge(
            "moe_operator_rollout_ranks_moved",
            "Ranks serving on the running rollout's new RayCluster (0 when none runs).",
            ["namespace", "deployment"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._known: set[tuple[str, str]] = set()

    def observe_reconcile(self, seconds: float, result: str) -> None:
        self.reconciles.labels(result=result).inc()
        self.reconcile_seconds.observe(seconds)

    def observe(self, namespace: str, name: str, outcome: ReconcileOutcome) -> None:
        """Everything one reconcile of ``namespace/name`` says."""
        labels = {"namespace": namespace, "deployment": name}
        with self._lock:
            self._known.add((namespace, name))
        new = outcome.status
        if new is not None:
            ended = finished(outcome.previous.resize if outcome.previous else None, new.resize)
            if ended is not None:
                self.resizes.labels(
                    direction=ended.direction, outcome=ended.outcome, kind=ended.kind
                ).inc()
                for stage, seconds in ended.stage_durations.items():
                    self.stage_seconds.labels(stage=stage).observe(seconds)
                if ended.seconds is not None and ended.kind == status_.KIND_RESIZE:
                    self.resize_seconds.labels(
                        direction=ended.direction, outcome=ended.outcome
                    ).observe(ended.seconds)
            now = new.resize.stage.value if new.resize is not None and new.resize.active else "Idle"
            for stage in STAGES:
                self.stage.labels(**labels, stage=stage).set(1.0 if stage == now else 0.0)
            if new.data_parallel_size is not None:
                self.size.labels(**labels).set(new.data_parallel_size)
            if new.target_data_parallel_size is not None:
                self.target.labels(**labels).set(new.target_data_parallel_size)
            self._observe_rollout(labels, outcome.previous, new)
            auto = new.autoscaling
            if auto is not None and auto.metric is not None:
                self.in_flight_per_rank.labels(**labels).set(auto.metric)
            if auto is not None and auto.desired_size is not None:
                self.desired_size.labels(**labels).set(auto.desired_size)
        if outcome.runtime_reachable is not None:
            self.runtime_reachable.labels(**labels).set(1.0 if outcome.runtime_reachable else 0.0)
            if not outcome.runtime_reachable:
                self.runtime_unreachable.labels(**labels).inc()
        if outcome.autoscale_decision is not None:
            self.decisions.labels(**labels, decision=outcome.autoscale_decision).inc()

    def _observe_rollout(
        self,
        labels: dict[str, str],
        previous: status_.MoEDeploymentStatus | None,
        new: status_.MoEDeploymentStatus,
    ) -> None:
        """A rollout counted once, in the reconcile that ends it; its moved ranks while it
        runs."""
        was = previous.rollout if previous is not None else None
        now = new.rollout
        running = now is not None and now.active
        self.rollout_ranks.labels(**labels).set(now.ranks_moved if running and now else 0.0)
        if now is not None and not running and was is not None and was.active:
            self.rollouts.labels(outcome=now.stage.value).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted deployment (the operator-wide ones stay)."""
        with self._lock:
            self._known.discard((namespace, name))
        for metric in (
            self.size,
            self.target,
            self.runtime_reachable,
            self.runtime_unreachable,
            self.in_flight_per_rank,
            self.desired_size,
            self.rollout_ranks,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)
        for stage in STAGES:
            with contextlib.suppress(KeyError):
                self.stage.remove(namespace, name, stage)
        for decision in autoscale.DECISIONS:
            with contextlib.suppress(KeyError):
                self.decisions.remove(namespace, name, decision)

    def render(self) -> bytes:
        return bytes(prometheus_client.generate_latest(self.registry))

    def serve(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port`` from a thread; returns the server
        (``shutdown()`` stops it)."""
        server, _thread = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry
        )
        return server


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT`` for every address) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
