"""Pure parts of the executors: rank ordering across nodes and switch validation."""

from __future__ import annotations

import pytest

from moe_runtime.executor import base, roster


def test_ranks_are_ordered_driver_node_first_then_smaller_nodes_then_ip() -> None:
    infos = [
        {"node_id": "big", "ip": "10.0.0.1"},
        {"node_id": "small", "ip": "10.0.0.9"},
        {"node_id": "driver", "ip": "10.0.0.5"},
        {"node_id": "big", "ip": "10.0.0.1"},
        {"node_id": "other", "ip": "10.0.0.2"},
    ]
    order = base.order_ranks(infos, driver_node="driver", existing_nodes=["small"])
    # driver first; then one-worker node "other"; then "small" (2 with the existing one) and
    # "big" (2) by IP: big's 10.0.0.1 before small's 10.0.0.9
    assert order == [2, 4, 0, 3, 1]


@pytest.mark.parametrize(
    ("ranks", "live", "expected"),
    [
        ([0, 1, 2, 3], [0, 1, 2, 3], {0: 0, 1: 1, 2: 2, 3: 3}),
        ([0, 1], [0, 1, 2, 3], {0: 0, 1: 1, 2: 2, 3: 3}),
        ([0, 2], [0, 2], {0: 0, 2: 1}),
        ([0, 2], [0, 1, 2], {0: 0, 2: 1, 1: 3}),
        ([0, 1, 5], [0, 1, 2, 5, 6], {0: 0, 1: 1, 5: 2, 2: 7, 6: 6}),
    ],
    ids=[
        "grow",
        "shrink-highest-leave",
        "renumber-after-a-death",
        "left-out-label-taken-moves-up",
        "a-spare-below-the-new-size-moves-up",
    ],
)
def test_switch_relabels(ranks: list[int], live: list[int], expected: dict[int, int]) -> None:
    assert roster.check_switch(ranks, live=live) == expected


@pytest.mark.parametrize(
    ("ranks", "live", "message"),
    [
        ([], [0], "at least one"),
        ([0, 0], [0, 1], "distinct"),
        ([0, 5], [0, 1], "not live"),
    ],
    ids=["empty", "duplicate", "unknown"],
)
def test_bad_switch_is_refused(ranks: list[int], live: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        roster.check_switch(ranks, live=live)


def test_a_worker_whose_label_a_switch_took_while_it_started_gets_a_free_one() -> None:
    """A rank pool's process reserves label 2 beside ranks 0 and 1 and a spare (3); while it
    starts, a grow switches to ranks [0, 1, 3] (the spare becomes 2). When it is added it must
    not replace the serving rank 2: it takes the next free label."""
    members: roster.Roster[str] = roster.Roster()
    members.add([roster.Member(label=r, handle=f"rank{r}") for r in (0, 1)], active=True)
    (pool_label,) = members.reserve(1)  # 2: the pool's process starts
    (spare_label,) = members.reserve(1)  # 3: the spare
    members.add([roster.Member(label=spare_label, handle="spare")])
    members.unreserve([spare_label])
    members.relabel(members.mapping_for([0, 1, spare_label]), num_active=3)
    assert members.member(2).handle == "spare" and members.active() == [0, 1, 2]
    started = roster.Member(label=pool_label, handle="pooled")
    moved = members.add([started])
    members.unreserve([pool_label])
    assert moved == [started] and started.label == 3 and started.info["label"] == 3
    assert members.member(2).handle == "spare" and members.member(3).handle == "pooled"
    # one whose label is still free keeps it
    (free,) = members.reserve(1)
    assert members.add([roster.Member(label=free, handle="next")]) == []


def test_moves_between_ranks_of_one_node_go_through_shared_memory() -> None:
    from moe_runtime.eplb import moves as moves_mod
    from moe_runtime.executor import ray_transfer

    members = [10, 11, 12, 13]  # transfer-group rank i is label members[i]
    node = {10: "a", 11: "a", 12: "b", 13: "a"}
    moves = [
        moves_mod.ExpertMove(layer=0, logical=1, src_rank=0, dst_rank=1, dst_slot=0),
        moves_mod.ExpertMove(layer=0, logical=2, src_rank=0, dst_rank=2, dst_slot=0),
        moves_mod.ExpertMove(layer=1, logical=1, src_rank=0, dst_rank=1, dst_slot=1),
        moves_mod.ExpertMove(layer=1, logical=1, src_rank=0, dst_rank=3, dst_slot=1),
        moves_mod.ExpertMove(layer=0, logical=3, src_rank=3, dst_rank=3, dst_slot=2),
    ]
    shared, rest = ray_transfer.split_moves(moves, members, node.__getitem__)
    assert shared == {(10, 11): [moves[0], moves[2]], (10, 13): [moves[3]]}
    assert rest == [moves[1], moves[4]]  # another node; a local copy
    assert ray_transfer.exporters(shared) == [((10, 11), [(0, 1), (1, 1)]), ((10, 13), [(1, 1)])]
    # chunks of one pair alternate with the other pairs' (every receiver starts early)
    assert ray_transfer.exporters(shared, chunk=1) == [
        ((10, 11), [(0, 1)]),
        ((10, 13), [(1, 1)]),
        ((10, 11), [(1, 1)]),
    ]
    refs = [((10, 11), "r1"), ((12, 11), "r2"), ((10, 13), "r3"), ((10, 11), "r4")]
    assert ray_transfer.received_by(refs, 11) == ["r1", "r2", "r4"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_come_back_equal_and_private(dtype: str) -> None:
    import torch

    from moe_runtime.executor import ray_transfer
    from moe_runtime.model import experts as experts_mod

    torch_dtype = getattr(torch, dtype)
    w = experts_mod.ExpertWeights(
        experts_mod.Activation("gpt_oss", 1.5, 6.0),
        gate=torch.randn(4, 3).to(torch_dtype),
        down=torch.randn(3, 4).to(torch_dtype),
        up=torch.randn(4, 3).to(torch_dtype),
        down_bias=torch.randn(3).to(torch_dtype),
    )
    packed = ray_transfer.pack_experts({(2, 5): w})
    experts, nbytes = ray_transfer.unpack_experts([packed], dtype=torch_dtype, device="cpu")
    got = experts[(2, 5)]
    assert nbytes == (3 * 12 + 3) * torch_dtype.itemsize
    assert list(got.tensors()) == ["gate", "down", "up", "down_bias"]  # every tensor, in order
    assert got.activation == w.activation
    for a, b in zip(got.tensors().values(), w.tensors().values(), strict=True):
        assert a.dtype == torch_dtype and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr()  # a copy, not a view of the sender's memory
    state, nbytes = ray_transfer.unpack_state(ray_transfer.pack_state({"x": w["down"]}))
    assert nbytes == 12 * torch_dtype.itemsize and torch.equal(state["x"], w["down"])
