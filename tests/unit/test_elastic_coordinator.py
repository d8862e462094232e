"""Rules of the resize coordinator and its admin routes, on fake stage mechanics."""

from __future__ import annotations

import time
from typing import Any

import fastapi
import pytest
from fastapi import testclient

from moe_runtime.elastic import admin, coordinator, stages
from tests.support import fake_ops


def stage_names(ops: fake_ops.FakeOps) -> list[str]:
    return [s.value for _, s in ops.ran]


def test_scale_up_runs_the_design_stages_in_order() -> None:
    ops, c = fake_ops.make(2)
    rec = c.request(4)
    assert c.wait(rec, timeout=10)
    assert rec.succeeded and ops.size == 4
    assert stage_names(ops) == ["Standby", "Transferring", "Switching", "Reshuffling"]
    assert [s["stage"] for s in rec.to_json()["stages"]] == stage_names(ops)
    assert all(s["duration_s"] is not None for s in rec.to_json()["stages"])


def test_scale_down_runs_the_design_stages_in_order() -> None:
    ops, c = fake_ops.make(4)
    rec = c.request(2)
    assert c.wait(rec, timeout=10)
    assert stage_names(ops) == ["Reshuffling", "Migrating", "Switching", "Releasing"]
    assert rec.succeeded and ops.size == 2


def test_same_target_returns_the_running_resize_and_another_target_conflicts() -> None:
    ops, c = fake_ops.make(2)
    ops.gate.clear()
    first = c.request(4)
    assert c.request(4) is first
    with pytest.raises(coordinator.ResizeConflict, match="2->4"):
        c.request(3)
    ops.gate.set()
    assert c.wait(first, timeout=10) and first.succeeded
    second = c.request(3)
    assert c.wait(second, timeout=10) and second.succeeded and ops.size == 3


@pytest.mark.parametrize(
    ("size", "match"),
    [
        pytest.param(0, ">= 1", id="zero"),
        pytest.param(9, r"outside the allowed range \[1, 8\]", id="above-max"),
        pytest.param(1, "too small to hold every expert", id="experts-do-not-fit"),
    ],
)
def test_impossible_sizes_are_refused_and_change_nothing(size: int, match: str) -> None:
    ops, c = fake_ops.make(2, max_experts_per_rank=4)
    with pytest.raises(coordinator.InvalidResize, match=match):
        c.request(size)
    assert ops.ran == [] and ops.size == 2 and c.last() is None


def test_a_failed_stage_rolls_back_and_a_later_resize_succeeds() -> None:
    ops, c = fake_ops.make(2)
    ops.fail_in = stages.Stage.TRANSFERRING
    rec = c.request(4)
    assert c.wait(rec, timeout=10)
    assert rec.stage is stages.Stage.FAILED
    assert "Transferring failed: rank 3 unreachable" in rec.message
    assert ops.rolled_back == [stages.Stage.TRANSFERRING] and ops.size == 2
    assert ops.ended == 1
    ops.fail_in = None
    again = c.request(4)
    assert c.wait(again, timeout=10) and again.succeeded and ops.size == 4
    assert [r.stage for r in c.history()] == [stages.Stage.FAILED, stages.Stage.COMPLETED]


def test_injected_failure_is_one_shot() -> None:
    ops, c = fake_ops.make(2)
    c.inject_failure(stages.Stage.TRANSFERRING)
    rec = c.request(3)
    assert c.wait(rec, timeout=10) and rec.stage is stages.Stage.FAILED
    assert "injected failure" in rec.message
    rec = c.request(3)
    assert c.wait(rec, timeout=10) and rec.succeeded


def test_blackout_is_the_longest_gap_without_progress_while_busy() -> None:
    now = [100.0]
    t = coordinator.ProgressTracker(clock=lambda: now[0])
    t.start()
    now[0] = 107.0
    t.on_step(0, busy=False)  # idle: no blackout
    now[0] = 107.5
    t.on_step(2, busy=True)
    now[0] = 107.6
    t.on_step(0, busy=True)  # busy and no token: the gap grows ...
    now[0] = 108.25
    t.on_step(1, busy=True)  # ... until this token: 0.75 s
    now[0] = 108.5
    t.on_step(3, busy=True)
    now[0] = 120.0
    gap = t.stop(busy=False)
    assert gap == pytest.approx(0.75)


