"""The rank protocol version: every rank says it, and a rank of another version (a pod of
another image) is refused with a message that says what to do."""

from __future__ import annotations

import pytest

from moe_contract import protocol
from moe_runtime.executor import local


def test_a_rank_of_the_same_version_is_taken() -> None:
    protocol.check({protocol.INFO_KEY: protocol.VERSION, "pod": "w-1"}, where="rank 1")


@pytest.mark.parametrize(
    "info",
    [{protocol.INFO_KEY: protocol.VERSION + 1, "pod": "w-2"}, {"pod": "w-2"}],
    ids=["newer", "unversioned"],
)
def test_a_rank_of_another_version_is_refused_clearly(info: dict[str, object]) -> None:
    with pytest.raises(protocol.ProtocolMismatch) as refused:
        protocol.check(info, where="rank 2")
    message = str(refused.value)
    assert "rank 2 (pod w-2)" in message and f"speaks {protocol.VERSION}" in message
    assert "another image" in message and "spec.ray.image" in message


def test_every_rank_says_its_version() -> None:
    executor = local.LocalExecutor(1)
    try:
        (info,) = executor.rank_infos().values()
    finally:
        executor.shutdown()
    assert info[protocol.INFO_KEY] == protocol.VERSION
