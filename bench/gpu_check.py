"""The prepared GPU check (run it through `bench/gpu_check.sh`): every stage prints its figures,
and all of them go to $OUT/gpu_check.json when $OUT is set (format: docs/GPU.md, "The GPU check").

Stages (`--dry-run`: the same code on the CPU in float32 with small sizes, so it never rots;
`make test` runs it, tests/integration/test_gpu_check.py):

- env: torch, CUDA, the device, NCCL;
- forward: our forward on CUDA in bf16 against transformers' bf16 on a tiny random checkpoint
  of `--family` saved with save_pretrained (logits tolerance, teacher-forced token agreement:
  `bench.gpu_compare`);
- step: one rank's step (`LocalExecutor`, the real rank path) at batch 1/16/64: decode step
  time, tokens/s and the GPU-busy share of the step from torch.profiler (kernel time / wall);
- lifecycle: an NCCL group built, used and destroyed five times: device memory returns;
- abort: a rank whose communicator fails raises, does not die, goes on (`bench.gpu_abort`);
- serve: a one-rank `moe-runtime serve --device cuda --dtype bfloat16`, 16 concurrent
  requests, tokens/s (needs fastapi, uvicorn, pydantic: bench/gpu_wheels.sh brings them);
- transfer: GB/s of the host path and the NCCL path (`bench.transfer`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench import gpu_abort, gpu_compare
from bench import transfer as transfer_bench
from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod

STAGES = ("env", "forward", "step", "lifecycle", "abort", "serve", "transfer")


class Check:
    """The run's settings: real (CUDA, bf16) or dry (CPU, float32, small)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dry = args.dry_run
        self.family = args.family
        self.device = "cpu" if self.dry else "cuda"
        self.dtype_name = "float32" if self.dry else "bfloat16"
        self.dtype = getattr(torch, self.dtype_name)
        self.model = args.model or (
            "synthetic://tiny?seed=0" if self.dry else "synthetic://small?seed=0"
        )
        self.batches = (1, 16, 64)
        self.decode_steps = 4 if self.dry else 20
        self.prompt_len = 8 if self.dry else 64
        self.serve_tokens = 8 if self.dry else 128
        self.transfer_mb = 16 if self.dry else 1024

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()


# -- env --------------------------------------------------------------------------------
def env(c: Check) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "dry_run": c.dry,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            device=props.name,
            devices=torch.cuda.device_count(),
            memory_gb=props.total_memory / 1e9,
            capability=f"{props.major}.{props.minor}",
            bf16=torch.cuda.is_bf16_supported(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
        )
    try:
        out["transformers"] = importlib.import_module("transformers").__version__
    except ImportError:
        out["transformers"] = None
    out["ok"] = c.dry or bool(out["cuda"])
    return out


# -- forward ----------------------------------------------------------------------------
def forward(c: Check) -> dict[str, Any]:
    from tests.support import checkpoints

    build = getattr(checkpoints, c.family)
    prompts = [[(5 * i + 3 * j) % 300 + 1 for j in range(4 + 3 * i)] for i in range(8)]
    new = 16
    with tempfile.TemporaryDirectory() as d:
        hf = build()
        hf.save_pretrained(d)
        hf = hf.to(device=c.device, dtype=c.dtype)
        src = source_mod.open_source(d)
        model = decoder.MoEModel.from_source(src, dtype=c.dtype, device=c.device)
        experts = experts_mod.LocalExperts.from_source(src, dtype=c.dtype, device=c.device)
        with torch.no_grad():
            ref_logits, ref_tokens = _hf_greedy(hf, prompts, new, c.device)
            ours_logits, ours_tokens = _ours_teacher_forced(model, experts, prompts, ref_tokens)
    verdict = gpu_compare.Verdict(
        dtype=c.dtype_name,
        logits_rel_error=gpu_compare.relative_error(ours_logits, ref_logits),
        token_agreement=gpu_compare.agreement(ours_tokens, ref_tokens),
    )
    return {"family": c.family, "prompts": len(prompts), "new_tokens": new, **verdict.figures()}