@pytest.fixture()
def client() -> Any:
    ops, c = fake_ops.make(2)
    app = fastapi.FastAPI()
    app.include_router(
        admin.build_router(
            c, status_fn=lambda: {"data_parallel_size": ops.size}, token="s3cret", test_hooks=True
        )
    )
    with testclient.TestClient(app) as cl:
        cl.ops = ops  # type: ignore[attr-defined]
        yield cl


AUTH = {"Authorization": "Bearer s3cret"}


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="missing"),
        pytest.param({"Authorization": "Bearer nope"}, id="wrong"),
        pytest.param({"Authorization": "Basic s3cret"}, id="wrong-scheme"),
    ],
)
def test_admin_routes_need_the_token(client: Any, headers: dict[str, str]) -> None:
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 4}, headers=headers)
    assert r.status_code == 401
    assert client.get("/elastic_ep/status", headers=headers).status_code == 401
    assert client.ops.ran == []


def test_scale_answers_202_at_once_and_200_with_wait(client: Any) -> None:
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}, headers=AUTH)
    assert r.status_code == 202
    body = r.json()
    assert body["from"] == 2 and body["to"] == 3 and body["stage"] == "Standby"
    r = client.post("/scale_elastic_ep?wait=true", json={"new_data_parallel_size": 3}, headers=AUTH)
    assert r.status_code == 200  # the same target: waits for the running resize
    assert r.json()["message"] == "Scaled to 3 data parallel engines"
    deadline = time.monotonic() + 10
    while client.post("/is_scaling_elastic_ep", headers=AUTH).json()["is_scaling_elastic_ep"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = client.post("/scale_elastic_ep?wait=true", json={"new_data_parallel_size": 1}, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["message"] == "Scaled to 1 data parallel engines"
    assert client.get("/elastic_ep/status", headers=AUTH).json() == {"data_parallel_size": 1}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="missing-size"),
        pytest.param({"new_data_parallel_size": "4"}, id="string"),
        pytest.param({"new_data_parallel_size": 0}, id="zero"),
        pytest.param({"new_data_parallel_size": 4, "extra": 1}, id="unknown-field"),
        pytest.param({"new_data_parallel_size": 4, "drain_timeout": -1}, id="negative-drain"),
    ],
)
def test_bad_bodies_are_refused(client: Any, body: dict[str, Any]) -> None:
    r = client.post("/scale_elastic_ep", json=body, headers=AUTH)
    assert r.status_code in (400, 422)
    assert client.ops.ran == []


def test_conflict_is_409(client: Any) -> None:
    client.ops.gate.clear()
    assert (
        client.post("/scale_elastic_ep", json={"new_data_parallel_size": 4}, headers=AUTH)
    ).status_code == 202
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}, headers=AUTH)
    assert r.status_code == 409 and "in stage" in r.json()["error"]["message"]
    client.ops.gate.set()


@pytest.mark.parametrize(
    ("fail_rank", "status"),
    [
        pytest.param(None, 404, id="no-rank-failures-here"),
        pytest.param("refuse", 400, id="ranks-without-fault-hooks"),
        pytest.param("arm", 200, id="armed"),
    ],
)
def test_a_rank_failure_is_armed_only_where_the_ranks_carry_fault_hooks(
    fail_rank: str | None, status: int
) -> None:
    """`{"rank", "operation"}` reaches the ranks' fault hooks (`MOE_RANK_HOOKS`); ranks
    without them answer a 400 that says why, and nothing is armed."""
    armed: list[tuple[int, str]] = []

    def arm(rank: int, operation: str) -> None:
        if fail_rank == "refuse":
            raise RuntimeError("rank 1: no control method 'fail_next' (MOE_RANK_HOOKS)")
        armed.append((rank, operation))

    ops, c = fake_ops.make(2)
    app = fastapi.FastAPI()
    router = admin.build_router(
        c,
        status_fn=lambda: {},
        token="s3cret",
        test_hooks=True,
        fail_rank=None if fail_rank is None else arm,
    )
    app.include_router(router)
    with testclient.TestClient(app) as cl:
        body = {"rank": 1, "operation": "activate"}
        r = cl.post("/elastic_ep/inject_failure", json=body, headers=AUTH)
    assert r.status_code == status
    if status == 400:
        assert r.json()["error"]["param"] == "operation" and "MOE_RANK_HOOKS" in r.text
    assert armed == ([(1, "activate")] if status == 200 else [])
