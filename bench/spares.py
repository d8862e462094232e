"""What a warm spare rank costs: CPU and memory of a spare beside the serving ranks.

Runs one `moe-runtime serve --warm-spare-ranks K` at DP=2 on synthetic://small, waits until
the spares are ready, then samples every rank process (the pids of /elastic_ep/status `ranks`
and `spares`, read from /proc) over `--seconds` idle and again under `--clients` streaming
clients: CPU as a share of one core, resident memory. A benchmark prints figures; it asserts
nothing.

Run: .venv/bin/python bench/spares.py [--warm-spare-ranks 1] [--seconds 20] [--step-mode remote]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import resize as resize_bench  # noqa: E402
from tests.support import runtime_proc  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def processes(url: str) -> dict[str, int]:
    """role/label -> pid of every rank process the runtime lists."""
    st: dict[str, Any] = resize_bench.status(url)
    out = {f"rank {r['rank']}": int(r["pid"]) for r in st["ranks"] if r.get("pid")}
    out.update({f"spare {s['rank']}": int(s["pid"]) for s in st["spares"] if s.get("pid")})
    return out


def sample(pids: dict[str, int], seconds: float) -> dict[str, tuple[float, float]]:
    """name -> (share of one core over `seconds`, RSS MiB at the end)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)  # the measurement window itself
    return {
        name: ((cpu_seconds(pid) - before[name]) / seconds, rss_mib(pid))
        for name, pid in pids.items()
    }


def show(title: str, figures: dict[str, tuple[float, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'process':<10} {'CPU (cores)':>12} {'RSS MiB':>9}")
    for name, (cpu, rss) in sorted(figures.items()):
        print(f"  {name:<10} {cpu:12.3f} {rss:9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://small?seed=0")
    parser.add_argument("--warm-spare-ranks", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--step-mode", choices=("compiled", "remote"), default="compiled")
    args = parser.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-spares-"))
    srv = runtime_proc.start(
        resize_bench.serve_args(args.model, 2, step_mode=args.step_mode)
        + ["--no-eplb", "--warm-spare-ranks", str(args.warm_spare_ranks)],
        log=workdir / "serve.log",
        env={"MOE_ADMIN_TOKEN": resize_bench.TOKEN},
    )
    try:
        took = resize_bench.wait_spares(srv.url, args.warm_spare_ranks)
        print(
            f"DP=2 with {args.warm_spare_ranks} warm spare(s) on {args.model} "
            f"({args.step_mode} step graph); spares ready {took:.1f}s after /health"
        )
        pids = processes(srv.url)
        show(f"idle, {args.seconds:.0f}s", sample(pids, args.seconds))
        name = args.model.split("//")[1].split("?")[0]
        with resize_bench.StreamingLoad(srv.url, name, args.clients) as load:
            deadline = time.monotonic() + 120
            while load.ok < 1 and time.monotonic() < deadline:
                time.sleep(0.2)  # poll for the first answer
            show(
                f"{args.clients} streaming clients, {args.seconds:.0f}s", sample(pids, args.seconds)
            )
        print(
            f"\nrequests: ok={load.ok} failed={load.failed}; load average {os.getloadavg()[0]:.1f}"
        )
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
