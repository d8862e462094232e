"""The step path parks an idle compiled graph (`ray_step`, "Parking"): over two actors that do
no work, a graph idle for `park_after` s is held (its actors' loops wait in a hold) and neither
they nor the driver spend CPU, a step while parked releases the hold and goes through the same
graph at once (no compile), a graph retired or closed while held is released and torn down,
and steps that keep coming never park it. While a step runs, the thread that collects it sleeps through most of it
instead of spinning on the graph's output (`step_wait`)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from moe_runtime import step as step_mod

pytestmark = pytest.mark.ray

PARK_AFTER = 0.5
#: A step that lasts 50 ms (`Echo.execute_step`): the next one is always sent before it ends.
LASTS = {"seconds": 0.05}
TICKS = os.sysconf("SC_CLK_TCK")


class Echo:
    """A rank that does nothing: answers every step with its step id."""

    def __init__(self, rank: int) -> None:
        import threading

        self.rank = rank
        self.seen: list[int] = []
        self.hold = threading.Event()
        self.opened = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        from moe_runtime.executor import ray_actor

        if step.step_id == ray_actor.HOLD_STEP_ID:  # as `RankActor.execute_step` does
            self.hold.wait()
            self.hold.clear()
        if step.step_id > 0:  # not a graph's probe or hold
            self.seen.append(step.step_id)
        lasts = step.control.get("seconds", 0.0)
        time.sleep(lasts)  # the step's duration, if it has one
        return step_mod.StepOutput(rank=self.rank, step_id=step.step_id, seconds=lasts)

    def history(self) -> list[int]:
        return list(self.seen)

    def echo(self, value: Any) -> Any:
        """What `ray_graph.warm_up`'s graph calls: answers once the test opens it."""
        self.opened.wait(60)
        return value

    def open_echo(self) -> None:
        self.opened.set()

    def release_hold(self) -> None:
        self.hold.set()


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # poll


@pytest.fixture(scope="module")
def actors(ray_session: None) -> Iterator[list[Any]]:
    import ray

    from moe_runtime.executor import ray_actor

    remote = ray.remote(num_cpus=0, concurrency_groups={ray_actor.HEALTH_LANE: 1})(Echo)
    handles = [remote.remote(rank) for rank in range(2)]  # type: ignore[attr-defined]
    ray.get([h.pid.remote() for h in handles])
    yield handles
    for h in handles:
        ray.kill(h)


@pytest.fixture
def path(actors: list[Any]) -> Iterator[Any]:
    from moe_runtime.executor import ray_step

    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=PARK_AFTER)
    p.set([0, 1], actors)
    wait_for(p.graph_live, "the step graph took over")
    yield p
    p.close()


def step(path: Any, step_id: int) -> list[int]:
    outs = path.execute(step_mod.StepInput(step_id=step_id), timeout=60.0)
    assert [o.rank for o in outs] == [0, 1]
    return [o.step_id for o in outs]


