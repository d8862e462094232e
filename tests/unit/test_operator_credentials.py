"""Per-deployment tokens derived from the operator's key (plan.credentials)."""

from __future__ import annotations

import pytest

from moe_operator.plan import credentials

KEY = b"k" * 32
WHERE = {"namespace": "ml", "name": "tiny", "uid": "u1"}


def test_a_token_is_stable_for_one_deployment_and_purpose() -> None:
    a = credentials.derive(KEY, purpose="admin", **WHERE)
    assert a == credentials.derive(KEY, purpose="admin", **WHERE)
    assert len(a) == 43 and "=" not in a


@pytest.mark.parametrize(
    "change",
    [{"purpose": "ray"}, {"uid": "u2"}, {"name": "other"}, {"namespace": "prod"}],
    ids=["purpose", "recreated", "name", "namespace"],
)
def test_every_input_changes_the_token(change: dict[str, str]) -> None:
    base = {"purpose": "admin", **WHERE}
    assert credentials.derive(KEY, **base) != credentials.derive(KEY, **{**base, **change})


def test_another_key_gives_other_tokens() -> None:
    assert credentials.derive(KEY, purpose="admin", **WHERE) != credentials.derive(
        b"x" * 32, purpose="admin", **WHERE
    )


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        credentials.derive(b"", purpose="admin", **WHERE)