def _hf_greedy(
    hf: Any, prompts: list[list[int]], new: int, device: str
) -> tuple[Any, list[list[int]]]:
    """Last-token logits of each prompt and `new` greedy tokens (full recompute, no cache)."""
    first, tokens = [], []
    for p in prompts:
        ids = list(p)
        out: list[int] = []
        for j in range(new):
            logits = hf(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
            if j == 0:
                first.append(logits.float())
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
        tokens.append(out)
    return torch.stack(first), tokens


def _ours_teacher_forced(
    model: decoder.MoEModel,
    experts: experts_mod.ExpertBackend,
    prompts: list[list[int]],
    ref: list[list[int]],
) -> tuple[Any, list[list[int]]]:
    """Our last-token logits of every prompt (one batch) and our argmax at every generated
    position with the reference's tokens fed back."""
    kv = kv_mod.KVCache(model.config, dtype=model.dtype, device=model.device)
    ids = [str(i) for i in range(len(prompts))]
    logits = model.forward(
        kv_mod.ForwardBatch(
            seq_ids=ids, token_ids=[list(p) for p in prompts], start_pos=[0] * len(prompts)
        ),
        kv,
        experts,
    )
    first = logits.float()
    ours = [[int(t)] for t in torch.argmax(logits, dim=-1).tolist()]
    for j in range(len(ref[0]) - 1):
        logits = model.forward(
            kv_mod.ForwardBatch(
                seq_ids=ids,
                token_ids=[[r[j]] for r in ref],
                start_pos=[len(p) + j for p in prompts],
            ),
            kv,
            experts,
        )
        for out, t in zip(ours, torch.argmax(logits, dim=-1).tolist(), strict=True):
            out.append(int(t))
    return first, ours


# -- step -------------------------------------------------------------------------------
def step(c: Check) -> dict[str, Any]:
    src = source_mod.open_source(c.model)
    cfg = src.config
    executor = local.LocalExecutor(1, device=c.device, dtype=c.dtype_name)
    try:
        placement = policy.identity(cfg.num_layers, cfg.num_experts, cfg.num_experts, 1)
        executor.start(c.model, placement=placement)
        out: dict[str, Any] = {"model": c.model, "dtype": c.dtype_name, "batches": {}}
        step_id = 0
        for batch in c.batches:
            seqs = [f"b{batch}-{i}" for i in range(batch)]
            prompts = {
                s: [(7 * i + j) % (cfg.vocab_size - 2) + 1 for j in range(c.prompt_len)]
                for i, s in enumerate(seqs)
            }
            step_id += 1
            last = _run(executor, step_id, {s: (prompts[s], 0) for s in seqs})
            times = []
            for k in range(c.decode_steps):
                step_id += 1
                started = time.perf_counter()
                last = _run(executor, step_id, {s: ([last[s]], c.prompt_len + k) for s in seqs})
                times.append(time.perf_counter() - started)
            busy, wall = _profiled(
                c, executor, seqs, last, step_id, start=c.prompt_len + c.decode_steps
            )
            step_id += 3
            _run(executor, step_id, {}, free=seqs)
            median = sorted(times)[len(times) // 2]
            out["batches"][str(batch)] = {
                "step_ms": median * 1e3,
                "tokens_per_s": batch / median,
                "gpu_busy_share": busy,
                "profiled_wall_ms": wall * 1e3,
            }
        if not c.dry:
            out["max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["ok"] = all(b["step_ms"] > 0 for b in out["batches"].values())
        return out
    finally:
        executor.shutdown()


def _run(
    executor: local.LocalExecutor,
    step_id: int,
    work: dict[str, tuple[list[int], int]],
    *,
    free: list[str] | None = None,
    generated: int = 0,
) -> dict[str, int]:
    batch = step_mod.RankBatch(
        seqs=[
            step_mod.SeqWork(
                seq_id=s,
                token_ids=t,
                start_pos=p,
                sampling=step_mod.SamplingParams(),
                num_generated=generated,
            )
            for s, (t, p) in work.items()
        ],
        free=list(free or []),
    )
    (out,) = executor.execute_step(step_mod.StepInput(step_id=step_id, batches={0: batch}))
    if out.error:
        raise RuntimeError(f"step {step_id}: {out.error}")
    return dict(out.tokens)


def _profiled(
    c: Check,
    executor: local.LocalExecutor,
    seqs: list[str],
    last: dict[str, int],
    step_id: int,
    *,
    start: int,
) -> tuple[float | None, float]:
    """(kernel time / wall time of 3 decode steps under torch.profiler, their wall seconds);
    the share is None on the CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not c.dry:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for k in range(3):
            last = _run(executor, step_id + k + 1, {s: ([last[s]], start + k) for s in seqs})
        c.sync()
        wall = time.perf_counter() - started
    if c.dry:
        return None, wall
    kernel_us = 0.0
    for event in prof.key_averages():
        kernel_us += float(
            getattr(event, "self_device_time_total", 0.0)
            or getattr(event, "self_cuda_time_total", 0.0)
        )
    return min(1.0, kernel_us / 1e6 / wall), wall


# -- lifecycle --------------------------------------------------------------------------
def lifecycle(c: Check) -> dict[str, Any]:
    backend = "gloo" if c.dry else "nccl"

    def used() -> float:
        if c.dry:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
        c.sync()
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 1e6

    base = used()
    after = []
    with tempfile.TemporaryDirectory() as d:
        for epoch in range(5):
            grp = group_mod.StatelessGroup(
                group_mod.GroupSpec.local(1, epoch=epoch, backend=backend, directory=d),
                0,
                timeout=60,  # type: ignore[arg-type]
            )
            t = torch.ones(1 << 20, device=c.device)
            grp.all_reduce(t)
            c.sync()
            grp.destroy()
            del t, grp
            after.append(used())
    growth = after[-1] - after[0]
    return {
        "backend": backend,
        "memory": "RSS" if c.dry else "device (total - free)",
        "baseline_mb": base,
        "after_each_mb": after,
        "first_cycle_mb": after[0] - base,
        "growth_cycles_2_to_5_mb": growth,
        "ok": abs(growth) < 64.0,
    }


# -- abort ------------------------------------------------------------------------------
def abort(c: Check) -> dict[str, Any]:
    if c.dry:
        return gpu_abort.peer_kill("emulated")
    if torch.cuda.device_count() >= 2:
        return gpu_abort.peer_kill("nccl")
    return gpu_abort.watchdog()


# -- serve ------------------------------------------------------------------------------
def serve(c: Check) -> dict[str, Any]:
    missing = [
        m
        for m in ("fastapi", "uvicorn", "pydantic", "httpx")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        return {"ok": False, "skipped": f"missing {missing}: run bench/gpu_wheels.sh, carry .whl"}
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        sys.executable,
        "-m",
        "moe_runtime.cli",
        "serve",
        "--executor",
        "local",
        "--model",
        c.model,
        "--data-parallel-size",
        "1",
        "--port",
        str(port),
        "--device",
        c.device,
        "--dtype",
        c.dtype_name,
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                return {
                    "ok": False,
                    "error": f"serve exited {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}",
                }
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return {"ok": False, "error": "serve did not become ready in 300 s"}
            time.sleep(0.2)
        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

        def one(i: int) -> int:
            body = {
                "model": name,
                "prompt": [(3 * i + j) % 200 + 1 for j in range(32)],
                "max_tokens": c.serve_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        one(0)  # warm-up
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            counts = list(pool.map(one, range(16)))
        wall = time.perf_counter() - started
        return {
            "streams": 16,
            "tokens": sum(counts),
            "wall_s": wall,
            "tokens_per_s": sum(counts) / wall,
            "ok": sum(counts) == 16 * c.serve_tokens,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- transfer ---------------------------------------------------------------------------
def transfer(c: Check) -> dict[str, Any]:
    out = transfer_bench.measure(c.transfer_mb, 2 if c.dry else 5)
    nccl = out.get("nccl_one_gpu") or out.get("nccl", {})
    out["ok"] = (
        out["host"]["gbps"] > 0 and out["host"]["correct"] and (c.dry or bool(nccl.get("correct")))
    )
    return out


# -- the run ----------------------------------------------------------------------------
def run_stage(name: str, fn: Callable[[Check], dict[str, Any]], c: Check) -> dict[str, Any]:
    started = time.monotonic()
    try:
        figures = fn(c)
    except Exception as exc:  # noqa: BLE001 - a stage that fails is reported, the others run
        figures = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc()[-3000:],
        }
    figures["seconds"] = time.monotonic() - started
    print(
        f"[{name}] {'ok' if figures.get('ok') else 'FAILED'} in {figures['seconds']:.1f}s: "
        f"{json.dumps({k: v for k, v in figures.items() if k != 'trace'}, default=str)}",
        flush=True,
    )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, float32, small sizes")
    parser.add_argument("--family", default="mixtral", help="tests.support.checkpoints builder")
    parser.add_argument("--model", default=None, help="the synthetic model of step and serve")
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages")
    args = parser.parse_args()
    c = Check(args)
    if not c.dry and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run", file=sys.stderr)
        return 2
    stages = {name: globals()[name] for name in STAGES if name in args.only.split(",")}
    report = {"dry_run": c.dry, "stages": {n: run_stage(n, fn, c) for n, fn in stages.items()}}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    failed = [n for n, s in report["stages"].items() if not s.get("ok")]
    print(
        f"gpu check: {len(stages) - len(failed)}/{len(stages)} stages ok"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