def test_an_idle_graph_is_parked_and_its_actors_stop_spending_cpu(
    path: Any, actors: list[Any]
) -> None:
    import ray

    assert step(path, 1) == [1, 1]
    wait_for(path.parked, f"the graph parked after {PARK_AFTER}s without a step")
    assert path.graph_live() and path.parks == 1  # held, not torn down
    assert path.wait_idle(60)  # no job runs
    pids = ray.get([a.pid.remote() for a in actors]) + [os.getpid()]
    before = [cpu_seconds(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(2.0)  # the measurement window itself
    seconds = time.monotonic() - started
    used = [(cpu_seconds(pid) - b) / seconds for pid, b in zip(pids, before, strict=True)]
    # A live graph's actors busy-wait (most of a core each); held ones, and the driver with
    # the hold's output unread, only idle.
    assert max(used) < 0.15, f"the actors and the driver used {used} of a core"


def test_a_step_while_parked_is_served_by_the_same_graph_at_once(path: Any) -> None:
    wait_for(path.parked, "the graph parked")
    compiles = dict(path.last_compile)
    sent = path.submit(step_mod.StepInput(step_id=2))
    assert sent.graph_ref is not None  # the held graph, released: no plain calls, no compile
    assert [o.step_id for o in path.collect(sent, timeout=60.0)] == [2, 2]
    assert path.resumes == 1 and not path.parked() and path.graph_live()
    assert step(path, 3) == [3, 3]
    wait_for(path.parked, "parked again once idle")
    assert path.parks == 2 and path.last_compile == compiles


def test_a_graph_retired_while_held_is_released_and_a_new_one_serves(
    path: Any, actors: list[Any]
) -> None:
    import ray

    wait_for(path.parked, "the graph parked")
    path.set([0, 1], actors)  # a switch onto the same actors: the held graph is retired
    wait_for(path.graph_live, "a new graph compiled over the actors (the held one torn down)")
    assert path.wait_idle(60)
    assert step(path, 4) == [4, 4]
    for history in ray.get([a.history.remote() for a in actors]):
        assert history[-1] == 4


def test_steps_that_keep_coming_never_park_the_graph(actors: list[Any]) -> None:
    from moe_runtime.executor import ray_step

    park_after = 2.0  # wide: a loaded machine may stall this loop for a while
    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=park_after)
    p.set([0, 1], actors)
    try:
        wait_for(p.graph_live, "the step graph took over")
        step_id = 10
        until = time.monotonic() + 1.5 * park_after
        while time.monotonic() < until:
            step_id += 1
            assert step(p, step_id) == [step_id, step_id]
            time.sleep(0.05)  # the load: a step every ~50 ms
        assert p.parks == 0 and p.graph_live()
    finally:
        p.close()


def test_with_two_steps_always_in_flight_the_graph_takes_over_and_the_order_holds(
    path: Any, actors: list[Any]
) -> None:
    # The engine's two steps in flight (docs/ENGINE.md): the next step is sent before the
    # last one is collected, so the path is never empty; a graph compiled meanwhile must still
    # take over from the plain calls, and every actor runs the steps in the order sent.
    import ray

    wait_for(path.parked, "the graph parked")
    start = len(ray.get(actors[0].history.remote()))
    collector = concurrent.futures.ThreadPoolExecutor(1)  # as the engine's step thread
    collected = [
        collector.submit(
            path.collect, path.submit(step_mod.StepInput(100, {}, LASTS)), timeout=60.0
        )
    ]
    by_graph, step_id, handover = 0, 100, []
    deadline = time.monotonic() + 60.0
    while by_graph < 5:
        assert time.monotonic() < deadline, "the graph never took over from the plain calls"
        step_id += 1
        live = path.graph_live()
        sent = path.submit(step_mod.StepInput(step_id, {}, LASTS))  # the last one in flight
        by_graph += sent.graph_ref is not None
        if live and not handover:  # the first step sent once the graph was installed takes it
            handover.append(sent.graph_ref is not None)
        collected.append(collector.submit(path.collect, sent, timeout=60.0))
        assert [o.step_id for o in collected[-2].result()] == [step_id - 1] * 2
    collected[-1].result()
    collector.shutdown()
    assert handover == [True]
    for history in ray.get([a.history.remote() for a in actors]):
        assert history[start:] == list(range(100, step_id + 1))


def test_the_collecting_thread_sleeps_through_most_of_a_step_instead_of_spinning(
    actors: list[Any],
) -> None:
    from moe_runtime.executor import ray_step, step_wait

    sampling = step_mod.SamplingParams()
    decode = {0: step_mod.RankBatch([step_mod.SeqWork("s", [1], 5, sampling)])}  # one token
    lasts = {"seconds": 0.2}
    used: dict[float, float] = {}
    step_id = 300
    for fraction in (0.0, step_wait.WAIT_FRACTION):  # spinning as before, then waiting
        p = ray_step.StepPath(
            compiled=True, compile_timeout=60.0, park_after=0, wait=step_wait.StepWait(fraction)
        )
        p.set([0, 1], actors)
        try:
            wait_for(p.graph_live, "the step graph took over")
            for timed in (False, True):  # two steps to estimate from, then four measured
                cpu, wall = time.thread_time(), time.monotonic()
                for _ in range(4 if timed else 2):
                    step_id += 1
                    outs = p.execute(step_mod.StepInput(step_id, decode, lasts), timeout=60.0)
                    assert [o.step_id for o in outs] == [step_id] * 2
            used[fraction] = (time.thread_time() - cpu) / (time.monotonic() - wall)
        finally:
            p.close()
    # Reading a graph's output spins (a sched_yield loop in Ray 2.60): most of a core for the
    # whole step; the wait spins only through the step's last 15 %.
    spin, waiting = used[0.0], used[step_wait.WAIT_FRACTION]
    assert spin > 0.3, f"spinning read used only {spin:.2f} of a core"
    assert waiting < spin / 2, f"waiting used {waiting:.2f} of a core against {spin:.2f}"


def test_an_actor_lost_while_held_fails_the_next_step_and_the_survivor_serves_again(
    ray_session: None,
) -> None:
    import signal

    import ray

    from moe_runtime.executor import base, ray_actor, ray_step

    remote = ray.remote(num_cpus=0, concurrency_groups={ray_actor.HEALTH_LANE: 1})(Echo)
    pair = [remote.remote(rank) for rank in range(2)]  # type: ignore[attr-defined]
    pids = ray.get([a.pid.remote() for a in pair])
    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=PARK_AFTER)
    p.set([0, 1], pair)
    try:
        wait_for(p.graph_live, "the step graph took over")
        assert step(p, 1) == [1, 1]
        wait_for(p.parked, "the graph parked")
        os.kill(pids[1], signal.SIGKILL)
        # The hold cannot be released on a lost actor: the graph is dropped and the step goes
        # through plain calls, which report the loss as any step to a dead rank does (the
        # executor's failure path) instead of hanging in the held graph.
        with pytest.raises(base.RankDied) as died:
            p.execute(step_mod.StepInput(step_id=2), timeout=60.0)
        assert died.value.ranks == [1]
        p.set([0], pair[:1])  # the recovery: the survivor alone
        wait_for(p.graph_live, "a graph over the survivor")
        outs = p.execute(step_mod.StepInput(step_id=3), timeout=60.0)
        assert [o.step_id for o in outs] == [3]
    finally:
        p.close()
        assert p.wait_idle(30)
        ray.kill(pair[0])


