"""Weight transfer bandwidth (GB/s) of both paths of `moe_runtime.comm.transfer`: the host path
(gloo between two processes; from and to GPU memory through pinned host buffers when there is a
GPU) and the NCCL path (GPU memory to GPU memory).

NCCL path: with two GPUs, two processes, one per GPU, over a 2-member NCCL group; with one GPU
(NCCL refuses two members on one device), a device-to-device copy (the ceiling of any GPU-side
move) and a 1-member NCCL group's all_to_all (NCCL's copy to itself through its kernels and our
group); without a GPU it says it needs one.

    .venv/bin/python -m bench.transfer [--mb 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import transfer

GB = 1e9


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pair(spec: group_mod.GroupSpec, rank: int, nbytes: int, repeats: int, out: Any) -> None:
    """One member of a 2-member group: rank 0 sends `nbytes` to rank 1, `repeats` times."""
    torch.set_num_threads(2)
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if spec.backend == "nccl" else _device()
    if device.type == "cuda":
        torch.cuda.init()
    grp = group_mod.StatelessGroup(spec, rank, timeout=120)
    n = nbytes // 2
    data = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    seconds = []
    for i in range(repeats + 1):  # the first is a warm-up (connections, pinned pool)
        grp.barrier()
        _sync()
        started = time.perf_counter()
        with transfer.side_stream():
            if rank == 0:
                grp.isend(transfer.to_group(data, grp), 1, i).wait()
            else:
                buf = transfer.recv_buffer(n, torch.bfloat16, grp)
                grp.irecv(buf, 0, i).wait()
                landed = buf.to(device)
        _sync()
        if i:
            seconds.append(time.perf_counter() - started)
    if rank == 1:
        ok = bool(torch.equal(landed.float()[:1024].cpu(), data.float()[:1024].cpu()))
        out.put({"gbps": nbytes / GB / sorted(seconds)[len(seconds) // 2], "correct": ok})
    grp.destroy()


def two_processes(backend: str, nbytes: int, repeats: int) -> dict[str, Any]:
    """GB/s (median) of `nbytes` from one process to another over a `backend` group."""
    ctx = multiprocessing.get_context("spawn")
    out: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        spec = group_mod.GroupSpec.local(2, epoch=0, backend=backend, directory=tmp)  # type: ignore[arg-type]
        procs = [ctx.Process(target=_pair, args=(spec, r, nbytes, repeats, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        result: dict[str, Any] = out.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return result


def one_gpu(nbytes: int, repeats: int) -> dict[str, Any]:
    """The GPU-side figures one GPU allows (module docstring)."""
    device = torch.device("cuda", 0)
    n = nbytes // 2
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)

    def timed(fn: Any) -> float:
        fn()
        _sync()
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            _sync()
            runs.append(time.perf_counter() - started)
        return nbytes / GB / sorted(runs)[len(runs) // 2]

    copy = timed(lambda: dst.copy_(src))
    with tempfile.TemporaryDirectory() as tmp:
        grp = group_mod.StatelessGroup(
            group_mod.GroupSpec.local(1, epoch=0, backend="nccl", directory=tmp), 0, timeout=60
        )
        loop = timed(lambda: grp.all_to_all_single(dst, src))
        correct = bool(torch.equal(dst, src))
        grp.destroy()
    return {"d2d_copy_gbps": copy, "nccl_loopback_gbps": loop, "correct": correct}


def measure(mb: int, repeats: int) -> dict[str, Any]:
    """Every figure this machine allows (module docstring)."""
    nbytes = mb << 20
    out: dict[str, Any] = {"mb": mb, "host": two_processes("gloo", nbytes, repeats)}
    out["host"]["from"] = _device().type
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        out["nccl"] = two_processes("nccl", nbytes, repeats)
    elif gpus == 1:
        out["nccl_one_gpu"] = one_gpu(nbytes, repeats)
    else:
        out["nccl"] = {"skipped": "the NCCL path needs a GPU"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    figures = measure(args.mb, args.repeats)
    host = figures["host"]
    print(f"host path (gloo, {host['from']} memory): {host['gbps']:.2f} GB/s for {args.mb} MB")
    if "nccl" in figures and "gbps" in figures["nccl"]:
        print(f"NCCL path (GPU to GPU): {figures['nccl']['gbps']:.2f} GB/s")
    elif "nccl_one_gpu" in figures:
        one = figures["nccl_one_gpu"]
        print(
            f"one GPU: device copy {one['d2d_copy_gbps']:.1f} GB/s, NCCL loopback "
            f"{one['nccl_loopback_gbps']:.1f} GB/s (two GPUs measure the NCCL path itself)"
        )
    else:
        print("NCCL path: needs a GPU")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
