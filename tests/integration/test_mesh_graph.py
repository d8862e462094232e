"""The compiled step graph over a DP rank's tensor-parallel mesh (`executor.ray_mesh`, issue 22):
at T = 2 and pipeline size 1 the TP follower is a node of the graph, fed by its leader's
`prepare_step` node, instead of a plain Ray call its leader makes per step.

On a RayExecutor of one DP rank at T = 2 (a leader and a follower actor, the tiny synthetic
model): once the graph is live every forward pass of the follower comes from its graph node
(none from a plain call) and the greedy and seeded tokens equal one process's; a parked graph
holds the follower too (its graph loop waits in the hold: a follower left reading its
channel would spin a core), and the next step resumes the same graph with the same tokens;
right after a new step path is set (plain calls while the graph compiles) the follower steps
from plain calls, and the graph takes over again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime import step as step_mod
from moe_runtime.model import generate
from tests.support import lockstep, polling

pytestmark = pytest.mark.ray

PARK_AFTER = 0.5
MAX_TOKENS = 12
SEEDED = step_mod.SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    polling.poll(condition, what, timeout, every=0.05)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    return generate.generate_greedy(lockstep.SOURCE, lockstep.PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def mesh(ray_session: None) -> Iterator[Any]:
    from moe_runtime.executor import ray_executor

    ex = ray_executor.RayExecutor(1, tp_size=2, park_after=PARK_AFTER)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(1))
    yield ex
    ex.shutdown()


def follower(ex: Any) -> Any:
    (member,) = ex.roster.targets("step", None)
    (actor,) = member.handle.followers
    return actor


def counts(ex: Any) -> dict[str, int]:
    import ray

    answer: dict[str, int] = ray.get(follower(ex).step_counts.remote(), timeout=30)
    return answer


def generate_all(ex: Any, *, seeded: bool = False) -> dict[str, list[int]]:
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        sampling = SEEDED if seeded else lockstep.GREEDY
        run.add(f"g{i}", prompt, rank=0, max_tokens=MAX_TOKENS, sampling=sampling)
    return run.run()


def test_the_follower_steps_from_its_node_of_the_graph(
    mesh: Any, reference: list[list[int]]
) -> None:
    wait_for(mesh.path.graph_live, "the step graph took over")
    assert mesh.path.graph_nodes() == 2  # the leader and its follower
    before = counts(mesh)
    got = generate_all(mesh)
    assert [got[f"g{i}"] for i in range(len(lockstep.PROMPTS))] == reference
    after = counts(mesh)
    assert after["plain"] == before["plain"], "a plain call stepped the follower"
    # one forward pass per step with tokens: MAX_TOKENS steps
    assert after["graph"] - before["graph"] == MAX_TOKENS
    seeded = generate_all(mesh, seeded=True)
    assert seeded == generate_all(mesh, seeded=True)  # seeded sampling repeats itself
    assert counts(mesh)["plain"] == before["plain"]


def test_a_parked_graph_holds_the_follower_and_resumes(
    mesh: Any, reference: list[list[int]]
) -> None:
    wait_for(mesh.path.graph_live, "the step graph took over")
    generate_all(mesh)
    wait_for(mesh.path.parked, "the idle graph parked", timeout=30)
    # the follower's graph loop waits on its event, idle, instead of spinning on its channel
    wait_for(lambda: counts(mesh)["holding"] == 1, "the follower waits in the hold")
    resumes, before = mesh.path.resumes, counts(mesh)
    got = generate_all(mesh)
    assert [got[f"g{i}"] for i in range(len(lockstep.PROMPTS))] == reference
    assert mesh.path.resumes == resumes + 1  # the same graph, released
    after = counts(mesh)
    assert after["graph"] - before["graph"] == MAX_TOKENS
    assert after["holding"] == 0


def test_plain_calls_step_the_follower_until_the_graph_takes_over(
    mesh: Any, reference: list[list[int]]
) -> None:
    mesh._set_path()  # a new step path: plain calls at once, the graph compiled behind them
    before = counts(mesh)
    run = lockstep.Lockstep(mesh)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(f"g{i}", prompt, rank=0, max_tokens=MAX_TOKENS)
    run.step()  # sent before the graph's compile (~0.2 s) can end
    assert counts(mesh)["plain"] == before["plain"] + 1
    got = run.run()
    assert [got[f"g{i}"] for i in range(len(lockstep.PROMPTS))] == reference
    wait_for(mesh.path.graph_live, "the step graph took over again")
    middle = counts(mesh)
    generate_all(mesh)
    after = counts(mesh)
    assert after["plain"] == middle["plain"]
    assert after["graph"] - middle["graph"] == MAX_TOKENS
