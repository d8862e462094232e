"""Live resize figures on synthetic://small: 2→4 and 4→2 under load, against cold starts.

Measured in one run, with one `moe-runtime serve` per `--warm-spare-ranks` value and one (with
no warm spares) per non-zero `--rank-pool` value (Ray ranks, compiled step graph unless
`--step-mode remote`), each resize `--repeats` times (medians):
- total resize time and per-stage durations (from /elastic_ep/status history);
- blackout: the longest interval in which no request made progress (server-side, from the
  step loop) and, from the clients, the longest gap between two streamed tokens of one request;
- the switch pause: how long the switch held the step loop (`switch_pause_s` of the record);
- cold start: wall time from `moe-runtime serve` to /health 200 of a fresh server at the target
  size without spares, and the ratio resize / cold start (aim: <= 0.25 without warm spares,
  with or without a rank pool of pre-started weightless processes; <= 0.05 with spares);
- expert bytes moved against the lower bound for that placement change (every (layer, rank,
  expert) the new placement needs and the old one did not hold, times the bytes of one expert);
  a grow on warm spares that hold its experts pre-staged moves less than the bound (the bench
  waits for the pre-staging before it, and prints how long that took);
- balancedness before and after (over the EPLB window).

It also draws each server's run (e2e/timeline.py): tokens/s over time, per rank by their share
of the routed tokens, the stage bands of both resizes, the size, and `requests: ok=N
failed=M`, into `--png` (default out/resize-timeline.png; out/resize-timeline-spares2.png for
the server with 2 warm spares, out/resize-timeline-pool2.png for the one with a pool of 2).

Run: .venv/bin/python bench/resize.py   (a few minutes on 2 cores; prints figures, asserts none)
     .venv/bin/python bench/resize.py --warm-spare-ranks 2 --repeats 3 --step-mode remote
     .venv/bin/python bench/resize.py --warm-spare-ranks 0 --rank-pool 2 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import timeline  # noqa: E402
from tests.support import runtime_proc  # noqa: E402

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StreamingLoad:
    """`clients` streaming greedy completions in a loop; records the largest inter-token gap."""

    def __init__(self, url: str, model: str, clients: int) -> None:
        self.url, self.model = url, model
        self.ok = 0
        self.failed = 0
        self.max_gap = 0.0
        #: (wall time, tokens) of every streamed delta: the timeline's tokens/s
        self.token_times: list[tuple[float, int]] = []
        self._window: tuple[float, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def measure_from(self) -> None:
        with self._lock:
            self.max_gap = 0.0

    def _run(self, index: int) -> None:
        body = {
            "model": self.model,
            "prompt": [1 + (index * 13 + j) % 200 for j in range(16)],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self._stop.is_set():
                try:
                    last = None
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}")
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            now = time.monotonic()
                            with self._lock:
                                if last is not None:
                                    self.max_gap = max(self.max_gap, now - last)
                                self.token_times.append((time.time(), 1))
                            last = now
                    with self._lock:
                        self.ok += 1
                except (httpx.HTTPError, RuntimeError):
                    with self._lock:
                        self.failed += 1

    def __enter__(self) -> StreamingLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)


def serve_args(model: str, size: int, *, step_mode: str | None = None) -> list[str]:
    args = ["--model", model, "--data-parallel-size", str(size), "--max-data-parallel-size", "4"]
    return args + (["--step-mode", step_mode] if step_mode else [])


def cold_start(model: str, size: int, workdir: pathlib.Path, *, step_mode: str) -> float:
    started = time.monotonic()
    srv = runtime_proc.start(
        serve_args(model, size, step_mode=step_mode), log=workdir / f"cold-{size}.log"
    )
    seconds = time.monotonic() - started
    srv.stop()
    return seconds


def status(url: str) -> dict[str, Any]:
    st: dict[str, Any] = httpx.get(f"{url}/elastic_ep/status", headers=AUTH, timeout=60).json()
    return st


def wait_spares(url: str, count: int, deadline_s: float = 600.0) -> float:
    """Seconds until `count` warm spare ranks are ready (0 when none are kept)."""
    started = time.monotonic()
    while count and sum(s["ready"] for s in status(url)["spares"]) < count:
        if time.monotonic() - started > deadline_s:
            raise TimeoutError(f"{count} warm spares not ready in {deadline_s}s")
        time.sleep(0.2)
    return time.monotonic() - started


def pool_ready(url: str) -> int:
    """`moe_rank_pool_ready` of /metrics (0 without a pool)."""
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("moe_rank_pool_ready "):
            return int(float(line.split()[-1]))
    return 0


def wait_pool(url: str, count: int, deadline_s: float = 600.0) -> float:
    """Seconds until the rank pool holds `count` started processes (0 when none are kept)."""
    started = time.monotonic()
    while count and pool_ready(url) < count:
        if time.monotonic() - started > deadline_s:
            raise TimeoutError(f"a rank pool of {count} not refilled in {deadline_s}s")
        time.sleep(0.2)
    return time.monotonic() - started


def wait_prestaged(url: str, deadline_s: float = 300.0) -> float:
    """Seconds until every spare holds the experts its grows want pre-staged (`prestaged`
    held == wanted in /elastic_ep/status; a spare with nothing to pre-stage counts)."""
    started = time.monotonic()

    def done() -> bool:
        for spare in status(url)["spares"]:
            pre = spare.get("prestaged")
            if pre is None or pre["held"] < pre["wanted"]:
                return False
        return True

    while not done():
        if time.monotonic() - started > deadline_s:
            raise TimeoutError(f"warm spares not pre-staged in {deadline_s}s")
        time.sleep(0.2)
    return time.monotonic() - started


def resize(url: str, to: int) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/scale_elastic_ep?wait=true",
        json={"new_data_parallel_size": to},
        headers=AUTH,
        timeout=900,
    )
    r.raise_for_status()
    st = httpx.get(f"{url}/elastic_ep/status", headers=AUTH, timeout=60).json()
    record: dict[str, Any] = st["history"][-1]
    return record


def bytes_per_expert(model: str) -> int:
    import math

    from moe_runtime.model import names, source

    cfg = source.open_source(model).config
    return sum(math.prod(shape) for shape in names.expert_parts(cfg).values()) * 4


@dataclasses.dataclass
class Measured:
    """One resize as the bench saw it: the runtime's record, the longest gap between two
    streamed tokens of one request during it, the same figure over a window of serving just
    before it (the machine's own noise), and the 1-minute load average when it began."""

    spares: int
    pool: int
    record: dict[str, Any]
    client_gap: float
    baseline_gap: float
    load_average: float


def run_config(
    args: argparse.Namespace, spares: int, pool: int, workdir: pathlib.Path
) -> list[Measured]:
    """One server with `spares` warm spare ranks and a rank pool of `pool`: `--repeats` times
    2→4 then 4→2 under load."""
    t0 = time.monotonic()
    srv = runtime_proc.start(
        serve_args(args.model, 2, step_mode=args.step_mode)
        + ["--no-eplb", "--warm-spare-ranks", str(spares), "--rank-pool", str(pool)],
        log=workdir / f"serve-spares{spares}-pool{pool}.log",
        env={"MOE_ADMIN_TOKEN": TOKEN},
    )
    print(
        f"server at DP=2 with {spares} warm spare ranks and a rank pool of {pool} ready in "
        f"{time.monotonic() - t0:.1f}s "
        f"({args.model}, {args.step_mode} step graph, {args.clients} streaming clients)",
        flush=True,
    )
    measured: list[Measured] = []
    sampler = timeline.Sampler(lambda: srv.url, interval_s=0.5)
    try:
        started = time.time()
        sampler.start()
        name = args.model.split("//")[1].split("?")[0]
        with StreamingLoad(srv.url, name, args.clients) as load:
            deadline = time.monotonic() + 120
            while load.ok < args.clients and time.monotonic() < deadline:
                time.sleep(0.1)
            for _ in range(args.repeats):
                for to in (4, 2):
                    waited = wait_spares(srv.url, spares)
                    pooled = wait_pool(srv.url, pool)
                    if pool:
                        print(f"  rank pool of {pool} ready after {pooled:.1f}s", flush=True)
                    if spares:
                        pre = wait_prestaged(srv.url) if to > 2 else 0.0
                        print(
                            f"  {spares} spares ready after {waited:.1f}s, their experts "
                            f"pre-staged {pre:.1f}s later",
                            flush=True,
                        )
                    load.measure_from()
                    time.sleep(args.settle)  # the baseline window (and the graph settles)
                    baseline = load.max_gap
                    load.measure_from()
                    load_average = os.getloadavg()[0]
                    record = resize(srv.url, to)
                    measured.append(
                        Measured(spares, pool, record, load.max_gap, baseline, load_average)
                    )
                    print(
                        f"  {record['from']}->{record['to']}: {record['duration_s']:.2f}s "
                        f"({record['expert_moves']} expert moves, "
                        f"{record.get('experts_prestaged', 0)} pre-staged on spares, "
                        f"{record.get('experts_retained', 0)} retained by survivors)"
                    )
            settle = time.monotonic() + 10  # a little serving at the final size
            while time.monotonic() < settle:
                time.sleep(0.1)
            ok, failed = load.ok, load.failed
        sampler.stop()
        picture = timeline.Timeline(
            title=f"bench/resize.py: {args.model}, 2→4→2 under {args.clients} streaming clients, "
            f"{spares} warm spares, a rank pool of {pool}",
            start=started,
            end=time.time(),
            tokens=list(load.token_times),
            samples=list(sampler.samples),
            resizes=status(srv.url)["history"],
            ok=ok,
            failed=failed,
            initial_size=2,
        )
    finally:
        sampler.stop()
        srv.stop()
    png = args.png
    if spares:
        png = png.with_stem(f"{png.stem}-spares{spares}")
    if pool:
        png = png.with_stem(f"{png.stem}-pool{pool}")
    print(f"  timeline: {timeline.render(picture, png)}")
    print(f"  requests: ok={ok} failed={failed}", flush=True)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://small?seed=0")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--step-mode", choices=("compiled", "remote"), default="compiled")
    parser.add_argument(
        "--warm-spare-ranks",
        type=int,
        nargs="+",
        default=[0, 2],
        help="one server per value, each measured the same way (default: 0 2)",
    )
    parser.add_argument(
        "--rank-pool",
        type=int,
        nargs="+",
        default=[2],
        help="one more server (no warm spares) per non-zero value, with a rank pool of that "
        "many pre-started weightless processes (default: 2)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="2→4→2 cycles per server")
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds of serving before each resize (its client gap is the baseline)",
    )
    parser.add_argument("--json", action="store_true", help="also print the raw records")
    parser.add_argument(
        "--png",
        type=pathlib.Path,
        default=ROOT / "out" / "resize-timeline.png",
        help="where to draw the timeline (default: out/resize-timeline.png; -sparesK added)",
    )
    args = parser.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-resize-"))
    per_expert = bytes_per_expert(args.model)
    configs = [(k, 0) for k in args.warm_spare_ranks]
    configs += [(0, n) for n in args.rank_pool if n > 0]
    measured = [m for k, n in configs for m in run_config(args, k, n, workdir)]
    colds = {
        size: cold_start(args.model, size, workdir, step_mode=args.step_mode) for size in (4, 2)
    }
    print(f"\ncold start (no spares): DP=4 {colds[4]:.1f}s, DP=2 {colds[2]:.1f}s")
    header = (
        f"{'spares':>6} {'pool':>4} {'resize':>7} {'total s':>8} {'ratio':>6} {'blackout ms':>12} "
        f"{'client gap ms':>14} {'baseline ms':>12} {'pause ms':>9} {'switch ms':>10} "
        f"{'expert MB':>10} {'bound MB':>9} {'load':>5}"
    )
    print(header)
    for spares, pool in configs:
        for frm, to in ((2, 4), (4, 2)):
            runs = [
                m
                for m in measured
                if (m.spares, m.pool) == (spares, pool) and m.record["from"] == frm
            ]
            if not runs:
                continue
            recs = [m.record for m in runs]
            total = statistics.median(r["duration_s"] for r in recs)
            switch = statistics.median(
                next(s["duration_s"] for s in r["stages"] if s["stage"] == "Switching")
                for r in recs
            )
            pause = statistics.median((r.get("switch_pause_s") or 0.0) for r in recs)
            print(
                f"{spares:>6} {pool:>4} {frm}->{to:<4} {total:8.2f} {total / colds[to]:6.3f} "
                f"{statistics.median(r['blackout_s'] for r in recs) * 1000:12.0f} "
                f"{statistics.median(m.client_gap for m in runs) * 1000:14.0f} "
                f"{statistics.median(m.baseline_gap for m in runs) * 1000:12.0f} "
                f"{pause * 1000:9.0f} {switch * 1000:10.0f} "
                f"{statistics.median(r['bytes_moved']['expert'] for r in recs) / 1e6:10.1f} "
                f"{statistics.median(r['expert_moves_lower_bound'] for r in recs) * per_expert / 1e6:9.1f} "
                f"{statistics.median(m.load_average for m in runs):5.1f}"
            )
    print(
        "(medians of --repeats; ratio = total / cold start at the target size; blackout: "
        "server-side, longest time no request got a token; client gap: longest gap between two "
        "streamed tokens of one request during the resize; baseline: the same over --settle s "
        "of serving just before it; pause: the switch's boundary call; switch: the stage, "
        "waiting for a step boundary included; load: 1-minute load average at its start)"
    )
    for m in measured:
        r = m.record
        stages = ", ".join(f"{s['stage']} {s['duration_s']:.2f}s" for s in r["stages"])
        print(f"  spares {m.spares} pool {m.pool} {r['from']}->{r['to']} stages: {stages}")
    if args.json:
        print(json.dumps([m.record for m in measured], indent=2))


if __name__ == "__main__":
    main()
