"""Load progress of the runtime (`moe_contract.loading`): each rank's counters of what it has
read (`rank.progress`, `RankWorker.load_progress`), the executor's view while `start` loads,
and what the loading server's `GET /ready` says meanwhile."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest
from fastapi import testclient

from moe_contract import loading
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.rank import progress, worker
from moe_runtime.server import loading as loading_server
from tests.support import checkpoints, slow_load


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = pathlib.Path(tmp_path_factory.mktemp("ckpt")) / "mixtral"
    checkpoints.build(path)
    return str(path)


def test_a_counter_counts_reads_against_totals_known_first() -> None:
    counter = progress.LoadCounter()
    assert counter.snapshot()["rank"] == -1  # no load begun
    counter.begin(rank=1, tensors_total=3, bytes_total=300)
    counter.add(tensors=1, nbytes=100)
    counter.add(tensors=1, nbytes=100)
    assert loading.RankLoad.exact(counter.snapshot()) == loading.RankLoad(
        rank=1, tensors_loaded=2, tensors_total=3, bytes_loaded=200, bytes_total=300
    )
    counter.finish()
    assert counter.snapshot()["done"] is True


@pytest.mark.parametrize("rank", [0, 1], ids=["rank-0", "rank-1"])
def test_a_finished_load_counted_exactly_what_the_rank_holds(model: str, rank: int) -> None:
    w = worker.RankWorker(device="cpu", dtype="float32", torch_threads=1)
    cfg = checkpoints.MIXTRAL_SETTINGS
    placement = policy.identity(cfg["num_hidden_layers"], cfg["num_local_experts"], 6, 2)
    held = w.load_weights(source=model, rank=rank, num_ranks=2, placement=placement)
    done = loading.RankLoad.exact(w.call("load_progress"))
    assert done.done and done.rank == rank
    assert done.bytes_loaded == done.bytes_total == held  # float32: as stored, as held
    assert done.tensors_loaded == done.tensors_total
    # 3 experts of 6 in each of 3 layers, 3 tensors each, beside the non-expert ones
    assert len(w.slots.experts) == 9


def test_the_executor_reports_a_load_part_way(model: str) -> None:
    holds = [slow_load.HeldLoad(at=4), slow_load.HeldLoad(at=10**9)]
    made = iter(holds)
    ex = local.LocalExecutor(2, rank_hooks=lambda: next(made))
    cfg = checkpoints.MIXTRAL_SETTINGS
    placement = policy.identity(cfg["num_hidden_layers"], cfg["num_local_experts"], 6, 2)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            ex.start(model, placement=placement, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    loader = threading.Thread(target=start)
    progress_now = loading_server.progress_from(ex.load_progress, ranks_total=2)
    try:
        loader.start()
        assert holds[0].reached.wait(60)
        # rank 1 ends its load; rank 0 waits at its 4th read, 3 in
        now, deadline, tick = progress_now(), time.monotonic() + 60, threading.Event()
        while now.ranks_ready < 1 and time.monotonic() < deadline:
            tick.wait(0.05)  # a poll with a deadline: rank 1 finishing its load
            now = progress_now()
        assert now.activity == loading.ACTIVITY_WEIGHTS and now.ranks_ready == 1
        first, second = now.ranks
        assert (first.rank, first.tensors_loaded, first.done) == (0, 3, False)
        assert second.done and second.bytes_loaded == second.bytes_total
        assert 0 < now.bytes_loaded < now.bytes_total
        text = now.message()
        assert text.startswith("loading weights ") and " MB, rank 0/2 (1 of 2 ranks" in text
        body = testclient.TestClient(loading_server.create_app(progress_now)).get("/ready")
        assert body.status_code == 503
        ready = loading.ReadyBody.exact(body.json())
        assert ready.status == loading.LOADING and ready.reason == text
        assert ready.loading is not None and ready.loading.bytes_loaded == now.bytes_loaded
    finally:
        holds[0].release.set()
        loader.join(120)
        try:
            assert not errors, errors
            done = progress_now()
            assert done.activity == loading.ACTIVITY_GROUPS and done.ranks_ready == 2
        finally:
            ex.shutdown()


@pytest.mark.parametrize(
    ("ranks", "activity", "says"),
    [
        ([], loading.ACTIVITY_STARTING, "starting 2 ranks"),
        ([{"rank": -1}], loading.ACTIVITY_STARTING, "starting 2 ranks"),
        (
            [{"rank": 0, "bytes_loaded": 2_500_000_000, "bytes_total": 6_000_000_000}],
            loading.ACTIVITY_WEIGHTS,
            "loading weights 2.5/6.0 GB, rank 0/2 (0 of 2 ranks loaded)",
        ),
        (
            [{"rank": r, "bytes_total": 9, "bytes_loaded": 9, "done": True} for r in (0, 1)],
            loading.ACTIVITY_GROUPS,
            "building communication groups",
        ),
    ],
    ids=["nothing-yet", "not-begun", "part-way", "all-loaded"],
)
def test_progress_is_worded_once(ranks: list[dict[str, object]], activity: str, says: str) -> None:
    now = loading_server.progress_from(lambda: ranks, ranks_total=2)()
    assert now.activity == activity and says in now.message()


def test_health_waits_for_the_model_and_other_routes_say_it_loads() -> None:
    client = testclient.TestClient(
        loading_server.create_app(loading_server.progress_from(lambda: [], ranks_total=1))
    )
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == loading.LOADING
    chat = client.post("/v1/completions", json={"prompt": "x"})
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "loading"
