"""What an idle serving rank costs with the compiled step graph: parked graph vs always live.

Ray 2.60's compiled-graph actors busy-wait for their next input, so a live step graph keeps
each serving rank near a core while no request is served; the step path parks a graph idle
for `MOE_STEP_GRAPH_PARK_SECONDS`: each actor's graph loop waits, idle, in a hold step that the
next step releases (`moe_runtime.executor.ray_step`, "Parking"; before, the graph was torn
down and compiled again at the next step). For each `--park-seconds` value (0: never park,
the behaviour before parking) one `moe-runtime serve` at DP=2 (compiled step mode; "remote": plain actor calls, no graph) is
started,
a few requests compile its graph, then, from /proc and from the clients:

1. idle: CPU of each rank process and of the server (the Ray driver) over `--seconds`,
   counted from the end of the last request (so the park delay's spinning is included), then
   over the next `--seconds` (steady idle);
2. the first request after an idle time (that one, then `--repeats` - 1 more after
   `--gap` s idle each; medians): time to first token and the mean inter-token gap (a parked
   graph: the hold released, ~3 ms; where that fails, plain actor calls while the graph
   compiles again in the background);
3. under `--clients` streaming clients for `--seconds`: CPU per rank, tokens/s, inter-token
   gap p50/p99 over every client, and how often the graph was parked/resumed (server log).

A benchmark prints figures; it asserts nothing.

Run: .venv/bin/python bench/idle_cpu.py [--model synthetic://tiny?seed=0] [--seconds 10]
     [--park-seconds 0,2,remote] [--clients 4] [--repeats 4] [--gap 4]
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench import resize as resize_bench  # noqa: E402
from bench import spares as spares_bench  # noqa: E402
from tests.support import runtime_proc  # noqa: E402


@dataclasses.dataclass
class Stream:
    """One streamed completion: seconds to its first token, the gaps between later ones."""

    ttft: float
    gaps: list[float]


def stream(client: httpx.Client, model: str, index: int, max_tokens: int) -> Stream:
    body = {
        "model": model,
        "prompt": [1 + (index * 13 + j) % 200 for j in range(16)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    times: list[float] = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    if not times:
        raise RuntimeError("no token streamed")
    return Stream(
        ttft=times[0] - started, gaps=[b - a for a, b in zip(times, times[1:], strict=False)]
    )


class Load:
    """`clients` threads streaming completions in a loop; keeps every stream's figures."""

    def __init__(self, url: str, model: str, clients: int, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.streams: list[Stream] = []
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self._stop.is_set():
                try:
                    done = stream(client, self.model, index, self.max_tokens)
                except (httpx.HTTPError, RuntimeError):
                    with self._lock:
                        self.failed += 1
                    continue
                with self._lock:
                    self.streams.append(done)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def log_count(log: pathlib.Path, text: str) -> int:
    return log.read_text(errors="replace").count(text)


def run(args: argparse.Namespace, park: str, workdir: pathlib.Path) -> dict[str, Any]:
    log = workdir / f"serve-park{park}.log"
    remote = park == "remote"
    srv = runtime_proc.start(
        resize_bench.serve_args(args.model, 2, step_mode="remote" if remote else "compiled")
        + ["--no-eplb"],
        log=log,
        env={
            "MOE_ADMIN_TOKEN": resize_bench.TOKEN,
            "MOE_STEP_GRAPH_PARK_SECONDS": "0" if remote else park,
        },
    )
    name = args.model.split("//")[1].split("?")[0]
    out: dict[str, Any] = {"park": park}
    try:
        pids = spares_bench.processes(srv.url)
        pids["server"] = srv.proc.pid
        with httpx.Client(base_url=srv.url, timeout=600) as client:
            # Warm: the graph compiles in the background after start; steps take it over.
            deadline = time.monotonic() + 120
            while not remote and log_count(log, "took over from plain calls") < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the step graph never took over")
                stream(client, name, 0, 8)
            stream(client, name, 0, args.max_tokens)
            out["idle"] = spares_bench.sample(pids, args.seconds)
            out["steady"] = spares_bench.sample(pids, args.seconds)
            firsts = [stream(client, name, 1, args.max_tokens)]
            for i in range(args.repeats - 1):
                time.sleep(args.gap)  # the idle time before the next first request
                firsts.append(stream(client, name, 2 + i, args.max_tokens))
            out["first_ttft"] = statistics.median(f.ttft for f in firsts)
            out["first_gap"] = statistics.median(statistics.mean(f.gaps) for f in firsts)
        parks = log_count(log, "parking the step graph")
        with Load(srv.url, name, args.clients, args.max_tokens) as load:
            while not load.streams and not load.failed:
                time.sleep(0.1)  # poll for the first finished stream
            with load._lock:
                load.streams.clear()
            started = time.monotonic()
            out["load"] = spares_bench.sample(pids, args.seconds)
            elapsed = time.monotonic() - started
            with load._lock:
                streams = list(load.streams)
        out["failed"] = load.failed
        gaps = [g for s in streams for g in s.gaps]
        out["tokens_per_s"] = sum(len(s.gaps) + 1 for s in streams) / elapsed
        out["gap_p50"], out["gap_p99"] = pct(gaps, 0.5), pct(gaps, 0.99)
        out["ttft_p50"] = pct([s.ttft for s in streams], 0.5)
        out["parks_idle"] = parks
        out["parks_load"] = log_count(log, "parking the step graph") - parks
    finally:
        srv.stop()
    return out


def show(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def cores(fig: dict[str, tuple[float, float]], who: str) -> str:
        ranks = [cpu for name, (cpu, _) in sorted(fig.items()) if name.startswith("rank")]
        if who == "ranks":
            return " ".join(f"{c:.3f}" for c in ranks)
        return f"{fig['server'][0]:.3f}"

    print(
        f"\nbench/idle_cpu.py: {args.model}, DP=2, compiled step graph, {args.seconds:.0f}s "
        f"windows, {args.clients} streaming clients of {args.max_tokens} tokens; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        f"{'park after':>10} | {'idle: cores/rank':>16} {'server':>6} {'steady':>11} | "
        f"{'1st after idle: TTFT':>20} {'gap':>6} | {'load: cores/rank':>16} {'tok/s':>6} "
        f"{'gap p50':>7} {'gap p99':>7} {'TTFT p50':>8} | parks idle/load"
    )
    print(header)
    for r in results:
        park = r["park"]
        label = park if park == "remote" else "never" if float(park) == 0 else f"{park} s"
        print(
            f"{label:>10} | {cores(r['idle'], 'ranks'):>16} {cores(r['idle'], 'server'):>6} "
            f"{cores(r['steady'], 'ranks'):>11} | "
            f"{r['first_ttft'] * 1e3:18.1f}ms {r['first_gap'] * 1e3:4.1f}ms | "
            f"{cores(r['load'], 'ranks'):>16} {r['tokens_per_s']:6.0f} "
            f"{r['gap_p50'] * 1e3:5.1f}ms {r['gap_p99'] * 1e3:5.1f}ms "
            f"{r['ttft_p50'] * 1e3:6.1f}ms | {r['parks_idle']}/{r['parks_load']}"
            + (f"  ({r['failed']} failed)" if r["failed"] else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://tiny?seed=0")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--park-seconds",
        default="0,2,remote",
        help="comma-separated MOE_STEP_GRAPH_PARK_SECONDS values, one server each (0: never; "
        "remote: --step-mode remote)",
    )
    parser.add_argument("--repeats", type=int, default=4, help="first requests after idle")
    parser.add_argument("--gap", type=float, default=4.0, help="idle seconds before each")
    args = parser.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-idle-cpu-"))
    results = [run(args, park.strip(), workdir) for park in args.park_seconds.split(",")]
    show(results, args)
    print(f"server logs: {workdir}")


if __name__ == "__main__":
    main()
