"""Live resizes of an in-process deployment (LocalExecutor: real ranks and gloo groups, no Ray).

Under continuous load, the resize sequence 2→4→3→1→2 completes with no failed request, and
every answer equals single-process greedy generation token for token.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime import staging
from moe_runtime import step as step_mod
from moe_runtime.elastic import coordinator, service, serving, stages
from moe_runtime.engine import core
from moe_runtime.engine import request as req
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.model import generate
from moe_runtime.model import source as source_mod

SOURCE = "synthetic://tiny?seed=0"
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 5) % 17)] for i in range(12)]
LENGTHS = [4, 9, 16, 24]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of every (prompt, length), single process, all experts local."""
    torch.set_num_threads(1)
    longest = generate.generate_greedy(SOURCE, PROMPTS, max(LENGTHS))
    return {(p, n): longest[p][:n] for p in range(len(PROMPTS)) for n in LENGTHS}


class Deployment:
    def __init__(
        self,
        size: int,
        *,
        max_experts_per_rank: int | None = None,
        weight_source: str = "peer",
        eplb_min_gain: float = 0.02,
    ) -> None:
        src = source_mod.open_source(SOURCE)
        self.cfg = src.config
        physical = policy.num_physical_for(self.cfg.num_experts, size)
        placement = policy.identity(self.cfg.num_layers, self.cfg.num_experts, physical, size)
        self.executor = local.LocalExecutor(size)
        self.executor.start(SOURCE, placement=placement)
        self.engine = core.Engine(
            self.executor,
            src.tokenizer(),
            core.EngineConfig(max_model_len=self.cfg.max_position_embeddings),
        )
        self.elastic = service.ElasticService.attach(
            engine=self.engine,
            executor=self.executor,
            model_config=self.cfg,
            placement=placement,
            config=serving.ElasticConfig(
                source=SOURCE,
                eplb_step_interval=40,
                eplb_window_size=40,
                eplb_min_gain=eplb_min_gain,
                weight_source=weight_source,
            ),
            limits=coordinator.Limits(
                min_size=1,
                max_size=4,
                num_experts=self.cfg.num_experts,
                max_experts_per_rank=max_experts_per_rank,
            ),
        )
        self.engine.start()

    def close(self) -> None:
        self.elastic.close()
        self.engine.stop()
        self.executor.shutdown()

    def generate(self, prompt: int, n: int, *, rid: str) -> req.CompletedRequest:
        handle = self.engine.add_request(
            req.Request(
                request_id=rid,
                prompt_token_ids=PROMPTS[prompt],
                sampling=step_mod.SamplingParams(temperature=0.0),
                max_tokens=n,
                ignore_eos=True,
            )
        )
        return handle.result(timeout=120)


@pytest.fixture()
def deployment() -> Iterator[Deployment]:
    d = Deployment(2)
    yield d
    d.close()


class Load:
    """`clients` threads sending greedy completions until stopped; every answer is checked."""

    def __init__(self, dep: Deployment, ref: dict[tuple[int, int], list[int]], clients: int):
        self.dep, self.ref = dep, ref
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        k = 0
        while not self._stop.is_set():
            p, n = rng.randrange(len(PROMPTS)), rng.choice(LENGTHS)
            k += 1
            try:
                out = self.dep.generate(p, n, rid=f"c{index}-{k}")
                problem = out.error or (
                    None if out.token_ids == self.ref[(p, n)] else f"tokens differ for {(p, n)}"
                )
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if problem:
                    self.failed.append(problem)
                else:
                    self.ok += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def resize(dep: Deployment, to: int) -> Any:
    record = dep.elastic.coordinator.request(to)
    assert dep.elastic.coordinator.wait(record, timeout=240), f"resize to {to} did not finish"
    assert record.succeeded, record.message
    return record


