"""Live resize figures on synthetic://small: 2→4 and 4→2 under load, against cold starts.

Measured in one run, with one `moe-runtime serve` (Ray ranks, compiled step graph):
- total resize time and per-stage durations (from /elastic_ep/status history);
- blackout: the longest interval in which no request made progress (server-side, from the
  step loop) and, from the clients, the longest gap between two streamed tokens of one request;
- cold start: wall time from `moe-runtime serve` to /health 200 of a fresh server at the target
  size, and the ratio resize / cold start (aim: < 0.5);
- expert bytes moved against the lower bound for that placement change (every (layer, rank,
  expert) the new placement needs and the old one did not hold, times the bytes of one expert);
- balancedness before and after (over the EPLB window).

It also draws the run (e2e/timeline.py): tokens/s over time, per rank by their share of the
routed tokens, the stage bands of both resizes, the size, and `requests: ok=N failed=M`, into
`--png` (default out/resize-timeline.png).

Run: .venv/bin/python bench/resize.py   (a few minutes on 2 cores; prints figures, asserts none)
"""

from __future__ import annotations

import argparse
import json
import pathlib
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


def serve_args(model: str, size: int) -> list[str]:
    return ["--model", model, "--data-parallel-size", str(size), "--max-data-parallel-size", "4"]


def cold_start(model: str, size: int, workdir: pathlib.Path) -> float:
    started = time.monotonic()
    srv = runtime_proc.start(serve_args(model, size), log=workdir / f"cold-{size}.log")
    seconds = time.monotonic() - started
    srv.stop()
    return seconds


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
    from moe_runtime.model import source

    cfg = source.open_source(model).config
    return 3 * cfg.hidden_size * cfg.intermediate_size * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://small?seed=0")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--step-mode", choices=("compiled", "remote"), default="compiled")
    parser.add_argument("--json", action="store_true", help="also print the raw records")
    parser.add_argument(
        "--png",
        type=pathlib.Path,
        default=ROOT / "out" / "resize-timeline.png",
        help="where to draw the timeline (default: out/resize-timeline.png)",
    )
    args = parser.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-resize-"))
    per_expert = bytes_per_expert(args.model)
    t0 = time.monotonic()
    srv = runtime_proc.start(
        serve_args(args.model, 2) + ["--no-eplb", "--step-mode", args.step_mode],
        log=workdir / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN},
    )
    print(
        f"server at DP=2 ready in {time.monotonic() - t0:.1f}s ({args.model}, "
        f"{args.step_mode} step graph, {args.clients} streaming clients)"
    )
    results = []
    sampler = timeline.Sampler(lambda: srv.url, interval_s=0.5)
    try:
        started = time.time()
        sampler.start()
        with StreamingLoad(srv.url, args.model.split("//")[1].split("?")[0], args.clients) as load:
            deadline = time.monotonic() + 120
            while load.ok < args.clients and time.monotonic() < deadline:
                time.sleep(0.1)
            for to in (4, 2):
                load.measure_from()
                record = resize(srv.url, to)
                results.append((record, load.max_gap))
            settle = time.monotonic() + 10  # a little serving at the final size
            while time.monotonic() < settle:
                time.sleep(0.1)
            ok, failed = load.ok, load.failed
        sampler.stop()
        history = httpx.get(f"{srv.url}/elastic_ep/status", headers=AUTH, timeout=60).json()
        picture = timeline.Timeline(
            title=f"bench/resize.py: {args.model}, 2→4→2 under {args.clients} streaming clients",
            start=started,
            end=time.time(),
            tokens=list(load.token_times),
            samples=list(sampler.samples),
            resizes=history["history"],
            ok=ok,
            failed=failed,
            initial_size=2,
        )
    finally:
        sampler.stop()
        srv.stop()
    colds = {size: cold_start(args.model, size, workdir) for size in (4, 2)}
    print()
    header = (
        f"{'resize':>7} {'total s':>8} {'cold s':>7} {'ratio':>6} {'blackout ms':>12} "
        f"{'client gap ms':>14} {'switch ms':>10} {'expert MB':>10} {'bound MB':>9} {'bal before':>10} "
        f"{'bal after':>9}"
    )
    print(header)
    for record, gap in results:
        moved = record["bytes_moved"]["expert"]
        bound = record["expert_moves_lower_bound"] * per_expert
        cold = colds[record["to"]]
        bal = record["balancedness"]
        switch = next(s["duration_s"] for s in record["stages"] if s["stage"] == "Switching")
        print(
            f"{record['from']}->{record['to']:<4} {record['duration_s']:8.2f} {cold:7.1f} "
            f"{record['duration_s'] / cold:6.2f} {record['blackout_s'] * 1000:12.0f} "
            f"{gap * 1000:14.0f} {switch * 1000:10.0f} {moved / 1e6:10.1f} {bound / 1e6:9.1f} "
            f"{bal['before']:10.3f} {bal['after']:9.3f}"
        )
    for record, _ in results:
        stages = ", ".join(f"{s['stage']} {s['duration_s']:.2f}s" for s in record["stages"])
        print(f"  {record['from']}->{record['to']} stages: {stages}")
        print(f"  non-expert bytes moved: {record['bytes_moved']['non_expert'] / 1e6:.1f} MB")
    print(f"timeline: {timeline.render(picture, args.png)}")
    print(f"requests: ok={ok} failed={failed}")
    if args.json:
        print(json.dumps([r for r, _ in results], indent=2))


if __name__ == "__main__":
    main()
