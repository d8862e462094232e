"""A rank process's malloc settings (`rank.allocator`): a step's large activations stay in the
heap between steps instead of being unmapped and faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from moe_runtime.rank import allocator

#: One "step": six 16 MB activations allocated, written and freed (a 64 x 32 prefill of
#: bench/engine_vs_hf.py's tiny Mixtral frees ~50 MB per layer the same way).
STEP = textwrap.dedent(
    """
    import resource, sys
    from moe_runtime.rank import allocator
    print(allocator.tune(), file=sys.stderr)
    def step():
        blocks = [bytearray(16 << 20) for _ in range(6)]
        for b in blocks:
            b[::4096] = b"x" * len(b[::4096])
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
    """
)


def faults_per_step(env: dict[str, str]) -> int:
    run = subprocess.run(
        [sys.executable, "-c", STEP],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(run.stdout.strip())


@pytest.mark.skipif(allocator._glibc_mallopt() is None, reason="glibc's malloc only")
def test_tuned_steps_reuse_the_heap_where_glibcs_defaults_fault_every_page_again() -> None:
    default = faults_per_step({allocator.ENV: "0"})
    tuned = faults_per_step({})
    # 96 MB per step is 24,576 pages: glibc's defaults hand most of them back and fault them in
    # again each step; tuned, they stay mapped.
    assert default > 10_000, f"glibc's defaults faulted only {default} pages a step"
    assert tuned < default / 20, f"tuned: {tuned} faults a step against {default}"


def test_settings_are_applied_by_name_and_logged() -> None:
    calls: list[tuple[int, int]] = []
    applied = allocator.tune({}, lambda param, value: calls.append((param, value)) or 1)
    assert calls == list(allocator.SETTINGS.values())
    assert applied == {name: value for name, (_, value) in allocator.SETTINGS.items()}


@pytest.mark.parametrize(
    ("environ", "why"),
    [
        pytest.param({allocator.ENV: "0"}, "off (MOE_MALLOC_TUNING=0)", id="off"),
        pytest.param(
            {"MALLOC_TRIM_THRESHOLD_": "1"}, "left to MALLOC_TRIM_THRESHOLD_", id="user-malloc"
        ),
        pytest.param(
            {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
            "left to GLIBC_TUNABLES",
            id="user-tunables",
        ),
    ],
)
def test_the_user_can_turn_it_off_and_glibcs_own_variables_win(
    environ: dict[str, str], why: str
) -> None:
    calls: list[tuple[int, int]] = []
    assert allocator.tune(environ, lambda p, v: calls.append((p, v)) or 1) == why
    assert calls == []
