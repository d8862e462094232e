"""The operator's autoscaler policy (``plan.autoscale``), table-driven, no cluster: HPA's
recommendation, the stabilisation windows, their memory in status (and across a restart), and
when it must not decide."""

from __future__ import annotations

import dataclasses
import datetime
import random
from typing import Any

import pytest

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import autoscale, observe

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def spec(dp: int = 1, **autoscaling: Any) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny?seed=0"},
            "dataParallelSize": dp,
            "minDataParallelSize": 1,
            "maxDataParallelSize": 4,
            "autoscaling": {"enabled": True, **autoscaling},
        }
    )


def runtime(size: int, in_flight: int | None, **more: Any) -> observe.RuntimeObservation:
    return observe.RuntimeObservation(
        data_parallel_size=size, target_data_parallel_size=size, in_flight=in_flight, **more
    )


@pytest.mark.parametrize(
    ("in_flight", "ranks", "tolerance", "want"),
    [
        (0, 1, 0.1, 1),  # idle: the minimum
        (8, 1, 0.1, 1),  # on target
        (8.5 * 1, 1, 0.1, 1),  # within the tolerance (ratio 1.06): no change
        (9, 1, 0.1, 2),  # ratio 1.125: ceil(9 / 8)
        (9, 1, 0.2, 1),  # ... within a wider tolerance
        (16, 1, 0.1, 2),
        (17, 1, 0.1, 3),
        (100, 1, 0.1, 4),  # capped at maxDataParallelSize
        (15, 2, 0.1, 2),  # 7.5 per rank: within the tolerance
        (10, 2, 0.1, 2),  # 5 per rank: ceil(10 / 8) = 2
        (8, 2, 0.1, 1),  # 4 per rank: ceil(8 / 8) = 1
        (1, 4, 0.1, 1),
    ],
    ids=[
        "idle",
        "on-target",
        "within-tolerance",
        "above-tolerance",
        "within-wider-tolerance",
        "double",
        "just-above-double",
        "capped-at-max",
        "two-ranks-within-tolerance",
        "two-ranks-ceil",
        "two-ranks-half",
        "four-ranks-almost-idle",
    ],
)
def test_recommendation_is_hpas(in_flight: int, ranks: int, tolerance: float, want: int) -> None:
    got = autoscale.recommend(
        in_flight=int(in_flight), ranks=ranks, target=8, tolerance=tolerance, min_size=1, max_size=4
    )
    assert got == want


# -- the windows -----------------------------------------------------------------------------


def replay(
    samples: list[tuple[float, int]], *, current: int, up_s: float, down_s: float
) -> list[int]:
    """The stabilised size after each (time, recommendation) sample, ``current`` fixed."""
    runs: list[autoscale.Run] = []
    out = []
    for t, size in samples:
        runs = autoscale.remember(runs, size, now=at(t), up_s=up_s, down_s=down_s)
        out.append(autoscale.stabilize(runs, current=current, now=at(t), up_s=up_s, down_s=down_s))
    return out


@pytest.mark.parametrize(
    ("samples", "current", "want"),
    [
        # a grow needs more than the current size for the whole up window (15 s)
        ([(0, 1), (5, 2), (10, 2), (15, 2), (20, 2)], 1, [1, 1, 1, 1, 2]),
        # the lowest recommendation of the window decides: 3 then 2 grows to 2
        ([(0, 1), (5, 3), (10, 2), (15, 3), (20, 3)], 1, [1, 1, 1, 1, 2]),
        # a dip resets the wait
        ([(0, 1), (5, 2), (10, 1), (15, 2), (20, 2), (30, 2)], 1, [1, 1, 1, 1, 1, 2]),
        # a shrink needs less for the whole down window (120 s)
        ([(0, 2), (5, 1), (60, 1), (124, 1), (125, 1)], 2, [2, 2, 2, 2, 1]),
        # the highest recommendation of the down window decides
        ([(0, 3), (5, 2), (10, 1), (125, 1), (130, 1)], 3, [3, 3, 3, 2, 1]),
    ],
    ids=[
        "grow-after-window",
        "grow-to-window-min",
        "dip-resets",
        "shrink-after-window",
        "shrink-to-window-max",
    ],  # fmt: skip
)
def test_windows(samples: list[tuple[float, int]], current: int, want: list[int]) -> None:
    assert replay(samples, current=current, up_s=15, down_s=120) == want


def test_zero_windows_follow_the_load_at_once() -> None:
    samples = [(0, 1), (5, 3), (10, 1), (15, 2)]
    assert replay(samples, current=1, up_s=0, down_s=0) == [1, 3, 1, 2]


