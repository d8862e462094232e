"""Failure semantics of a group by backend (`moe_runtime.comm.semantics`): the NCCL environment
that keeps a rank alive, an aborted group that raises `GroupFailed` naming why, a failure the
backend records off the calling thread shown at `check()`, and the choice of the transfer
group's backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import semantics
from moe_runtime.executor import ray_groups


@pytest.fixture()
def one(tmp_path: Any) -> Iterator[group_mod.StatelessGroup]:
    grp = group_mod.StatelessGroup(
        group_mod.GroupSpec.local(1, epoch=0, directory=str(tmp_path)), 0, timeout=30
    )
    yield grp
    grp.destroy()


def test_nccl_groups_are_built_under_the_environment_that_keeps_the_rank_alive(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for key in semantics.Nccl.ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # PyTorch's TearDown
    with caplog.at_level(logging.WARNING):
        semantics.for_backend("nccl").prepare()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: no teardown
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # no std::abort by the monitor
    assert {k: os.environ[k] for k in semantics.Nccl.ENV} == dict(semantics.Nccl.ENV)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 overridden" in caplog.text


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="'mpi'.*known: \\['gloo', 'nccl'\\]"):
        semantics.for_backend("mpi")


def test_an_aborted_group_raises_naming_why(one: group_mod.StatelessGroup) -> None:
    t = torch.ones(3)
    one.all_reduce(t)
    one.check()
    one.abort("rank 4 was lost")
    one.abort("later reason")  # the first reason stays
    with pytest.raises(semantics.GroupFailed, match="rank 4 was lost"):
        one.all_reduce(t)
    with pytest.raises(semantics.GroupFailed, match="rank 4 was lost"):
        one.check()
    assert one.aborted.is_set()
    one.destroy()
    one.destroy()  # idempotent


def test_a_failure_the_backend_records_shows_at_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL records an error off the calling thread (its watchdog); `check()` aborts the group
    and raises it."""

    class Recorded(semantics.Semantics):
        error_seen: str | None = None

        def error(self, pg: Any) -> str | None:
            return self.error_seen

    recorded = Recorded()
    monkeypatch.setitem(semantics.BY_BACKEND, "gloo", recorded)
    grp = group_mod.StatelessGroup(
        group_mod.GroupSpec.local(1, epoch=0, directory=str(tmp_path)), 0, timeout=30
    )
    grp.check()
    recorded.error_seen = "NCCL timeout (watchdog)"
    with pytest.raises(semantics.GroupFailed, match="NCCL timeout"):
        grp.check()
    assert grp.failure == "NCCL timeout (watchdog)" and grp.aborted.is_set()
    grp.destroy()


@pytest.mark.parametrize(
    ("infos", "nccl"),
    [
        pytest.param([{"device": "cuda", "nccl": "2.27.3"}] * 2, True, id="gpus-one-version"),
        pytest.param(
            [{"device": "cuda", "nccl": "2.27.3"}, {"device": "cuda", "nccl": "2.21.5"}],
            False,
            id="gpus-two-versions",
        ),
        pytest.param(
            [{"device": "cuda", "nccl": "2.27.3"}, {"device": "cpu", "nccl": None}],
            False,
            id="a-cpu-rank",
        ),
        pytest.param([{"device": "cpu", "nccl": None}] * 2, False, id="cpu-ranks"),
    ],
)
def test_the_transfer_group_takes_nccl_only_between_compatible_gpu_ranks(
    infos: list[dict[str, Any]], nccl: bool
) -> None:
    assert ray_groups.nccl_compatible(infos) is nccl