def test_a_path_closed_while_a_graph_job_is_stuck_returns_within_its_timeout(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph job that does not end (seen: a new graph's probe waiting out its 60 s timeout
    after a resize's quick grow and shrink, which held a server's shutdown ~55 s): `close`
    returns within its own timeout and leaves the job to end on its own. Here the job's
    compile waits until the test lets it go."""
    import threading

    from moe_runtime.executor import ray_graph, ray_step

    entered, stuck, compiled = threading.Event(), threading.Event(), ray_graph.compile_graph
    left = threading.Event()

    def stuck_compile(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        stuck.wait(30)
        left.set()
        return compiled(*args, **kwargs)

    monkeypatch.setattr(ray_graph, "compile_graph", stuck_compile)
    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=0)
    try:
        p.set([0, 1], actors)
        assert entered.wait(30), "the job did not compile"
        p.close(timeout=1.0)
        # close came back with the job still stuck in its compile (it did not wait for it)
        assert not left.is_set()
        assert not p.graph_live()
    finally:
        stuck.set()
        assert p.wait_idle(30), "the job did not end once let go"
    assert not p.graph_live()  # the job's graph was not installed on a closed path


def test_a_graph_compiled_for_a_path_since_replaced_is_dropped_unprobed(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step path moved on while a graph compiled (seen in a server log: a grow 2 -> 3
    switched, the shrink back switched and removed the third rank while the graph over three
    compiled; that graph's probe then waited out its timeout and held every later compile):
    the job drops the graph without probing it, and the replacing path's graph serves."""
    import threading

    from moe_runtime.executor import ray_graph, ray_step

    probes: list[int] = []
    probe = ray_graph.probe_step
    monkeypatch.setattr(ray_graph, "probe_step", lambda: probes.append(1) or probe())
    compiled, replaced = ray_graph.compile_graph, threading.Event()
    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=0)

    def compile_then_replace(*args: Any, **kwargs: Any) -> Any:
        graph = compiled(*args, **kwargs)
        if not replaced.is_set():
            replaced.set()
            p.set([0, 1], actors)  # the switch that came while this graph compiled
        return graph

    monkeypatch.setattr(ray_graph, "compile_graph", compile_then_replace)
    try:
        p.set([0, 1], actors)
        wait_for(p.graph_live, "the replacing path's graph took over")
        assert p.wait_idle(60)
        assert replaced.is_set() and len(probes) == 1  # only the live path's graph was probed
        assert step(p, 7) == [7, 7]
    finally:
        p.close()


class EndedMonitor:
    """A compiled graph's failure monitor as Ray 2.60 leaves it when an actor died while the
    graph compiled (`ray_graph.broken`): the thread has ended; teardown still works."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor

    def is_alive(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor, name)


def test_a_graph_whose_failure_monitor_ended_is_dropped_and_compiled_again(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph Ray left half-live (its failure monitor died in its own teardown, so nothing
    would fail its reads) is not probed (the probe would wait out its whole timeout): plain
    calls serve, and the next compile's graph takes over."""
    from moe_runtime.executor import ray_graph, ray_step

    probes: list[int] = []
    probe = ray_graph.probe_step
    monkeypatch.setattr(ray_graph, "probe_step", lambda: probes.append(1) or probe())
    monkeypatch.setattr(ray_step, "RETRY_SECONDS", 0.2)
    compiled = ray_graph.compile_graph
    graphs: list[Any] = []

    def compile_broken_once(*args: Any, **kwargs: Any) -> Any:
        graph = compiled(*args, **kwargs)
        graphs.append(_ended_monitor(graph) if not graphs else graph)
        return graph

    monkeypatch.setattr(ray_graph, "compile_graph", compile_broken_once)
    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=0)
    try:
        p.set([0, 1], actors)
        assert p.wait_idle(60)
        assert "failure monitor has ended" in p.last_compile.get("error", "")
        assert not p.graph_live() and not probes
        # plain calls serve; a step once the retry time has passed starts the compile again
        ids = iter(range(100, 100_000))
        wait_for(lambda: step(p, next(ids)) and p.graph_live(), "the second graph took over")
        assert len(graphs) == 2 and len(probes) == 1
        assert step(p, 9) == [9, 9]
    finally:
        p.close()


