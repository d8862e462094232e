"""The abort stage of the GPU check (`bench/gpu_check.py`): a rank whose communicator fails
raises, does not die, and goes on in a new group. What a machine allows:

- two GPUs or more (`peer_kill("nccl")`): two processes, one per GPU, in a 2-member NCCL group
  loop all-reduces with a host read each; member 1 is SIGKILLed; member 0 (its kernel spins:
  NVLink notices no dead peer) is released by an abort from its own thread (what the
  executor's `abort_peers` makes a rank do), then `check()` raises; it builds a new group;
- one GPU (`watchdog`): NCCL refuses two members of one communicator on one device ("Duplicate
  GPU detected"), so no peer can be lost. What one GPU proves is the path a dead NVLink peer
  ends in when nobody aborts: a 1-member NCCL group's all-reduce queued behind a 6 s kernel on
  the stream outlives its 2 s op timeout; PyTorch's watchdog aborts the communicator and,
  with `semantics.Nccl.ENV`, the process lives and `check()` raises; a control child with
  PyTorch's default environment is ended by the same timeout (the figure says how);
- no GPU, the dry run (`peer_kill("emulated")`): the first case over gloo with NCCL's
  semantics emulated (`tests.support.nccl_emulation`), three processes.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import tempfile
import threading
import time
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import semantics

#: Cycles of `torch.cuda._sleep` per second (an H200's SM clock is ~1.98 GHz; the check only
#: needs "well past the op timeout").
CYCLES_PER_SECOND = 2_000_000_000


def _member(mode: str, spec: group_mod.GroupSpec, rank: int, out: Any, abort: Any, d: str) -> None:
    torch.set_num_threads(1)
    if mode == "emulated":
        from tests.support import nccl_emulation

        nccl_emulation.install()
    device = torch.device("cpu")
    if mode == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    grp = group_mod.StatelessGroup(spec, rank, timeout=120, op_timeout=120)
    out.put(("ready", os.getpid()))
    victim = spec.world_size - 1
    if rank != victim:

        def aborter() -> None:
            abort.wait()
            grp.abort(f"member {victim} was lost")

        threading.Thread(target=aborter, daemon=True).start()
    started = time.monotonic()
    error = None
    try:
        while True:
            t = torch.ones(1024, device=device)
            grp.all_reduce(t)
            float(t[0].item())  # the host read a step ends with
            grp.check()
    except semantics.GroupFailed as exc:
        error = str(exc)
    raised_after = time.monotonic() - started
    grp.destroy()
    survivors = group_mod.GroupSpec(
        group_mod.LOOPBACK,
        0,
        victim,
        1,
        spec.backend,
        store_path=os.path.join(d, "again"),
    )
    again = group_mod.StatelessGroup(survivors, rank, timeout=120)
    t = torch.full((4,), float(rank + 1), device=device)
    again.all_reduce(t)
    total = float(t[0].item())
    again.destroy()
    out.put({"raised": error, "loop_s": raised_after, "new_group_sum": total, "alive": True})


def peer_kill(mode: str) -> dict[str, Any]:
    """Kill the last member; the first one's report (see the module docstring)."""
    world = 2 if mode == "nccl" else 3
    ctx = multiprocessing.get_context("spawn")
    outs: list[Any] = [ctx.Queue() for _ in range(world)]
    abort = ctx.Event()
    with tempfile.TemporaryDirectory() as d:
        backend = "nccl" if mode == "nccl" else "gloo"
        spec = group_mod.GroupSpec.local(world, epoch=0, backend=backend, directory=d)  # type: ignore[arg-type]
        procs = [
            ctx.Process(target=_member, args=(mode, spec, r, outs[r], abort, d), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            pids = [outs[r].get(timeout=180)[1] for r in range(world)]
            time.sleep(0.2)  # the survivors are inside their loop of collectives
            os.kill(pids[-1], signal.SIGKILL)
            killed = time.monotonic()
            abort.set()
            report: dict[str, Any] = outs[0].get(timeout=180)
            report["kill_to_report_s"] = time.monotonic() - killed
        except queue.Empty:
            report = {"raised": None, "alive": False, "error": "the survivor did not report"}
        finally:
            for p in procs:
                p.kill()
    expected = float(sum(range(1, world)))
    report["mode"] = f"peer SIGKILLed ({mode})"
    report["ok"] = bool(
        report.get("raised") and report.get("alive") and report.get("new_group_sum") == expected
    )
    return report


def _watchdog_child(ours: bool, out: Any, d: str) -> None:
    torch.cuda.set_device(0)
    torch.cuda.init()
    if not ours:  # PyTorch's defaults, but a short dump wait so the control ends soon
        for key in semantics.Nccl.ENV:  # inherited from a parent that built NCCL groups
            os.environ.pop(key, None)
        os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "100"
        semantics.BY_BACKEND["nccl"] = semantics.Semantics()  # prepares nothing
    grp = group_mod.StatelessGroup(
        group_mod.GroupSpec.local(1, epoch=0, backend="nccl", directory=d),
        0,
        timeout=60,
        op_timeout=2.0,
    )
    t = torch.ones(16, device="cuda")
    grp.all_reduce(t)
    torch.cuda.synchronize()
    out.put("ready")
    torch.cuda._sleep(6 * CYCLES_PER_SECOND)  # the stream is busy past the op timeout
    started = time.monotonic()
    grp.all_reduce(t)
    error = None
    while time.monotonic() - started < 30:
        try:
            grp.check()
        except semantics.GroupFailed as exc:
            error = str(exc)
            break
        time.sleep(0.05)
    raised_after = time.monotonic() - started
    grp.destroy()
    torch.cuda.synchronize()
    again = group_mod.StatelessGroup(
        group_mod.GroupSpec.local(1, epoch=1, backend="nccl", directory=d), 0, timeout=60
    )
    u = torch.full((4,), 3.0, device="cuda")
    again.all_reduce(u)
    value = float(u[0].item())
    again.destroy()
    out.put({"raised": error, "raised_after_s": raised_after, "new_group_value": value})


def watchdog() -> dict[str, Any]:
    """The one-GPU case (module docstring): ours, then the control."""
    ctx = multiprocessing.get_context("spawn")
    report: dict[str, Any] = {"mode": "1 GPU: NCCL op timeout (watchdog), no peer to lose"}
    for name, ours in (("ours", True), ("pytorch_defaults", False)):
        out: Any = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            p = ctx.Process(target=_watchdog_child, args=(ours, out, d), daemon=True)
            p.start()
            got: dict[str, Any] = {}
            try:
                out.get(timeout=120)
                got = out.get(timeout=60)
            except queue.Empty:
                got = {"raised": None}
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
            got["exitcode"] = p.exitcode
            got["alive_until_done"] = "new_group_value" in got
            report[name] = got
    mine, control = report["ours"], report["pytorch_defaults"]
    report["ok"] = bool(
        mine.get("raised") and mine.get("new_group_value") == 3.0 and mine.get("exitcode") == 0
    )
    report["control_ended_by_pytorch"] = not control.get("alive_until_done")
    return report