def test_memory_stays_small_under_a_load_that_never_settles() -> None:
    rng = random.Random(0)
    runs: list[autoscale.Run] = []
    for step in range(5000):
        runs = autoscale.remember(runs, rng.randint(1, 4), now=at(step), up_s=600, down_s=3600)
    assert len(runs) <= 2 * 4  # at most two runs per size


def test_pruning_never_changes_a_decision() -> None:
    """The runs kept decide as the whole history would."""
    rng = random.Random(1)
    runs: list[autoscale.Run] = []
    history: list[tuple[float, int]] = []
    t = 0.0
    for _ in range(400):
        t += rng.choice([1, 2, 5])
        size = rng.randint(1, 4)
        history.append((t, size))
        runs = autoscale.remember(runs, size, now=at(t), up_s=15, down_s=60)
        everything = full_runs(history)
        for current in (1, 2, 3, 4):
            kept = autoscale.stabilize(runs, current=current, now=at(t), up_s=15, down_s=60)
            full = autoscale.stabilize(everything, current=current, now=at(t), up_s=15, down_s=60)
            assert kept == full


def full_runs(history: list[tuple[float, int]]) -> list[autoscale.Run]:
    runs: list[autoscale.Run] = []
    for t, size in history:
        if runs and runs[-1].size == size:
            continue
        if runs:
            runs[-1] = dataclasses.replace(runs[-1], until=at(t))
        runs.append(autoscale.Run(size=size, since=at(t)))
    return runs


# -- decisions -------------------------------------------------------------------------------


@dataclasses.dataclass
class Sim:
    """The autoscaler's loop: the spec it writes, a runtime that resizes in ``resize_s``, and
    the status it keeps (round-tripped through the wire format, as the API server stores it)."""

    dp: int = 1
    live: int = 1
    resize_s: float = 30.0
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    resizing_until: float | None = None
    decisions: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    reasons: list[str] = dataclasses.field(default_factory=list)
    #: (time, in flight, serving ranks) of every sample
    samples: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)

    def step(self, t: float, in_flight: int) -> autoscale.Decision:
        if self.resizing_until is not None and t >= self.resizing_until:
            self.live, self.resizing_until = self.dp, None
        resize = None
        if self.resizing_until is not None:
            resize = status_.ResizeStatus(
                from_size=self.live, to_size=self.dp, stage=status_.Stage.STANDBY
            )
        stored = status_.MoEDeploymentStatus.model_validate(self.status)
        decision = autoscale.decide(
            spec=spec(self.dp, **self.settings),
            status=stored,
            observed=observe.Observed(runtime=runtime(self.live, in_flight), now=at(t)),
            resize=resize,
        )
        assert decision.status is not None
        self.status = {"autoscaling": decision.status.to_wire()}
        self.reasons.append(decision.status.reason or "")
        self.samples.append((t, in_flight, self.live))
        if decision.scale_to is not None:
            self.decisions.append((t, self.dp, decision.scale_to))
            self.dp = decision.scale_to
            self.resizing_until = t + self.resize_s
        return decision


def test_a_sustained_load_grows_after_the_up_window() -> None:
    sim = Sim()
    for t in range(0, 15, 5):
        decision = sim.step(t, in_flight=20)
        assert decision.scale_to is None
        assert decision.status is not None
        assert decision.status.reason == status_.REASON_SCALE_UP_STABILIZING
    decision = sim.step(15, in_flight=20)
    assert decision.scale_to == 3  # ceil(20 / 8)
    assert decision.status is not None
    assert decision.status.reason == status_.REASON_SCALED_UP
    assert decision.status.last_decision_time == "2026-01-01T00:00:15Z"
    assert decision.status.metric == 20.0 and decision.status.in_flight == 20
    assert [e.reason for e in decision.events] == [status_.REASON_SCALED_UP]
    assert decision.decision == autoscale.DECISION_SCALE_UP
    assert decision.requeue == 5.0


def test_no_decision_while_a_resize_runs() -> None:
    sim = Sim(resize_s=60)
    for t in range(0, 20, 5):
        sim.step(t, in_flight=20)
    assert sim.decisions == [(15, 1, 3)]
    for t in range(20, 75, 5):  # the load stops during the resize: nothing is decided
        decision = sim.step(t, in_flight=0)
        assert decision.scale_to is None
        assert decision.status is not None
        assert decision.status.reason == status_.REASON_WAITING_FOR_RESIZE


