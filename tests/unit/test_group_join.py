"""Joining a group is cancellable and names who is missing (`comm.group`, `executor.joins`).

Members run on threads of this process: FileStore and TCPStore rendezvous, real gloo groups.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.executor import base, local
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import pipeline_group, stage_worker

#: Far longer than any test here waits: a test that reaches it has failed.
LONG = 60.0


def _join_all(
    spec: group_mod.GroupSpec, ranks: list[int], **kwargs: Any
) -> list[concurrent.futures.Future[group_mod.StatelessGroup]]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(ranks))
    futures = [pool.submit(group_mod.StatelessGroup, spec, r, **kwargs) for r in ranks]
    pool.shutdown(wait=False)
    return futures


@pytest.fixture(params=["file", "tcp"])
def spec_of(request: pytest.FixtureRequest, tmp_path: Any) -> Callable[[int], group_mod.GroupSpec]:
    def make(world_size: int) -> group_mod.GroupSpec:
        if request.param == "file":
            return group_mod.GroupSpec.local(world_size, epoch=1, directory=str(tmp_path))
        return group_mod.GroupSpec.tcp(
            group_mod.LOOPBACK, group_mod.free_port(), world_size, epoch=1
        )

    return make


def test_members_that_all_come_form_a_working_group(
    spec_of: Callable[[int], group_mod.GroupSpec],
) -> None:
    groups = [f.result(timeout=30) for f in _join_all(spec_of(3), [0, 1, 2], timeout=LONG)]
    tensors = [torch.full((2,), float(g.rank)) for g in groups]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(lambda gt: gt[0].all_reduce(gt[1]), zip(groups, tensors, strict=True)))
    assert all(t.tolist() == [3.0, 3.0] for t in tensors)
    for g in groups:
        g.destroy()


def test_pipeline_stage_groups_meet_beside_their_leaders_group(
    spec_of: Callable[[int], group_mod.GroupSpec],
) -> None:
    """Each pipeline stage's group of an epoch is derived from the leaders' step group
    (`pipeline_group.stage_spec`): over TCP (DP ranks on several hosts) its own keys in the
    store the leaders' rank 0 hosts, on one host a FileStore of its own. Two stage groups and
    the leaders' group work at once, each summing only its own members' tensors."""
    spec = spec_of(2)
    leaders = [f.result(timeout=30) for f in _join_all(spec, [0, 1], timeout=LONG)]
    stages = {
        s: [f.result(timeout=30) for f in _join_all(pipeline_group.stage_spec(spec, s), [0, 1],
                                                     timeout=LONG)]
        for s in (1, 2)
    }  # fmt: skip
    members = [(g, 10.0 * s + g.rank) for s, gs in stages.items() for g in gs]
    members += [(g, 100.0 + g.rank) for g in leaders]
    tensors = [torch.full((2,), value) for _, value in members]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(members)) as pool:
        list(
            pool.map(
                lambda gt: gt[0].all_reduce(gt[1]),
                zip([g for g, _ in members], tensors, strict=True),
            )
        )
    assert [t[0].item() for t in tensors] == [21.0, 21.0, 41.0, 41.0, 201.0, 201.0]
    for g, _ in members:
        g.destroy()


def test_a_member_that_never_comes_is_named_when_the_timeout_ends(
    spec_of: Callable[[int], group_mod.GroupSpec],
) -> None:
    """Rank 2 never joins (rank 0 hosts the TCP store, so the others can reach it)."""
    futures = _join_all(spec_of(3), [0, 1], timeout=1.0)
    for f in futures:
        with pytest.raises(group_mod.JoinTimeout, match=r"members \[2\] did not join") as info:
            f.result(timeout=LONG)
        assert info.value.missing == [2]


def test_a_join_called_off_returns_at_once(
    spec_of: Callable[[int], group_mod.GroupSpec],
) -> None:
    """Rank 0 never comes: on TCP the others cannot even reach the store; the call-off ends
    their join (JoinAborted) instead of its timeout (JoinTimeout). (How soon: bench/failures.py.)"""
    stop = threading.Event()
    futures = _join_all(spec_of(3), [1, 2], timeout=LONG, aborted=stop.is_set)
    assert not any(f.done() for f in futures)  # waiting for rank 0
    stop.set()
    for f in futures:
        with pytest.raises(group_mod.JoinAborted):
            f.result(timeout=2 * LONG)


def test_a_leaders_call_off_reaches_its_pipeline_stages_joins(
    spec_of: Callable[[int], group_mod.GroupSpec],
) -> None:
    """A member died before joining: the executor calls its peers' joins of the epoch off
    (`RankGroups.abort_join`); a pipeline leader passes that on to its stages, whose joins of
    the epoch then end at once (JoinAborted), not at their own timeout (60 s)."""
    spec = spec_of(2)
    called_off: list[int] = []
    ctx = context_mod.RankContext(
        loaded=None,  # type: ignore[arg-type]  # no weights: only the groups are used
        device="cpu",
        dtype=torch.float32,
        check=lambda point: None,
        where=lambda: "leader",
    )
    groups = groups_mod.RankGroups(ctx, on_abort_join=called_off.append)
    stage = stage_worker.StageWorker(stage=1, size=2, device="cpu")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(stage.join, spec, 1)  # member 0's stage never comes
        with pytest.raises(concurrent.futures.TimeoutError):
            joining.result(timeout=0.5)
        groups.abort_join(spec.epoch)
        for epoch in called_off:  # what `PipelineLeader.abort_join` sends each stage
            stage.abort_join(epoch)
        with pytest.raises(group_mod.JoinAborted):
            joining.result(timeout=30)
    assert called_off == [spec.epoch] and spec.epoch not in stage.groups


# ------------------------------------------------------------------- LocalExecutor


@pytest.fixture()
def three_ranks() -> Iterator[local.LocalExecutor]:
    ex = local.LocalExecutor(3)
    yield ex
    ex.shutdown()


def _in_join(ex: local.LocalExecutor) -> int:
    """Threads inside a group join right now."""
    import sys
    import traceback

    frames = sys._current_frames()
    return sum(
        1
        for t in threading.enumerate()
        if (f := frames.get(t.ident or -1)) is not None
        and any(s.name == "join_group" for s in traceback.extract_stack(f))
    )


def test_a_member_whose_join_fails_calls_the_others_off(
    three_ranks: local.LocalExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2's join fails at once (as a dead process's call does): the build fails naming it
    (an ExecutorError from its join, not the TimeoutError of the group timeout), and no
    member is left waiting in a rendezvous."""
    failing = three_ranks.worker(2).groups
    real = groups_mod.RankGroups.join_group

    def join_group(self: groups_mod.RankGroups, *args: Any, **kwargs: Any) -> None:
        if self is failing:
            raise RuntimeError("this member's process is gone")
        real(self, *args, **kwargs)

    monkeypatch.setattr(groups_mod.RankGroups, "join_group", join_group)
    with pytest.raises(base.ExecutorError, match="rank 2.*process is gone") as info:
        three_ranks.build_groups([0, 1, 2], epoch=4, timeout=LONG)
    assert info.value.ranks == [2]
    assert _in_join(three_ranks) == 0
    assert all(
        (4, role) not in three_ranks.worker(r).groups.groups()
        for r in (0, 1)
        for role in ("step", "transfer")
    )
    monkeypatch.undo()
    three_ranks.build_groups([0, 1, 2], epoch=5, timeout=LONG)  # a next epoch builds at once
    assert {e for e, _ in three_ranks.worker(0).groups.groups()} == {5}


def test_a_member_the_heartbeat_loses_while_joining_fails_the_build(
    three_ranks: local.LocalExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2 hangs before it joins (a stopped process) and is fenced: RankDied names it."""
    hung = three_ranks.worker(2).groups
    release = threading.Event()
    real = groups_mod.RankGroups.join_group

    def join_group(self: groups_mod.RankGroups, *args: Any, **kwargs: Any) -> None:
        if self is hung:
            release.wait(LONG)
            raise RuntimeError("woke up too late")
        real(self, *args, **kwargs)

    monkeypatch.setattr(groups_mod.RankGroups, "join_group", join_group)
    threading.Timer(0.3, three_ranks.fence, args=([2],), kwargs={"reason": "unresponsive"}).start()
    try:
        with pytest.raises(base.RankDied, match=r"ranks \[2\] were lost while joining") as info:
            three_ranks.build_groups([0, 1, 2], epoch=4, timeout=LONG)
        assert info.value.ranks == [2]
    finally:
        release.set()
