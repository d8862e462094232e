"""How long the driver sleeps before reading a compiled graph's output (`executor.step_wait`):
through most of a step like the recent ones, never on a step with nothing to go by."""

from __future__ import annotations

import pytest

from moe_runtime import step as step_mod
from moe_runtime.executor import step_wait


def test_a_decode_like_the_last_ones_is_slept_through_up_to_the_fraction() -> None:
    wait = step_wait.StepWait(0.8)
    for seconds in (0.030, 0.020, 0.025):
        wait.landed(64, seconds, at=100.0)
    # sent before the last step landed: it starts when that one landed; the fastest is taken
    assert wait.delay(64, sent_at=99.99, now=100.002) == pytest.approx(0.8 * 0.020 - 0.002)
    # sent later: it starts when sent
    assert wait.delay(60, sent_at=100.010, now=100.010) == pytest.approx(0.8 * 0.020)
    # most of it already gone: no sleep shorter than MIN_SLEEP_SECONDS
    assert wait.delay(64, sent_at=99.99, now=100.0155) == 0.0


@pytest.mark.parametrize(
    "tokens", [pytest.param(2048, id="a-prefill"), pytest.param(16, id="far-fewer"), 0]
)
def test_a_step_unlike_the_recent_ones_is_not_slept_on(tokens: int) -> None:
    wait = step_wait.StepWait()
    wait.landed(64, 0.025, at=100.0)
    assert wait.estimate(tokens) is None
    assert wait.delay(tokens, sent_at=100.0, now=100.0) == 0.0


def test_nothing_landed_yet_or_fraction_zero_spins_from_the_start() -> None:
    assert step_wait.StepWait().delay(64, sent_at=0.0, now=0.0) == 0.0
    spin = step_wait.StepWait(0.0)
    spin.landed(64, 0.025, at=100.0)
    assert spin.delay(64, sent_at=100.0, now=100.0) == 0.0


def test_the_busiest_ranks_tokens_key_the_estimate() -> None:
    sampling = step_mod.SamplingParams()
    batches = {
        0: step_mod.RankBatch([step_mod.SeqWork("a", [1, 2, 3], 0, sampling)]),
        1: step_mod.RankBatch([step_mod.SeqWork(s, [1], 9, sampling) for s in "bcde"]),
    }
    assert step_mod.StepInput(1, batches).most_tokens() == 4
    assert step_mod.StepInput(2).most_tokens() == 0


@pytest.mark.parametrize(("raw", "want"), [("", step_wait.WAIT_FRACTION), ("0", 0.0), ("0.5", 0.5)])
def test_the_fraction_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, want: float
) -> None:
    monkeypatch.setenv(step_wait.WAIT_FRACTION_ENV, raw)
    assert step_wait.fraction_from_env() == want


@pytest.mark.parametrize("raw", ["1", "-0.1", "most"])
def test_a_bad_fraction_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(step_wait.WAIT_FRACTION_ENV, raw)
    with pytest.raises(ValueError, match=step_wait.WAIT_FRACTION_ENV):
        step_wait.fraction_from_env()
