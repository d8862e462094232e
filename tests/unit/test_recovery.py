"""Failure handling without Ray: the recovery planner, the heartbeat's verdicts and fencing,
boundary deadlines that cancel, recovery records, and a shrink around a fenced rank of an
in-process deployment (LocalExecutor: real workers and gloo groups) under load."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_runtime import server
from moe_runtime import step as step_mod
from moe_runtime.elastic import coordinator, records, service, serving, stages
from moe_runtime.engine import core, seam
from moe_runtime.engine import request as req_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base, local
from moe_runtime.executor import health as health_mod
from moe_runtime.model import generate
from moe_runtime.model import source as source_mod
from tests.support import engine_fakes, polling

SOURCE = "synthetic://tiny?seed=0"
DEADLINE = 60.0


# ------------------------------------------------------------------- the recovery planner


def _slots(p: policy.Placement, layer: int, rank: int, n: int) -> set[int]:
    return set(p.experts_on_rank(layer, rank, n))


@pytest.mark.parametrize(
    ("num_ranks", "num_physical", "survivors"),
    [
        pytest.param(3, 9, [0, 2], id="middle-rank-lost"),
        pytest.param(4, 12, [1, 2, 3], id="first-rank-lost"),
        pytest.param(4, 8, [0, 3], id="two-ranks-lost"),
    ],
)
def test_recovery_plan_gives_survivors_every_expert_sending_only_from_survivors(
    num_ranks: int, num_physical: int, survivors: list[int]
) -> None:
    layers, experts = 3, 8
    old = policy.identity(layers, experts, num_physical, num_ranks)
    load = torch.arange(layers * experts, dtype=torch.int64).reshape(layers, experts) % 5 + 1
    n = len(survivors)
    physical = policy.num_physical_for(experts, n)
    plan = moves_mod.plan_recovery(
        load, old, old_num_ranks=num_ranks, survivors=survivors, num_physical=physical
    )
    plan.target.validate(n)
    assert all(m.src_rank < n and m.dst_rank < n for m in plan.moves)
    lost = [r for r in range(num_ranks) if r not in survivors]
    want_source = want_replicas = 0
    for layer in range(layers):
        kept = set().union(*(_slots(old, layer, r, num_ranks) for r in survivors))
        gone = set().union(*(_slots(old, layer, r, num_ranks) for r in lost))
        want_source += len(gone - kept)
        want_replicas += len(gone & kept)
        for new_rank, old_rank in enumerate(survivors):
            needed = _slots(plan.target, layer, new_rank, n)
            brought = {m.logical for m in plan.moves if m.layer == layer and m.dst_rank == new_rank}
            held = _slots(old, layer, old_rank, num_ranks)
            from_source = needed - held - brought
            # what no move brings is only what no survivor holds (read from the source)
            assert from_source <= gone - kept
            for m in plan.moves:
                if m.layer == layer and m.dst_rank == new_rank:
                    assert m.logical in _slots(old, layer, survivors[m.src_rank], num_ranks)
    assert (plan.from_source, plan.from_replicas) == (want_source, want_replicas)


def test_recovery_plan_refuses_no_survivor() -> None:
    with pytest.raises(ValueError, match="at least one"):
        moves_mod.plan_recovery(
            torch.ones(1, 4, dtype=torch.int64),
            policy.identity(1, 4, 4, 2),
            old_num_ranks=2,
            survivors=[],
            num_physical=4,
        )


# ---------------------------------------------------------------- heartbeat and fencing


def _poll(condition: Callable[[], object], what: str, deadline: float = DEADLINE) -> None:
    polling.poll(condition, what, deadline, every=0.005)


def test_heartbeat_fences_a_rank_that_stops_answering_and_steps_then_name_it() -> None:
    placement = policy.identity(4, 8, 8, 2)
    ex = local.LocalExecutor(2)
    try:
        ex.start(SOURCE, placement=placement)
        hung = threading.Event()
        worker = ex.worker(1)
        answer = worker.ping

        def ping() -> dict[str, Any]:
            hung.wait(DEADLINE)  # a hang: the ping never comes back until the test ends
            return answer()

        worker.ping = ping  # type: ignore[method-assign]
        found: list[dict[int, str]] = []
        ex.heartbeat.start(interval=0.02, hang_timeout=0.3, on_lost=found.append)
        _poll(lambda: found, "the heartbeat to find rank 1")
        assert found == [{1: health_mod.HEALTH_UNRESPONSIVE}]
        lost = ex.lost_ranks()
        assert list(lost) == [1] and lost[1].fenced and "no heartbeat answer" in lost[1].reason
        assert ex.health()[0].state == health_mod.HEALTH_OK
        with pytest.raises(base.RankDied) as raised:
            ex.execute_step(step_mod.StepInput(0, {}))
        assert raised.value.ranks == [1]
        hung.set()
    finally:
        ex.shutdown()


class Pings:
    """The pings a `Heartbeat` sends, answered at once except by the `hung` labels; and the
    workers it fenced."""

    def __init__(self, hung: set[int]) -> None:
        self.hung = hung
        self.fenced: list[int] = []

    def send(self, label: int) -> int:
        return label

    def poll(self, label: int) -> str | None:
        return None if label in self.hung else health_mod.HEALTH_OK

    def fence(self, labels: list[int], *, reason: str) -> None:
        self.fenced += labels


def test_a_pending_worker_gets_the_longer_pending_hang_timeout() -> None:
    """A worker in no step (starting, loading, a warm spare) that answers pings slowly blocks
    nobody: it is fenced only after `pending_hang_timeout`, not `hang_timeout` (rounds of the
    heartbeat on its own clock: ranks 0 and 1 step, worker 2 is pending and never answers)."""
    members = {label: health_mod.RankHealth() for label in (0, 1, 2)}
    pings = Pings(hung={2})
    now = [0.0]
    beat = health_mod.Heartbeat(
        members=lambda: members,
        stepping=lambda: [0, 1],
        send_ping=pings.send,
        poll_ping=pings.poll,
        fence=pings.fence,
        clock=health_mod.StepClock(),
        now=lambda: now[0],
    )
    beat.pending_hang_timeout = 1.0
    found = []
    for t in (0.0, 0.1, 0.3, 0.6, 0.9, 1.2):  # hang_timeout 0.2 passes at once, 1.0 at 1.2
        now[0] = t
        found.append(beat.round(hang_timeout=0.2))
    assert found[:-1] == [{}] * 5  # not after hang_timeout
    assert found[-1] == {2: health_mod.HEALTH_UNRESPONSIVE} and pings.fenced == [2]
    assert beat.health()[0].state == beat.health()[1].state == health_mod.HEALTH_OK


def test_a_lost_stepped_worker_makes_its_peers_abort_their_groups() -> None:
    """A stepped worker found lost (dead, or hung and fenced) makes the heartbeat ask its peers
    to abort their live groups at once (NCCL notices no dead peer by itself); a lost pending
    worker (in no step group) does not."""
    members = {label: health_mod.RankHealth() for label in (0, 1, 2, 3)}
    pings = Pings(hung={1, 3})
    aborted: list[list[int]] = []
    now = [0.0]
    beat = health_mod.Heartbeat(
        members=lambda: members,
        stepping=lambda: [0, 1, 2],
        send_ping=pings.send,
        poll_ping=pings.poll,
        fence=pings.fence,
        clock=health_mod.StepClock(),
        abort_peers=aborted.append,
        now=lambda: now[0],
    )
    beat.pending_hang_timeout = 10.0
    for t in (0.0, 0.1, 0.5):  # rank 1 (stepped) is hung past hang_timeout 0.2; 3 is pending
        now[0] = t
        beat.round(hang_timeout=0.2)
    assert pings.fenced == [1] and aborted == [[1]]


def test_a_step_groups_op_timeout_follows_observed_step_times() -> None:
    clock = health_mod.StepClock()
    assert clock.group_timeout() == health_mod.MIN_GROUP_TIMEOUT
    clock._recent.append(3.0)  # a slow step was observed
    assert clock.group_timeout() == pytest.approx(health_mod.GROUP_TIMEOUT_FACTOR * 3.0)
    clock.min_group_timeout = 100.0
    assert clock.group_timeout() == 100.0


def test_step_deadline_follows_observed_step_times() -> None:
    clock = health_mod.StepClock()
    assert clock.deadline() == health_mod.MIN_STEP_DEADLINE
    clock.begin()
    clock._recent.append(2.0)  # a slow step was observed
    assert clock.deadline() == pytest.approx(health_mod.DEADLINE_FACTOR * 2.0)
    assert not clock.overdue(time.monotonic())
    assert clock.overdue(time.monotonic() + health_mod.DEADLINE_FACTOR * 2.0 + 1)
    clock.end(ok=True)
    assert not clock.overdue(time.monotonic() + 1000)  # no step is running


# ------------------------------------------------------------------ boundary deadlines


def test_a_boundary_call_that_misses_its_deadline_is_cancelled_and_never_runs() -> None:
    engine, executor = engine_fakes.make_engine(1)
    gate = threading.Event()
    inner = executor.execute_step
    started = threading.Event()

    def slow(step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        started.set()
        assert gate.wait(DEADLINE)  # the step holds the loop past the caller's deadline
        return inner(step)

    executor.execute_step = slow  # type: ignore[method-assign]
    ran: list[str] = []
    with engine:
        handle = engine.add_request(engine_fakes.req("a", max_tokens=3))
        assert started.wait(DEADLINE)
        with pytest.raises(TimeoutError, match="cancelled"):
            engine.run_at_boundary(lambda: ran.append("late"), timeout=0.2)
        with pytest.raises(TimeoutError, match="cancelled"):
            engine.run_step_control({"expert_epoch": 5}, timeout=0.2)
        gate.set()
        assert handle.result(DEADLINE).text == "bcd"
        assert engine.run_at_boundary(lambda: "now", timeout=DEADLINE) == "now"
    assert ran == []
    assert all("expert_epoch" not in s.control for s in executor.steps)


# ------------------------------------------------------------------- recovery records


def test_a_recovery_is_the_current_record_and_joins_the_history() -> None:
    class NoOps:
        def current_size(self) -> int:
            return 2

    coord = coordinator.Coordinator(
        NoOps(),  # type: ignore[arg-type]
        limits=coordinator.Limits(min_size=1, max_size=4, num_experts=8),
    )
    info = records.RecoveryInfo(detected_at=100.0, last_heartbeat_at=99.8)
    rec = coord.begin_recovery(from_size=3, to_size=2, info=info)
    assert coord.current is rec and coord.is_scaling and rec.stage is stages.Stage.RECOVERING
    assert coord.request(2) is rec  # the same target returns the running one
    with pytest.raises(coordinator.ResizeConflict, match="recovery 3->2"):
        coord.request(3)
    info.ranks_lost = [{"rank": 1, "pod": "w-1", "node_id": "n", "pid": 7, "reason": "dead"}]
    info.recovered_at, info.requests_rerun, info.experts_from_source = 101.5, 4, 12
    coord.end_recovery(rec)
    assert coord.current is None and coord.history() == [rec]
    body = rec.to_json()
    assert (body["kind"], body["trigger"], body["stage"]) == ("recovery", "rank_lost", "Completed")
    assert body["recovery"] == {
        "last_heartbeat_at": 99.8,
        "detected_at": 100.0,
        "recovered_at": 101.5,
        "detection_s": pytest.approx(0.2),
        "recovery_s": 1.5,
        "ranks_lost": info.ranks_lost,
        "experts_restored": {"from_replicas": 0, "from_source": 12, "from_retained": 0},
        "requests_rerun": 4,
    }


def test_losing_every_rank_is_recorded_once_not_at_every_retried_step() -> None:
    """The last rank lost: the recovery finds no survivor and fails, once. The engine retries
    its step (each retry meets the same lost ranks) until autoRecover's grow-back repairs the
    deployment: the history keeps one Failed record, not one per retry, and a loss of other
    ranks later is recorded again."""
    from types import SimpleNamespace

    from moe_runtime.elastic import recovery

    class Ops:
        def current_size(self) -> int:
            return 1

    coord = coordinator.Coordinator(
        Ops(),  # type: ignore[arg-type]
        limits=coordinator.Limits(min_size=1, max_size=4, num_experts=8),
    )
    dead = SimpleNamespace(lost_at=10.0, last_ok=9.0, reason="died", state="dead")
    executor = SimpleNamespace(
        ranks=[0],
        lost_ranks=lambda: {label: dead for label in executor.ranks},
        has_step_path=lambda: False,
        rank_infos=lambda: {0: {"pod": "w-0", "node_id": "n", "pid": 7}},
    )
    ctx = SimpleNamespace(
        executor=executor,
        engine=SimpleNamespace(active_ranks=lambda: list(executor.ranks)),
        serving=SimpleNamespace(num_ranks=1),
    )
    rec = recovery.Recovery(ctx, coordinator=coord)  # type: ignore[arg-type]
    for _ in range(5):  # the engine's retries
        rec.recover_now()
    (failed,) = coord.history()
    body = failed.to_json()
    assert body["stage"] == "Failed" and "no rank survived" in body["message"], body
    executor.ranks = [3]  # a new rank, lost too: a new record
    rec.recover_now()
    assert len(coord.history()) == 2


# ------------------------------------------------ a shrink around a fenced in-process rank


def _deployment(
    size: int, *, model: str = SOURCE, **config: Any
) -> tuple[local.LocalExecutor, core.Engine, service.ElasticService, policy.Placement]:
    """An in-process deployment of `size` ranks (identity placement, no EPLB, no
    autoRecover, sizes 1..3), its engine started."""
    src = source_mod.open_source(model)
    cfg = src.config
    physical = policy.num_physical_for(cfg.num_experts, size)
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, size)
    ex = local.LocalExecutor(size)
    ex.start(model, placement=placement)
    engine = core.Engine(ex, src.tokenizer(), seam.EngineConfig(max_model_len=512))
    elastic = service.ElasticService.attach(
        engine=engine,
        executor=ex,
        model_config=cfg,
        placement=placement,
        config=serving.ElasticConfig(
            source=model, eplb_enabled=False, auto_recover=False, **config
        ),
        limits=coordinator.Limits(min_size=1, max_size=3, num_experts=cfg.num_experts),
    )
    engine.start()
    return ex, engine, elastic, placement


def _submit(engine: core.Engine, prompts: list[list[int]]) -> list[Any]:
    """Seeded-sampling requests of 24 tokens for `prompts`, once the engine has stepped a few
    times (they are running when the test fences a rank)."""
    handles = [
        engine.add_request(
            req_mod.Request(
                request_id=f"r{i}",
                prompt_token_ids=p,
                sampling=step_mod.SamplingParams(),
                max_tokens=24,
                ignore_eos=True,
            )
        )
        for i, p in enumerate(prompts)
    ]
    _poll(lambda: engine.stats().step_count >= 4, "a few steps")
    return handles


@pytest.mark.parametrize(
    "model", [SOURCE, "synthetic://deepseek-tiny?seed=0"], ids=["mixtral", "deepseek-shape"]
)
def test_a_fenced_rank_is_shrunk_around_under_load_with_identical_tokens(model: str) -> None:
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(6)]
    torch.set_num_threads(1)
    want = generate.generate_greedy(model, prompts, 24)
    ex, engine, elastic, _ = _deployment(3, model=model)
    try:
        handles = _submit(engine, prompts)
        ex.fence([1], reason="test")
        got = [h.result(DEADLINE) for h in handles]
        assert [g.error for g in got] == [None] * len(prompts)
        assert [g.token_ids for g in got] == want
        status = elastic.status()
        assert status["data_parallel_size"] == 2 and not elastic.recovery.ctx.config.auto_recover
        (rec,) = [h for h in status["history"] if h["kind"] == "recovery"]
        assert rec["stage"] == "Completed" and rec["recovery"]["ranks_lost"][0]["rank"] == 1
        assert rec["recovery"]["requests_rerun"] >= 1
        lost = [r for r in status["ranks"] if r["rank"] is None]
        assert lost and lost[0]["lost_rank"] == 1 and not lost[0]["healthy"]
        assert elastic.readiness() == (True, "serving")
    finally:
        elastic.close()
        engine.stop()
        ex.shutdown()


def test_a_rank_lost_after_a_grow_heals_from_what_the_survivors_retain() -> None:
    """2 -> 3, then the new rank is lost under load: the survivors take size 2's placement
    again, whose experts they retain, so nothing is copied or read from the model source."""
    prompts = [[(5 * i + j) % 250 + 1 for j in range(4 + i)] for i in range(6)]
    torch.set_num_threads(1)
    want = generate.generate_greedy(SOURCE, prompts, 24)
    # no tolerance limit: size 2's placement always fits the load
    ex, engine, elastic, placement = _deployment(2, eplb_min_gain=1.0)
    try:
        grow = elastic.coordinator.request(3)
        assert elastic.coordinator.wait(grow, timeout=DEADLINE) and grow.succeeded, grow.message
        _poll(lambda: all(ex.worker(r).live_state()["retained"] for r in (0, 1)), "retained")
        handles = _submit(engine, prompts)
        ex.fence([2], reason="test")
        got = [h.result(DEADLINE) for h in handles]
        assert [g.error for g in got] == [None] * len(prompts)
        assert [g.token_ids for g in got] == want
        status = elastic.status()
        assert status["data_parallel_size"] == 2
        (rec,) = [h for h in status["history"] if h["kind"] == "recovery"]
        assert rec["stage"] == "Completed", rec["message"]
        restored = rec["recovery"]["experts_restored"]
        assert restored["from_source"] == 0 and restored["from_retained"] > 0, restored
        assert rec["expert_moves"] == 0 and rec["bytes_moved"]["expert"] == 0
        # size 2's placement again, or one at least as balanced that needs no copy either
        healed = elastic.rebalancer.serving.placement
        load = elastic.rebalancer.load.total()
        assert healed.equals(placement) or policy.balancedness(
            load, healed, 2
        ) >= policy.balancedness(load, placement, 2)
    finally:
        elastic.close()
        engine.stop()
        ex.shutdown()


# --------------------------------------------------------------------------- GET /ready


@pytest.mark.parametrize(
    ("state", "code", "body"),
    [
        pytest.param((True, "serving"), 200, {"status": "ready", "reason": "serving"}, id="ready"),
        pytest.param(
            (False, "no step path: recovering from lost ranks [1]"),
            503,
            {"status": "not_ready", "reason": "no step path: recovering from lost ranks [1]"},
            id="recovering",
        ),
    ],
)
def test_ready_answers_the_readiness_and_health_stays_liveness(
    state: tuple[bool, str], code: int, body: dict[str, str]
) -> None:
    engine, _ = engine_fakes.make_engine(1)
    app = server.create_app(engine, served_model_name="letters", readiness=lambda: state)
    with engine:
        ready = asyncio.run(engine_fakes.get(app, "/ready"))
        health = asyncio.run(engine_fakes.get(app, "/health"))
    assert (ready.status_code, ready.json()) == (code, body)
    assert health.status_code == 200


def _beat(members: dict[int, health_mod.RankHealth], pings: Pings, stepping: list[int],
          now: list[float]) -> health_mod.Heartbeat:  # fmt: skip
    return health_mod.Heartbeat(
        members=lambda: members,
        stepping=lambda: stepping,
        send_ping=pings.send,
        poll_ping=pings.poll,
        fence=pings.fence,
        clock=health_mod.StepClock(),
        now=lambda: now[0],
    )


def test_the_stepped_ranks_are_never_all_fenced_for_a_hang() -> None:
    """A one-rank deployment whose rank is slow to answer (a starved host, its first compile)
    is not fenced (no survivor to shrink to: it would fail the deployment), nor are all ranks
    of a bigger one when none answers; a pending worker is still fenced, and once a stepped
    rank answers again the one that stays hung is fenced."""
    members = {label: health_mod.RankHealth() for label in (0, 1, 2)}
    pings = Pings(hung={0, 1, 2})
    now = [0.0]
    beat = _beat(members, pings, [0, 1], now)
    beat.pending_hang_timeout = 1.0
    found = []
    for t in (0.0, 0.5, 1.5, 2.0):
        now[0] = t
        found.append(beat.round(hang_timeout=0.2))
    assert found[:2] == [{}, {}] and found[2] == {2: health_mod.HEALTH_UNRESPONSIVE}
    assert pings.fenced == [2] and members[0].state == members[1].state == health_mod.HEALTH_OK
    pings.hung = {1}  # rank 0 answers again: rank 1 is the hung one, fenced at once
    now[0] = 2.1
    assert beat.round(hang_timeout=0.2) == {1: health_mod.HEALTH_UNRESPONSIVE}
    assert pings.fenced == [2, 1] and members[0].state == health_mod.HEALTH_OK


def test_a_worker_that_joins_the_step_graph_gets_hang_timeout_from_then() -> None:
    """A ping sent while a worker was pending (loading: the longer limit) does not count
    against the stepped limit from its send time when the worker joins the step graph: the
    stepped limit starts when it joins."""
    members = {label: health_mod.RankHealth() for label in (0, 1)}
    pings = Pings(hung={1})
    now = [0.0]
    stepping = [0]
    beat = _beat(members, pings, stepping, now)
    beat.pending_hang_timeout = 10.0
    for t in (0.0, 5.0):  # worker 1 pending, its ping outstanding for 5 s
        now[0] = t
        assert beat.round(hang_timeout=0.5) == {}
    stepping.append(1)  # it joins the step graph with that ping still outstanding
    for t in (5.1, 5.4):
        now[0] = t
        assert beat.round(hang_timeout=0.5) == {}, t
    now[0] = 5.7
    assert beat.round(hang_timeout=0.5) == {1: health_mod.HEALTH_UNRESPONSIVE}
    assert "5.7s" in members[1].reason


def test_the_step_grace_grows_on_a_host_that_answers_every_ping_slowly() -> None:
    """Once a step is past its deadline, a stepped rank whose ping is late is fenced after
    `step_grace` (1 s) where pings come back at once, but on a host where every answer took
    a while lately (more busy processes than cores) only after GRACE_FACTOR x the slowest
    recent answer: a rank starved for a moment is not taken for a hung one (rounds every
    0.1 s, as the heartbeat runs; a slow host answers in 0.8 s)."""

    def fenced_after(answer_s: float) -> float:
        members = {label: health_mod.RankHealth() for label in (0, 1)}
        pings = Pings(hung=set())
        now = [0.0]
        beat = _beat(members, pings, [0, 1], now)
        beat.clock.begin()
        beat.clock.started = -100.0  # a step past its deadline
        sent: dict[int, float] = {}
        poll = pings.poll

        def slow_poll(ref: Any) -> str | None:  # an answer comes answer_s after its send
            label = ref
            if label not in pings.hung and now[0] - sent.get(label, now[0]) < answer_s - 1e-9:
                return None
            return poll(ref)

        def send(label: int) -> Any:
            sent[label] = now[0]
            return pings.send(label)

        beat._poll_ping, beat._send_ping = slow_poll, send
        for tick in range(1, 40):  # 4 s of answered pings
            now[0] = tick / 10
            assert beat.round(hang_timeout=30.0) == {}
        pings.hung = {0}
        start = now[0]
        for tick in range(41, 200):
            now[0] = tick / 10
            if beat.round(hang_timeout=30.0) == {0: health_mod.HEALTH_UNRESPONSIVE}:
                return now[0] - start
        raise AssertionError("never fenced")

    assert 1.0 < fenced_after(0.1) <= 1.0 + 2 * 0.1 + 0.1  # its last ping was sent 0.1 s before
    assert beat_grace_for(0.8) == pytest.approx(health_mod.GRACE_FACTOR * 0.8)
    # its outstanding ping went out up to 0.8 s before the hang began: fenced 4 s after it
    assert 4.0 - 0.8 < fenced_after(0.8) <= 4.0 + 0.2


def beat_grace_for(answer_s: float) -> float:
    """The grace of a heartbeat whose recent pings took `answer_s`."""
    beat = _beat({0: health_mod.RankHealth()}, Pings(hung=set()), [0], [0.0])
    beat._answers.append((0.0, answer_s))
    return beat.grace(1.0)