def test_a_warm_up_over_a_graph_ray_left_half_live_ends_at_once(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grow's warm-up of its new actors (`ray_graph.warm_up`; the switch waits for it) over
    a graph Ray left half-live ends at once instead of waiting out its timeout for an answer
    that would never come (here: the actors answer only once the test lets them)."""
    import threading

    import ray

    from moe_runtime.executor import ray_graph

    compile_ = ray_graph._compile
    monkeypatch.setattr(ray_graph, "_compile", lambda dag: _ended_monitor(compile_(dag)))
    done = threading.Event()
    warming = threading.Thread(
        target=lambda: (ray_graph.warm_up(actors, timeout=120.0), done.set()), daemon=True
    )
    warming.start()
    try:
        assert done.wait(30), "the warm-up waited for a graph that cannot answer"
    finally:
        ray.get([a.open_echo.remote() for a in actors], timeout=30)
        warming.join(130)


def _ended_monitor(graph: Any) -> Any:
    graph._monitor = EndedMonitor(graph._monitor)
    return graph


def test_a_probe_that_does_not_answer_is_given_up_within_its_bound(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new graph whose probe never answers is dropped after the probe's own bound, not the
    switch timeout the compile gets, and compiled again. Here the first probe is a hold that
    keeps both actors' graph loops waiting until the test lets them go."""
    import ray

    from moe_runtime.executor import ray_actor, ray_graph, ray_step

    sent: list[int] = []
    probe = ray_graph.probe_step

    def hold_first() -> step_mod.StepInput:
        sent.append(1)
        if len(sent) == 1:
            return step_mod.StepInput(step_id=ray_actor.HOLD_STEP_ID, batches={})
        return probe()

    monkeypatch.setattr(ray_graph, "probe_step", hold_first)
    monkeypatch.setattr(ray_step, "RETRY_SECONDS", 0.2)
    p = ray_step.StepPath(compiled=True, compile_timeout=600.0, park_after=0, probe_timeout=1.0)
    try:
        p.set([0, 1], actors)
        wait_for(
            lambda: "probe" in p.last_compile.get("error", ""),
            "the job gave up the probe by itself",
            timeout=30,
        )
        assert "Timeout" in p.last_compile["error"] and not p.graph_live()
        # the dropped graph's loops are still in the hold: let them go so it tears down
        ray.get([a.release_hold.remote() for a in actors], timeout=30)
        assert p.wait_idle(60)
        # plain calls serve; a step once the retry time has passed starts the compile again
        ids = iter(range(100, 100_000))
        wait_for(lambda: step(p, next(ids)) and p.graph_live(), "the second graph took over")
        assert step(p, 11) == [11, 11]
    finally:
        p.close()


def test_a_path_closed_while_parked_stops_its_threads(actors: list[Any]) -> None:
    from moe_runtime.executor import ray_step

    p = ray_step.StepPath(compiled=True, compile_timeout=60.0, park_after=PARK_AFTER)
    p.set([0, 1], actors)
    wait_for(p.parked, "the graph parked")
    p.close()
    assert p.wait_idle(10)
    assert p._parker is not None and not p._parker.is_alive()
    with pytest.raises(RuntimeError, match="no step path"):
        p.execute(step_mod.StepInput(step_id=1), timeout=10.0)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [pytest.param("", None, id="unset"), pytest.param("0", 0.0, id="never"), ("2.5", 2.5)],
)
def test_park_seconds_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: float | None
) -> None:
    """Unset: `ray_step.PARK_AFTER_SECONDS`."""
    from moe_runtime.executor import ray_step

    monkeypatch.setenv(ray_step.PARK_ENV, raw)
    want = ray_step.PARK_AFTER_SECONDS if expected is None else expected
    assert ray_step.park_after_from_env() == want


@pytest.mark.parametrize("raw", ["-1", "soon"])
def test_bad_park_seconds_name_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from moe_runtime.executor import ray_step

    monkeypatch.setenv(ray_step.PARK_ENV, raw)
    with pytest.raises(ValueError, match=ray_step.PARK_ENV):
        ray_step.park_after_from_env()
