"""Recovery figures: a rank actor of `moe-runtime serve --data-parallel-size 3` is killed (or
stopped: a hang) under a checked load, and the runtime shrinks around it, then grows back.

Measured per incident (the signal is t = 0):
- detect: when the runtime knew (the recovery record's detected_at), and when a client polling
  /elastic_ep/status every 50 ms first saw it;
- serving again: the record's recovered_at (the survivors step again);
- longest serving gap: the longest time no streamed token reached any client, from t = 0
  until 2 s after serving again;
- in-flight done: when the last request that was in flight at t = 0 finished (every one must
  finish with the reference tokens: the load checks greedy and seeded answers token for token);
- back to full size: when the runtime serves at 3 ranks again (autoRecover: a normal grow, as
  a replacement Ray node or the freed slot offers `moe_rank` again).

Anchors (peers' published figures): vLLM, dead engine -> detected ~30 s ->
healthy ~25-57 s, in-flight requests aborted (vllm #46370, #38862); SGLang 6.2-6.8 s of
interruption for 1-16 failed ranks of 32, requests on the failed rank aborted (LMSYS,
2026-03-17).

Run: .venv/bin/python bench/recovery.py [--signal kill stop] [--rounds 1] [--model ...]
(about a minute per incident on 2 cores; prints figures, asserts none)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import load as load_mod  # noqa: E402
from tests.support import runtime_proc  # noqa: E402

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LENGTHS = (24, 64)
SEEDS = (1,)


class TimedLoad(load_mod.Load):
    """The checked load, also keeping (start, end, ok) of every request (monotonic)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[float, float, bool]] = []

    def _one(self, client: httpx.Client, url: str, case: load_mod.Case) -> str | None:
        started = time.monotonic()
        problem = super()._one(client, url, case)
        with self._lock:
            self.spans.append((started, time.monotonic(), problem is None))
        return problem


def status(url: str) -> dict[str, Any]:
    return runtime_proc.status(url, headers=AUTH)


def incident(url: str, load: TimedLoad, sig: signal.Signals) -> dict[str, float]:
    st = status(url)
    (victim,) = [r for r in st["ranks"] if r["rank"] == 1]
    pid = victim["pid"]
    known = {h["resize_id"] for h in st["history"]}
    wall0, mono0 = time.time(), time.monotonic()
    os.kill(pid, sig)
    seen = rec = full = None
    try:
        deadline = mono0 + 600
        while time.monotonic() < deadline and full is None:
            st = status(url)
            now = time.monotonic() - mono0
            new = [h for h in st["history"] if h["resize_id"] not in known]
            if seen is None and (
                st["stage"] == "Recovering" or new or any(not r["healthy"] for r in st["ranks"])
            ):
                seen = now
            done = [h for h in new if h["kind"] == "recovery" and h["stage"] == "Completed"]
            if rec is None and done:
                rec = done[0]
            if rec is not None and st["data_parallel_size"] == 3 and not st["is_scaling"]:
                full = now
            time.sleep(0.05)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # a stopped rank is fenced by the runtime; make sure
        except ProcessLookupError:
            pass
    if rec is None or full is None:
        raise RuntimeError(f"no recovery / no grow back: {st}")
    info = rec["recovery"]
    back = info["recovered_at"] - wall0
    with load._lock:
        in_flight = [end for start, end, _ in load.spans if start < mono0 < end]
    return {
        "detected_s": info["detected_at"] - wall0,
        "status_shows_s": seen if seen is not None else float("nan"),
        "serving_again_s": back,
        "gap_s": load.longest_gap(mono0, mono0 + back + 2.0),
        "in_flight": float(len(in_flight)),
        "in_flight_done_s": (max(in_flight) - mono0) if in_flight else 0.0,
        "full_size_s": full,
        "rerun": float(info["requests_rerun"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://tiny?seed=0")
    parser.add_argument("--signal", nargs="+", default=["kill", "stop"], choices=["kill", "stop"])
    parser.add_argument("--rounds", type=int, default=1, help="incidents per signal")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--step-mode", default=None, choices=["compiled", "remote"])
    args = parser.parse_args()
    print("reference tokens ...", flush=True)
    reference = load_mod.reference_tokens(args.model, load_mod.cases(lengths=LENGTHS, seeds=SEEDS))
    log = pathlib.Path(tempfile.mkdtemp(prefix="bench-recovery-")) / "serve.log"
    serve = ["--model", args.model, "--data-parallel-size", "3", "--max-data-parallel-size", "4"]
    if args.step_mode:
        serve += ["--step-mode", args.step_mode]
    server = runtime_proc.start(serve, log=log, env={"MOE_ADMIN_TOKEN": TOKEN})
    results: dict[str, list[dict[str, float]]] = {}
    try:
        load = TimedLoad(
            lambda: server.url,
            model_name=_name(args.model),
            reference=reference,
            clients=args.clients,
            lengths=LENGTHS,
            seeds=SEEDS,
        )
        with load:
            _wait_ok(load, 10)
            for name in args.signal:
                sig = signal.SIGKILL if name == "kill" else signal.SIGSTOP
                for i in range(args.rounds):
                    print(f"{sig.name} of rank 1, round {i + 1} ...", flush=True)
                    results.setdefault(sig.name, []).append(incident(server.url, load, sig))
                    _wait_ok(load, 5)
        print(
            f"\nmoe-runtime serve --data-parallel-size 3 ({args.model}), "
            f"{args.clients} clients; {load.summary()}"
        )
        if load.failures:
            print(f"FAILED REQUESTS: {load.failures[:5]}")
    finally:
        server.stop()
    rows = [
        ("detected (runtime)", "detected_s"),
        ("status shows it (client poll)", "status_shows_s"),
        ("serving again on 2 ranks", "serving_again_s"),
        ("longest serving gap (streamed tokens)", "gap_s"),
        ("requests in flight at t=0", "in_flight"),
        ("every in-flight request finished", "in_flight_done_s"),
        ("sequences re-run on survivors", "rerun"),
        ("back to full size (3 ranks)", "full_size_s"),
    ]
    names = list(results)
    print(
        f"\n{'seconds after the signal (median of rounds)':44}" + "".join(f"{n:>10}" for n in names)
    )
    for label, key in rows:
        cells = "".join(f"{statistics.median(r[key] for r in results[n]):10.2f}" for n in names)
        print(f"{label:44}{cells}")
    print(
        "\nanchors: vLLM dead engine -> healthy ~25-57 s, in-flight requests aborted; "
        "SGLang 6.2-6.8 s interruption, requests on the failed rank aborted."
    )
    print(f"requests failed here: {len(load.failures)} (every answer checked against DP=1)")
    return 0


def _wait_ok(load: load_mod.Load, more: int, deadline_s: float = 300.0) -> None:
    target, deadline = load.ok + more, time.monotonic() + deadline_s
    while load.ok < target and time.monotonic() < deadline:
        time.sleep(0.1)


def _name(model: str) -> str:
    return (
        model[len("synthetic://") :].split("?", 1)[0]
        if model.startswith("synthetic://")
        else model.rstrip("/").rsplit("/", 1)[-1]
    )


if __name__ == "__main__":
    sys.exit(main())
