"""The TP collectives of CPU ranks through shared memory (`comm.shm`): the same results as
gloo's (the same bits on every member), call after call through the two alternating buffers,
tensors over the capacity through gloo, and a wait that ends when a member aborts the group or
its process dies, with that error (not the group timeout's)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from moe_runtime.comm import group, shm
from tests.support import polling

T = TypeVar("T")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def members(size: int, fn: Callable[[Any, group.StatelessGroup], T], **kw: Any) -> list[T]:
    """fn(collective, gloo group) on `size` threads, each a member of one local gloo group
    with its shared-memory collectives; results in member order (the first failure raised)."""
    spec = group.GroupSpec.local(size, epoch=1)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        g = group.StatelessGroup(spec, rank, timeout=30)
        try:
            results[rank] = fn(shm.collective(g, **kw), g)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)
            g.abort("a member failed")
        finally:
            g.destroy()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_and_all_gather_give_gloos_results_on_every_member(size: int) -> None:
    def run(c: Any, g: group.StatelessGroup) -> list[torch.Tensor]:
        assert isinstance(c, shm.SharedCollective)
        got = []
        for call in range(40):  # the two buffers, many times over
            gen = torch.Generator().manual_seed(call * 10 + g.rank)
            x = torch.randn(3, 64, generator=gen)
            mine, theirs = x.clone(), x.clone()
            c.all_reduce(mine)
            g.all_reduce(theirs)
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
            gathered = torch.empty(size * 3, 64)
            c.all_gather_into(gathered, x)
            expect = torch.cat([
                torch.randn(3, 64, generator=torch.Generator().manual_seed(call * 10 + m))
                for m in range(size)
            ])  # fmt: skip
            assert torch.equal(gathered, expect)
            got.append(mine)
        half = torch.full((5,), float(g.rank + 1), dtype=torch.bfloat16)
        c.all_reduce(half)
        assert torch.equal(half, torch.full((5,), float(sum(range(1, size + 1)))).bfloat16())
        return got

    results = members(size, run)
    for call in range(40):  # the same bits everywhere (the sum in member order)
        assert all(torch.equal(results[0][call], r[call]) for r in results[1:])


def test_a_tensor_over_the_capacity_goes_through_gloo() -> None:
    def run(c: Any, g: group.StatelessGroup) -> torch.Tensor:
        big = torch.full((1024,), float(g.rank + 1))  # 4 KiB over a 1 KiB slot
        c.all_reduce(big)
        small = torch.full((8,), float(g.rank + 1))
        c.all_reduce(small)
        assert torch.equal(small, torch.full((8,), 3.0))
        return big

    for big in members(2, run, capacity=1024):
        assert torch.equal(big, torch.full((1024,), 3.0))


def test_an_abort_ends_the_other_members_wait() -> None:
    def run(c: Any, g: group.StatelessGroup) -> None:
        if g.rank == 0:
            # member 1 posted its part: it waits in the call for member 0's
            polling.poll(lambda: int(c._posted[1]) == 1, "member 1 in the call", 30)
            g.abort("the leader's forward pass failed")
            return
        # the abort's error, not the group timeout's ("did not arrive")
        with pytest.raises(shm.SharedMemoryFailed, match="aborted"):
            c.all_reduce(torch.ones(4))

    members(2, run)


MEMBER = """
import os, sys
from moe_runtime.comm import group, shm
spec = group.GroupSpec(group.LOOPBACK, 0, 2, 1, "gloo", sys.argv[1])
shm.collective(group.StatelessGroup(spec, 1, timeout=30))
os._exit(0)  # dies without a word, before the first call
"""


def test_a_member_that_died_fails_the_wait(tmp_path: Any) -> None:
    spec = group.GroupSpec.local(2, epoch=1, directory=str(tmp_path))
    assert spec.store_path is not None
    paths = (os.path.join(ROOT, p) for p in ("runtime", "contract"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.Popen([sys.executable, "-c", MEMBER, spec.store_path], env=env)
    try:
        g = group.StatelessGroup(spec, 0, timeout=60)
        c = shm.collective(g)
        assert isinstance(c, shm.SharedCollective)
        proc.wait(timeout=60)
        # the dead member's error, not the group timeout's ("did not arrive")
        with pytest.raises(shm.SharedMemoryFailed, match="died"):
            c.all_reduce(torch.ones(4))
        g.destroy()
    finally:
        proc.kill()
        proc.wait()


def test_off_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(c: Any, g: group.StatelessGroup) -> bool:
        return c is g

    monkeypatch.setenv(shm.ENV, "0")
    assert members(2, run) == [True, True]
