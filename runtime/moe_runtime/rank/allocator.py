"""glibc malloc settings of a rank process (`tune`, called first thing by every rank actor).

A forward pass allocates and frees its activations afresh each step: at 64 sequences of 32
prompt tokens (the tiny Mixtral of `bench/engine_vs_hf.py`) the experts' gate/up output alone
is 16 MB per layer. glibc serves a block that large by `mmap` and gives it back by `munmap`
on free, so every step touches fresh pages: measured here, a 64 x 32 prefill took ~36,000
minor page faults and 70 ms of kernel time of its 300 ms (transformers' forward over the same
batch in its own process: 23,000 and 42 ms). With the settings below, the blocks come from
the heap and stay there between steps: ~200 faults, 1 ms, and the prefill at transformers'
time. The same reason makes vLLM's CPU backend ask for tcmalloc; these are glibc's own knobs
(`mallopt(3)`), no library to install.

- `M_MMAP_THRESHOLD` 32 MiB (glibc's largest): blocks below it come from the heap; setting
  it also turns off glibc's dynamic threshold, which otherwise starts at 128 KiB.
- `M_TRIM_THRESHOLD` 512 MiB: free memory at the heap's top is kept up to this much instead
  of being handed back after each step (a rank's peak is bounded: its KV cache is allocated
  once at start-up, `model.kv_budget`, and the activations of a step are what is kept).
- `M_TOP_PAD` 64 MiB: each heap growth asks the kernel for that much more at once.

Skipped where the process is not on glibc, where `MOE_MALLOC_TUNING=0`, or where the user set
glibc's own variables (`MALLOC_*_`, `GLIBC_TUNABLES`): theirs win. The head's `MOE_*`
variables reach every rank actor (`executor.guards.rank_env`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

#: "0" leaves glibc's defaults in the rank processes.
ENV = "MOE_MALLOC_TUNING"
#: glibc's own variables: any of them set, the user tunes malloc and this module does not.
USER_VARS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "GLIBC_TUNABLES",
)
MIB = 1 << 20
#: mallopt(3)'s parameter numbers (malloc.h) -> the value set, by name.
SETTINGS: dict[str, tuple[int, int]] = {
    "mmap_threshold": (-3, 32 * MIB),  # M_MMAP_THRESHOLD
    "trim_threshold": (-1, 512 * MIB),  # M_TRIM_THRESHOLD
    "top_pad": (-2, 64 * MIB),  # M_TOP_PAD
}

Mallopt = Callable[[int, int], int]


def _glibc_mallopt() -> Mallopt | None:
    """glibc's `mallopt`, or None where the C library is another (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: AttributeError elsewhere
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]


def tune(
    environ: Mapping[str, str] = os.environ, mallopt: Mallopt | None = None
) -> dict[str, int] | str:
    """Apply `SETTINGS` to this process's malloc; returns what was set (name -> bytes), or
    why nothing was (logged either way). mallopt: glibc's when None."""
    why = None
    if environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        why = f"off ({ENV}={environ[ENV]})"
    elif any(var in environ for var in USER_VARS):
        why = "left to " + ", ".join(v for v in USER_VARS if v in environ)
    else:
        fn = mallopt or _glibc_mallopt()
        if fn is None:
            why = "not glibc"
        else:
            applied = {name: value for name, (param, value) in SETTINGS.items() if fn(param, value)}
            log.info(
                "malloc: %s (fewer page faults per step; %s=0 keeps glibc's defaults)",
                ", ".join(f"{name} {value // MIB} MiB" for name, value in applied.items()),
                ENV,
            )
            return applied
    log.info("malloc: glibc's defaults kept: %s", why)
    return why
