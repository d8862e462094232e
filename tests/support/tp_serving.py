"""Shared by the integration tests of `serve` with two devices per DP rank and warm spares or a
rank pool (tests/integration/test_tp_spares.py at TP 2, test_tp_rank_pool.py at TP 2 and at
PP 2): a tiny random Mixtral served at DP 2 x (TP 2 or PP 2) joining the tests' Ray instance,
transformers' reference answers, checked mixed load (greedy and seeded, streamed or not) and
the status checks."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from e2e import load as load_mod
from moe_runtime import step
from moe_runtime.model import pipeline
from moe_runtime.model import source as source_mod
from moe_runtime.rank import tensor_group
from tests.support import hf_families, runtime_proc

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAMILY = "mixtral"
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
SEED = 1
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Two devices per DP rank: the `serve` flags, and the status field that lists the DP
    rank's other process (`tp_pids`: its TP follower, `pp_pids`: its pipeline stage 1)."""

    flags: tuple[str, ...]
    pids: str


TP2 = Mesh(("--tensor-parallel-size", "2"), "tp_pids")
PP2 = Mesh(("--pipeline-parallel-size", "2"), "pp_pids")


@dataclasses.dataclass
class Served:
    server: runtime_proc.RuntimeProcess
    reference: Reference
    mesh: Mesh = TP2
    #: the served checkpoint
    path: pathlib.Path | None = None

    def rank_non_expert_bytes(self) -> int:
        """Bytes of one DP rank's non-expert tensors over all its processes (every TP
        shard of every pipeline stage, float32): what a new DP rank receives from its peers
        with `--weight-source peer`."""
        assert self.path is not None
        cfg = source_mod.open_source(str(self.path)).config
        flags = dict(zip(self.mesh.flags[::2], self.mesh.flags[1::2], strict=True))
        tp = int(flags.get("--tensor-parallel-size", 1))
        pp = int(flags.get("--pipeline-parallel-size", 1))
        total = 0
        for s in range(pp):
            stage = pipeline.plan(cfg, stage=s, size=pp)
            for t in range(tp):
                shard = tensor_group.plan(cfg, rank=t, size=tp) if tp > 1 else None
                held = pipeline.parts(cfg, stage=stage, shard=shard)
                total += sum(math.prod(pipeline.shape(cfg, n, part)) for n, part in held.items())
        return 4 * total


def reference(model: transformers.PreTrainedModel) -> Reference:
    """transformers' answer to every (prompt, length, seed) case the load sends."""
    params = step.SamplingParams(temperature=load_mod.TEMPERATURE, top_p=load_mod.TOP_P, seed=SEED)
    out: Reference = {}
    for p in PROMPTS:
        prompt = load_mod.PROMPTS[p]
        greedy = hf_families.greedy(model, prompt, max(LENGTHS))
        seeded = hf_families.sampled(model, prompt, max(LENGTHS), params)
        for n in LENGTHS:
            out[(p, n, None)] = greedy[:n]
            out[(p, n, SEED)] = seeded[:n]
    return out


def serve(root: pathlib.Path, *extra: str, mesh: Mesh = TP2) -> Iterator[Served]:
    """`serve --data-parallel-size 2 MESH --max-data-parallel-size 3 EXTRA` on a fresh tiny
    Mixtral under `root`, on the tests' Ray instance (a generator for a fixture: stopped after
    its yield)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    torch.set_num_threads(1)
    model = hf_families.build(FAMILY)
    path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", "2", *mesh.flags]
    args += ["--dtype", "float32", "--max-data-parallel-size", "3", *extra]
    args += ["--served-model-name", FAMILY]
    server, ref = runtime_proc.start_while(
        args,
        lambda: reference(model),
        log=root / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": address},
    )
    try:
        yield Served(server, ref, mesh, path)
    finally:
        server.stop()


def status(s: Served) -> dict[str, Any]:
    return runtime_proc.status(s.server.url, headers=AUTH)


def serving(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The active DP ranks of a status."""
    return [r for r in st["ranks"] if r["rank"] is not None and r["active"]]


def load(s: Served) -> load_mod.Load:
    """4 clients of checked greedy and seeded completions, streamed or not."""
    return load_mod.Load(
        lambda: s.server.url,
        model_name=FAMILY,
        reference=s.reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(SEED,),
        prompts=PROMPTS,
    )


def wait_traffic(traffic: load_mod.Load, count: int) -> None:
    """Until `count` answers were checked."""
    deadline = time.monotonic() + 60
    while traffic.ok < count:
        assert time.monotonic() < deadline, traffic.summary()
        time.sleep(0.05)


def assert_whole(ranks: list[dict[str, Any]], *, nice: int | None = None, mesh: Mesh = TP2) -> None:
    """Each DP rank a leader and one live process of its own listed in `mesh.pids` (a TP
    follower or a pipeline stage actor; `nice`: both at that CPU niceness)."""
    for r in ranks:
        other = r[mesh.pids]
        assert len(other) == 1 and other[0] != r["pid"], r
        assert all(r[f] == [] for f in (TP2.pids, PP2.pids) if f != mesh.pids), r
        os.kill(other[0], 0)  # alive
        if nice is not None:
            # a follower (or a stage) takes its leader's priority on its own lane (before its
            # next step)
            pids = [r["pid"], other[0]]
            deadline = time.monotonic() + 10
            while [os.getpriority(os.PRIO_PROCESS, p) for p in pids] != [nice] * 2:
                assert time.monotonic() < deadline, (r, nice)
                time.sleep(0.05)