def test_resize_sequence_under_load_loses_nothing(
    deployment: Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    with Load(deployment, reference, clients=8) as load:
        records = [resize(deployment, to) for to in (4, 3, 1, 2)]
        deadline = time.monotonic() + 60
        while load.ok < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert load.failed == []
    assert load.ok >= 40
    assert deployment.executor.num_ranks == 2
    up, down = stages.SCALE_UP[:-1], stages.SCALE_DOWN[:-1]
    for record in records:
        want = up if record.to_size > record.from_size else down
        assert tuple(s.stage for s in record.stages) == want
    status = deployment.elastic.status()
    assert status["data_parallel_size"] == 2
    assert [h["to"] for h in status["history"]] == [4, 3, 1, 2]
    assert records[0].bytes_non_expert > 0 and records[0].bytes_expert > 0
    for record in records:
        print(
            f"{record.from_size}->{record.to_size}: {record.duration_s:.2f}s, blackout "
            f"{record.blackout_s * 1000:.0f} ms, stages {record.stage_durations()}"
        )
    print(f"requests ok={load.ok} failed={len(load.failed)}")


def test_shrink_moves_long_generations_off_departing_ranks(
    deployment: Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    resize(deployment, 4)
    results: dict[int, req.CompletedRequest] = {}

    def run(p: int) -> None:
        results[p] = deployment.generate(p, 24, rid=f"long-{p}")

    threads = [threading.Thread(target=run, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        per_rank = deployment.engine.stats().seqs_per_rank
        if per_rank.get(2, 0) + per_rank.get(3, 0) > 0:
            break
        time.sleep(0.005)
    record = resize(deployment, 2)
    for t in threads:
        t.join(timeout=120)
    assert record.sequences_migrated > 0  # some long generations ran on ranks 2 and 3
    assert sorted(i["rank"] for i in record.freed) == [2, 3]
    assert {p: r.token_ids for p, r in results.items()} == {p: reference[(p, 24)] for p in range(8)}
    assert all(r.error is None for r in results.values())


def test_a_shrink_back_after_a_grow_copies_no_expert(
    reference: dict[tuple[int, int], list[int]],
) -> None:
    """The survivors retain the experts a grow took off them: 2→4→2→4→2 under load, each
    shrink takes the placement of size 2 again and moves no expert, and every answer is the
    greedy reference."""
    dep = Deployment(2, eplb_min_gain=1.0)  # no EPLB commit: size 2's placement always fits
    try:
        at_two = dep.elastic.rebalancer.serving.placement
        workers = (dep.executor.worker(0), dep.executor.worker(1))

        def held(w: Any) -> set[tuple[int, int]]:  # (layer, logical) experts it serves with
            return set(staging.held_experts(w.placement, w.rank, w.num_ranks, w.experts))

        before = [held(w) for w in workers]
        with Load(dep, reference, clients=4) as load:
            for _ in range(2):
                grow = resize(dep, 4)
                assert grow.expert_moves > 0 and grow.experts_retained == 0
                deadline = time.monotonic() + 30  # the grow is confirmed by its Reshuffling
                while any(w.live_state()["retained"] == 0 for w in workers):
                    assert time.monotonic() < deadline, "the survivors retained nothing"
                    time.sleep(0.01)
                for w, at_two_held in zip(workers, before, strict=True):
                    kept = set(w.retained_keys())
                    assert kept >= at_two_held - held(w) and not kept & held(w)  # given away
                at_four = [held(w) for w in workers]
                shrink = resize(dep, 2)
                assert shrink.expert_moves == 0 and shrink.bytes_expert == 0
                assert shrink.experts_retained == shrink.expert_moves_lower_bound > 0
                assert dep.elastic.rebalancer.serving.placement.equals(at_two)
                for w, at_two_held, at_four_held in zip(workers, before, at_four, strict=True):
                    assert held(w) == at_two_held  # all it gave away serves again, ...
                    assert set(w.retained_keys()) >= at_four_held - at_two_held  # ... and back
            deadline = time.monotonic() + 60
            while load.ok < 20 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert load.failed == []
        assert load.ok >= 20
    finally:
        dep.close()


def test_a_shrink_to_a_placement_that_no_longer_fits_takes_a_fresh_one(
    reference: dict[tuple[int, int], list[int]],
) -> None:
    """With no tolerance for a worse balance, the shrink back balances afresh: it moves what
    the survivors do not retain, and answers stay the greedy reference."""
    dep = Deployment(2, eplb_min_gain=0.0)
    try:
        at_two = dep.elastic.rebalancer.serving.placement
        with Load(dep, reference, clients=3) as load:
            resize(dep, 4)
            shrink = resize(dep, 2)
            deadline = time.monotonic() + 60
            while load.ok < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not dep.elastic.rebalancer.serving.placement.equals(at_two)
        assert shrink.experts_retained > 0 and shrink.expert_moves > 0
        assert shrink.expert_moves + shrink.experts_retained == shrink.expert_moves_lower_bound
        assert load.failed == []
        assert load.ok >= 10
    finally:
        dep.close()


def test_injected_failure_leaves_old_size_serving_and_next_resize_works(
    deployment: Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    deployment.elastic.coordinator.inject_failure(stages.Stage.TRANSFERRING)
    record = deployment.elastic.coordinator.request(4)
    assert deployment.elastic.coordinator.wait(record, timeout=240)
    assert record.stage is stages.Stage.FAILED
    assert "Transferring failed: injected failure" in record.message
    assert "cleanup problems" not in record.message
    assert deployment.executor.num_ranks == 2 and deployment.executor.pending_ranks == []
    for w in (deployment.executor.worker(0), deployment.executor.worker(1)):
        assert {epoch for epoch, _ in w.groups()} == {0}  # the standby groups are gone
    out = deployment.generate(3, 16, rid="after-failure")
    assert out.token_ids == reference[(3, 16)]
    again = resize(deployment, 4)
    assert again.stage is stages.Stage.COMPLETED and deployment.executor.num_ranks == 4
    out = deployment.generate(5, 16, rid="after-retry")
    assert out.token_ids == reference[(5, 16)]


def test_dynamic_eplb_rebalances_while_serving(
    deployment: Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    ops_ = deployment.elastic.rebalancer
    identity = ops_.serving.placement
    with Load(deployment, reference, clients=4) as load:
        deadline = time.monotonic() + 120
        while ops_.rebalances < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert load.failed == []
    assert ops_.rebalances >= 1, ops_.last_rebalance
    assert not ops_.serving.placement.equals(identity)
    last = ops_.last_rebalance
    assert last["applied"] and last["after"] > last["before"] and last["moves"] > 0
    status = deployment.elastic.status()["eplb"]
    assert status["rebalances"] >= 1 and 0 < status["balancedness"] <= 1


def test_new_ranks_can_read_non_expert_weights_from_storage(
    reference: dict[tuple[int, int], list[int]],
) -> None:
    dep = Deployment(1, weight_source="storage")
    try:
        record = resize(dep, 3)
        assert record.bytes_non_expert > 0  # read by the two new ranks from the source
        outs = [dep.generate(p, 16, rid=f"storage-{p}") for p in range(6)]
        assert [o.token_ids for o in outs] == [reference[(p, 16)] for p in range(6)]
        assert set(dep.engine.stats().seqs_per_rank) <= {0, 1, 2}
    finally:
        dep.close()


def test_status_reports_the_sequences_in_flight(deployment: Deployment) -> None:
    """``load`` of /elastic_ep/status: running + queued sequences (the operator's autoscaler
    decides on ``in_flight``), back to zero once they finished."""
    assert deployment.elastic.status()["load"] == {"running": 0, "waiting": 0, "in_flight": 0}
    handles = [
        deployment.engine.add_request(
            req.Request(
                request_id=f"busy-{p}",
                prompt_token_ids=PROMPTS[p],
                sampling=step_mod.SamplingParams(temperature=0.0),
                max_tokens=200,
                ignore_eos=True,
            )
        )
        for p in range(6)
    ]
    load = deployment.elastic.status()["load"]
    assert load["in_flight"] == load["running"] + load["waiting"] == 6
    for handle in handles:
        handle.result(timeout=120)
    deadline = time.monotonic() + 30  # the engine forgets a sequence after its last output
    while deployment.elastic.status()["load"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deployment.elastic.status()["load"]["in_flight"] == 0