def test_load_gone_shrinks_to_the_minimum_after_the_down_window() -> None:
    sim = Sim(resize_s=20)
    t = 0
    while not sim.decisions:
        sim.step(t, in_flight=16)
        t += 5
    while sim.live != 2:
        sim.step(t, in_flight=16)
        t += 5
    stopped = t
    while len(sim.decisions) < 2:
        sim.step(t, in_flight=0)
        t += 5
        assert t < stopped + 300
    (_, frm, to) = sim.decisions[-1]
    assert (frm, to) == (2, 1)
    assert sim.decisions[-1][0] - stopped >= 120


@pytest.mark.parametrize("period", [2, 4, 6, 10], ids=lambda p: f"every-{p}s")
@pytest.mark.parametrize("start", [1, 2], ids=["from-1", "from-2"])
def test_a_flapping_load_resizes_nothing(period: int, start: int) -> None:
    """High (32 in flight) and idle in turns, faster than the up window: no resize."""
    sim = Sim(dp=start, live=start)
    for t in range(0, 600):  # one sample a second: the densest sampling
        sim.step(t, in_flight=32 if (t // period) % 2 == 0 else 0)
    assert sim.decisions == []


@pytest.mark.parametrize("seed", range(6))
def test_no_more_resizes_than_the_windows_allow(seed: int) -> None:
    """Random loads: every grow was preceded by a whole up window of samples asking for more,
    every shrink by a whole down window asking for less, re-derived from the raw samples: the
    sample in force when the window opened and every later one."""
    rng = random.Random(seed)
    sim = Sim(resize_s=rng.choice([5, 20, 40]))
    t, level = 0.0, 0
    while t < 1800:
        if rng.random() < 0.1:
            level = rng.choice([0, 4, 12, 20, 40])
        sim.step(t, in_flight=level)
        t += rng.choice([1, 3, 5, 8])
    assert sim.decisions, "the loads were meant to resize sometimes"
    for when, frm, to in sim.decisions:
        cut = when - (15 if to > frm else 120)
        assert sim.samples[0][0] <= cut, "a decision before the first whole window"
        opened = max(s for s, _, _ in sim.samples if s <= cut)
        recs = [
            autoscale.recommend(
                in_flight=n, ranks=ranks, target=8, tolerance=0.1, min_size=1, max_size=4
            )
            for s, n, ranks in sim.samples
            if opened <= s <= when
        ]
        if to > frm:
            assert min(recs) > frm and to == min(recs), (when, frm, to, recs)
        else:
            assert max(recs) < frm and to == max(recs), (when, frm, to, recs)
    assert len(sim.decisions) <= 1800 / 15


def test_a_restarted_operator_decides_as_the_last_one_would() -> None:
    """The windows' memory is status: a new process reading it mid-window does not grow early."""
    sim = Sim()
    sim.step(0, in_flight=0)
    sim.step(5, in_flight=20)
    sim.step(10, in_flight=20)
    stored = status_.MoEDeploymentStatus.model_validate(sim.status)  # what a new process reads
    decision = autoscale.decide(
        spec=spec(1),
        status=stored,
        observed=observe.Observed(runtime=runtime(1, 20), now=at(15)),
        resize=None,
    )
    assert decision.scale_to is None  # 20 in flight since t=5: the window ends at t=20
    assert decision.status is not None
    stored = status_.MoEDeploymentStatus.model_validate({"autoscaling": decision.status.to_wire()})
    decision = autoscale.decide(
        spec=spec(1),
        status=stored,
        observed=observe.Observed(runtime=runtime(1, 20), now=at(20)),
        resize=None,
    )
    assert decision.scale_to == 3


def test_a_steady_load_writes_nothing_new() -> None:
    sim = Sim()
    sim.step(0, in_flight=4)
    first = dict(sim.status)
    sim.step(5, in_flight=4)
    assert sim.status == first


@pytest.mark.parametrize(
    ("resize", "observation", "why"),
    [
        (
            status_.ResizeStatus(from_size=1, to_size=2, stage=status_.Stage.PROVISIONING),
            runtime(1, 20),
            "resize 1->2 is in stage Provisioning",
        ),
        (
            status_.ResizeStatus(
                from_size=2, to_size=1, stage=status_.Stage.RECOVERING, kind="recovery"
            ),
            runtime(2, 20),
            "recovery 2->1",
        ),
        (
            None,
            runtime(
                1,
                20,
                resize=observe.RuntimeResize(
                    resize_id="r1", from_size=1, to_size=3, stage="Standby"
                ),
            ),
            "the runtime runs resize 1->3",
        ),
        (None, runtime(1, 20, lost=(observe.LostRank(pod="w-1", reason="dead"),)), "lost"),
    ],
    ids=["resize", "recovery", "runtime-resize", "ranks-lost"],
)
def test_never_decides_while_busy(
    resize: status_.ResizeStatus | None, observation: observe.RuntimeObservation, why: str
) -> None:
    decision = autoscale.decide(
        spec=spec(1, scaleUpStabilizationSeconds=0),
        status=status_.MoEDeploymentStatus(),
        observed=observe.Observed(runtime=observation, now=at(0)),
        resize=resize,
    )
    assert decision.scale_to is None
    assert decision.status is not None
    assert decision.status.reason == status_.REASON_WAITING_FOR_RESIZE
    assert why in (decision.status.message or "")
    assert decision.status.desired_size == 3  # shown, not acted on


def test_stands_down_for_an_external_autoscaler() -> None:
    decide = dict(
        spec=spec(1, scaleUpStabilizationSeconds=0),
        observed=observe.Observed(runtime=runtime(1, 40), now=at(0)),
        resize=None,
        external_autoscaler="HorizontalPodAutoscaler tiny",
    )
    first = autoscale.decide(status=status_.MoEDeploymentStatus(), **decide)  # type: ignore[arg-type]
    assert first.scale_to is None
    assert first.status is not None
    assert first.status.reason == status_.REASON_EXTERNAL_AUTOSCALER
    assert "HorizontalPodAutoscaler tiny" in (first.status.message or "")
    assert [e.reason for e in first.events] == [status_.REASON_EXTERNAL_AUTOSCALER]
    assert first.decision == autoscale.DECISION_EXTERNAL
    again = autoscale.decide(
        status=status_.MoEDeploymentStatus(autoscaling=first.status),
        **decide,  # type: ignore[arg-type]
    )
    assert again.events == () and again.decision is None  # said once


def test_without_a_metric_nothing_is_decided() -> None:
    for observation in (None, runtime(1, None)):
        decision = autoscale.decide(
            spec=spec(1),
            status=status_.MoEDeploymentStatus(),
            observed=observe.Observed(runtime=observation, now=at(0)),
            resize=None,
        )
        assert decision.scale_to is None
        assert decision.status is not None
        assert decision.status.reason == status_.REASON_METRIC_UNAVAILABLE


def test_disabled_clears_the_status() -> None:
    off = spec_.MoEDeploymentSpec.model_validate(
        {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 1}
    )
    decision = autoscale.decide(
        spec=off,
        status=status_.MoEDeploymentStatus(
            autoscaling=status_.AutoscalingStatus(reason=status_.REASON_STABLE)
        ),
        observed=observe.Observed(runtime=runtime(1, 40), now=at(0)),
        resize=None,
    )
    assert decision == autoscale.Decision(status=None)


def test_a_refused_scale_keeps_the_last_decision() -> None:
    before = status_.AutoscalingStatus(
        last_decision_time="2025-12-31T00:00:00Z", last_decision="1->2"
    )
    decision = autoscale.decide(
        spec=spec(2, scaleUpStabilizationSeconds=0),
        status=status_.MoEDeploymentStatus(autoscaling=before),
        observed=observe.Observed(runtime=runtime(2, 40), now=at(0)),
        resize=None,
    )
    assert decision.scale_to == 4
    failed = autoscale.scale_failed(decision, "HTTP 409", before=before)
    assert failed.scale_to is None
    assert failed.status is not None
    assert failed.status.reason == status_.REASON_SCALE_FAILED
    assert failed.status.last_decision == "1->2"
    assert failed.decision == autoscale.DECISION_FAILED


@pytest.mark.parametrize(
    ("ref", "labels", "want"),
    [
        (
            {"apiVersion": "elasticmoe.io/v1alpha1", "kind": "MoEDeployment", "name": "tiny"},
            {},
            "HorizontalPodAutoscaler h",
        ),
        (
            {"apiVersion": "elasticmoe.io/v1alpha1", "kind": "MoEDeployment", "name": "tiny"},
            {"scaledobject.keda.sh/name": "tiny-so"},
            "KEDA ScaledObject tiny-so (HorizontalPodAutoscaler h)",
        ),
        ({"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny"}, {}, None),
        (
            {"apiVersion": "elasticmoe.io/v1alpha1", "kind": "MoEDeployment", "name": "other"},
            {},
            None,
        ),
    ],
    ids=["hpa", "keda", "another-kind", "another-deployment"],
)
def test_finds_an_autoscaler_that_targets_the_deployment(
    ref: dict[str, str], labels: dict[str, str], want: str | None
) -> None:
    hpa = {"metadata": {"name": "h", "labels": labels}, "spec": {"scaleTargetRef": ref}}
    assert autoscale.external([hpa], name="tiny") == want
