"""Pure parts of the executors: rank ordering across nodes and switch validation."""

from __future__ import annotations

import pytest

from moe_runtime.executor import base


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
    ],
    ids=["grow", "shrink-highest-leave", "renumber-after-a-death"],
)
def test_switch_relabels(ranks: list[int], live: list[int], expected: dict[int, int]) -> None:
    assert base.check_switch(ranks, live=live) == expected


@pytest.mark.parametrize(
    ("ranks", "live", "message"),
    [
        ([], [0], "at least one"),
        ([0, 0], [0, 1], "distinct"),
        ([0, 5], [0, 1], "not live"),
        ([0, 2], [0, 1, 2], "remove them first"),
    ],
    ids=["empty", "duplicate", "unknown", "label-clash"],
)
def test_bad_switch_is_refused(ranks: list[int], live: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        base.check_switch(ranks, live=live)
