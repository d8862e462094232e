"""The mesh expert layout's pure parts (`rank.mesh`, docs/TENSOR-PARALLEL.md, "Experts over
every device"): members and slot parts, the mesh group's rendezvous, and EPLB balancing every
device's part of the slots (`elastic.rebalance.periodic_target`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.elastic import rebalance
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.rank import mesh, pipeline_group


def test_tp_rank_t_of_dp_rank_d_holds_part_t_of_its_slots() -> None:
    placement = policy.identity(2, 8, 12, 3)  # 3 DP ranks x 4 slots, T = 2: 2 a device
    for d in range(3):
        whole = placement.slots_of_rank(d, 3)
        parts = [placement.slots_of_rank(*mesh.member(d, 3, 2, t)) for t in range(2)]
        assert [*parts[0], *parts[1]] == list(whole)
    mesh.check_slots(12, 3, 2)
    with pytest.raises(ValueError, match="do not split over 3 DP ranks x 2 TP ranks"):
        mesh.check_slots(9, 3, 2)


def test_the_mesh_group_meets_beside_the_leaders_step_group() -> None:
    on_host = group_mod.GroupSpec.local(3, epoch=4, directory="/tmp/x")
    spec = mesh.mesh_spec(on_host, 2)
    assert (spec.world_size, spec.epoch) == (6, 4)
    assert spec.store_path == f"{on_host.store_path}.mesh"
    tcp = dataclasses.replace(on_host, store_path=None, host="10.0.0.1", port=1234)
    spec = mesh.mesh_spec(tcp, 2)
    assert (spec.host, spec.port, spec.namespace, spec.hosted) == ("10.0.0.1", 1234, "mesh/", False)
    # at P > 1 each pipeline stage's mesh group beside its stage group: keys of its own
    staged = mesh.mesh_spec(pipeline_group.stage_spec(tcp, 1), 2)
    assert (staged.namespace, staged.world_size, staged.hosted) == ("pp1/mesh/", 6, False)
    on_stage = mesh.mesh_spec(pipeline_group.stage_spec(on_host, 1), 2)
    assert on_stage.store_path == f"{on_host.store_path}.pp1.mesh"


def test_eplb_balances_every_devices_part_of_the_slots() -> None:
    """Balanced by DP rank alone, a DP rank's two hottest experts can land in one TP rank's
    part (here 170 of its 182 tokens on one device); balanced over DP x T packs, every
    device carries an even share, and the DP ranks stay balanced too."""
    load = torch.tensor([[100.0, 90, 10, 5, 80, 70, 3, 2]])
    old = policy.identity(1, 8, 8, 2)
    by_rank, _, _ = rebalance.periodic_target(load, old, 2, units=1, tolerance=0.0)
    by_device, before, after = rebalance.periodic_target(load, old, 2, units=2, tolerance=0.0)
    assert policy.balancedness(load, by_rank, 4) < 0.6
    assert after == policy.balancedness(load, by_device, 4) > 0.85 > before
    assert policy.balancedness(load, by_device, 2) > 0.95  # still a placement of 2 DP ranks
    by_device.validate(2)


class _Followers:
    """`tensor_group.Followers` that record the calls; their joins end when called off."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def send(self, method: str, *args: object) -> list[str]:
        self.calls.append((method, args))
        return [method]

    def wait(self, pending: list[str], timeout: float | None) -> list[object]:
        if pending == ["join_mesh"]:
            called_off = any(m == "abort_join" for m, _ in self.calls)
            raise RuntimeError("join called off" if called_off else "would wait for the leader")
        return [None for _ in pending]


def _never(spec: group_mod.GroupSpec, member: int) -> None:
    raise TimeoutError("a member never came")


def test_a_leader_whose_mesh_join_fails_calls_off_its_followers_joins() -> None:
    """The followers join the mesh group with their leader; when its own join fails they would
    wait out the group timeout for it: their joins are called off, and the leader's error is
    the one raised."""
    followers = _Followers()
    parts = mesh.MeshParts(followers, size=2)
    spec = group_mod.GroupSpec.local(2, epoch=7, directory="/tmp/x")
    with pytest.raises(TimeoutError, match="a member never came"):
        parts.join(spec, 1, _never)
    assert [m for m, _ in followers.calls] == ["join_mesh", "abort_join"]
    assert followers.calls[1][1] == (7,)


def test_a_recovery_balances_every_devices_part_too() -> None:
    """A lost DP rank in the mesh layout: the survivors' placement is balanced over their
    devices (DP x T packs), as a resize's and EPLB's are, and the moves stay between ranks."""
    load = torch.tensor([[100.0, 90, 10, 5, 80, 70, 3, 2, 60, 1, 1, 1]])
    old = policy.identity(1, 12, 12, 3)
    physical = policy.num_physical_for(12, 4)  # two survivors of T = 2
    by_rank = moves_mod.plan_recovery(
        load, old, old_num_ranks=3, survivors=[0, 2], num_physical=physical
    )
    by_device = moves_mod.plan_recovery(
        load, old, old_num_ranks=3, survivors=[0, 2], num_physical=physical, units=2
    )
    by_device.target.validate(2)
    # two of the five hot experts share a device whatever the packing: 131 of 423 at best
    assert policy.balancedness(load, by_rank.target, 4) < 0.55
    assert policy.balancedness(load, by_device.target, 4) > 0.8
    assert policy.balancedness(load, by_device.target, 2) > 0.95  # the DP ranks stay balanced
    assert all(m.src_rank < 2 and m.dst_rank < 2 for m in by_device.moves)
    assert (by_device.from_source, by_device.from_replicas) == (4, 0)  # rank 1's experts
    with pytest.raises(ValueError, match="units"):
        moves_mod.plan_recovery(
            load, old, old_num_ranks=3, survivors=[0], num_physical=physical, units=0
        )
