"""The rank worker: one DP rank's model shard, KV cache, groups and expert slots, as parts.

A `RankWorker` is a plain object. `moe_runtime.executor` runs it as a Ray actor (one per rank)
or in this process (`LocalExecutor`); nothing here knows about Ray. It holds:

- `loaded` (`loaded.LoadedModel`): the non-expert weights and a KV cache of its sequences;
- `groups` (`groups.RankGroups`): groups by (epoch, role): *step* (only the step's expert
  collectives), *transfer* (only background weight moves: never interleaved with a step's
  collectives on one gloo group) and, in the mesh expert layout, *mesh*;
- `slots` (`slots.ExpertSlots`): its expert slots (local slot ``s`` of rank ``r`` of ``N`` is
  global slot ``r * P/N + s`` of the `Placement`), the *staged* set (live at a step boundary,
  `StepInput.control["expert_epoch"]`, or at `activate`), the *previous* live state until
  `retire_previous` (for `revert` of a switch or an EPLB commit), pre-staged and retained
  experts;
- `stepper` (`stepper.Stepper`): the step; `hooks` (optional): tests' failures and hangs.

Control methods are called by name (`call`, what `Executor.collective_rpc(method)` reaches):
`CONTROLS` names the part that answers each; hooks may add more (`Hooks.controls`).

Every change of the live slots is all-or-nothing across ranks: `activate` runs on every rank
between two steps (`revert` where a peer failed); an EPLB commit in a step is voted on first.

Threads: `execute_step` comes from one thread (a second only after a failed step; a lock
keeps their steps apart), control methods (`join_group`, `transfer_non_expert`,
`stage_experts`) from another (Ray's "ctl" concurrency group), so they overlap; the parts
share only lock-protected state, and a control call never uses the active step group.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from moe_contract import names as contract_names
from moe_contract import protocol
from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, names, pipeline, tp_shard
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod
from moe_runtime.model import tensor_parallel as tp_mod
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import hooks as hooks_mod
from moe_runtime.rank import loaded as loaded_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import pipeline_group as pipeline_mod
from moe_runtime.rank import progress as progress_mod
from moe_runtime.rank import slots as slots_mod
from moe_runtime.rank import stepper as stepper_mod
from moe_runtime.rank import tensor_group as tensor_mod

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: `dtype="auto"` (a checkpoint's own dtype is resolved before it reaches the rank)
AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
DTYPES = ("auto", *_DTYPES)


class RankFailed(RuntimeError):
    """The rank cannot step again (`RankWorker.fail`): its pings raise this, so the heartbeat
    reports it lost and the recovery shrinks around it."""


#: The control methods an executor calls by name (`RankWorker.call`), by the part that answers.
WORKER_CONTROLS = (
    "info",
    "ping",
    "abort_live_groups",
    "set_label",
    "live_state",
    "load_weights",
    "load_progress",
    "drop_epoch",
    "kv_seq_ids",
    "expert_load_total",
    "shutdown",
)
GROUP_CONTROLS = ("free_port", "join_group", "abort_join", "groups", "transfer_non_expert")
PRESTAGED_CONTROLS = ("prestage_experts", "prestaged_keys", "drop_prestaged")
SLOT_CONTROLS = (
    "stage_experts",
    "retained_keys",
    "held_experts",
    "discard_staged",
    "activate",
    "revert",
    "retire_previous",
)
#: control method -> the attribute of the part that answers it ("": the worker itself)
CONTROLS: dict[str, str] = {
    **dict.fromkeys(WORKER_CONTROLS, ""),
    **dict.fromkeys(GROUP_CONTROLS, "groups"),
    **dict.fromkeys(SLOT_CONTROLS, "slots"),
    **dict.fromkeys(PRESTAGED_CONTROLS, "prestaged"),
}


class RankWorker:
    """One DP rank. See the module docstring; methods are called through an Executor."""

    def __init__(
        self,
        *,
        device: str | None = None,
        dtype: str = "float32",
        torch_threads: int | None = None,
        label: int | None = None,
        hooks: hooks_mod.Hooks | None = None,
        tensor: tensor_mod.Followers | None = None,
        tensor_size: int = 1,
        pipeline: pipeline_mod.Stages | None = None,
        pipeline_size: int = 1,
        pipeline_micro_batch_tokens: int | None = None,
        expert_layout: str = tp_mod.LEADER,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            dtype = AUTO_DTYPE["cuda" if self.device.startswith("cuda") else "cpu"]
        self.dtype = _DTYPES[dtype]
        #: Why this rank cannot step again (`fail`); None while it can.
        self.failed: str | None = None
        self.label = label  # the executor's label of this worker (logging only)
        self.hooks = hooks
        self.loaded = loaded_mod.LoadedModel()
        #: The TP leader's side of this DP rank's tensor-parallel group (T > 1), else None.
        self.tensor: tensor_mod.TensorLeader | None = None
        if tensor_size > 1:
            if tensor is None:
                raise ValueError(f"tensor_size {tensor_size} needs the rank's followers")
            self.tensor = tensor_mod.TensorLeader(
                tensor, size=tensor_size, device=self.device, expert_layout=expert_layout
            )
        elif expert_layout != tp_mod.LEADER:
            raise ValueError(f"the {expert_layout} expert layout needs a tensor-parallel size > 1")
        #: Pipeline stage 0's side of this DP rank's pipeline (P > 1), else None.
        self.pipeline: pipeline_mod.PipelineLeader | None = None
        if pipeline_size > 1:
            if pipeline is None:
                raise ValueError(f"pipeline_size {pipeline_size} needs the rank's stages")
            self.pipeline = pipeline_mod.PipelineLeader(
                pipeline,
                size=pipeline_size,
                device=self.device,
                micro_batch_tokens=pipeline_micro_batch_tokens,
            )
        #: What `load_weights` has read so far (`load_progress`).
        self.progress = progress_mod.LoadCounter()
        ctx = context_mod.RankContext(
            loaded=self.loaded,
            device=self.device,
            dtype=self.dtype,
            check=self._check,
            where=self.where,
            fail=self.fail,
        )
        #: The mesh layout's followers' parts of its slots (P > 1: `load_weights` restricts).
        self.parts: mesh_mod.MeshParts | None = None
        if self.tensor is not None and self.tensor.mesh:
            self.parts = mesh_mod.MeshParts(self.tensor.followers, size=self.tensor.size)
        joins = self.pipeline is not None or self.parts is not None
        self.groups = groups_mod.RankGroups(
            ctx,
            on_join=self._stages_join if joins else None,
            on_abort_join=self._abort_joins if joins else None,
            on_non_expert=groups_mod.non_expert_parts(self.pipeline, self.tensor),
        )
        self.slots = slots_mod.ExpertSlots(
            ctx, groups=self.groups, stages=self.pipeline, parts=self.parts
        )
        self.prestaged = self.slots.ahead
        self.stepper = stepper_mod.Stepper(
            ctx, slots=self.slots, tensor=self.tensor, pipeline=self.pipeline, parts=self.parts
        )

    # -- calls by name -------------------------------------------------------------------
    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run the control method `method` (`CONTROLS`, or one the hooks add)."""
        return self.control(method)(*args, **kwargs)

    def control(self, method: str) -> Callable[..., Any]:
        """The control method named `method`; AttributeError naming it when there is none."""
        part = CONTROLS.get(method)
        if part is not None:
            fn: Callable[..., Any] = getattr(getattr(self, part) if part else self, method)
            return fn
        extra = {} if self.hooks is None else self.hooks.controls()
        if method in extra:
            return extra[method]
        raise AttributeError(
            f"rank {self.label}: no control method {method!r} "
            f"(test controls come with rank hooks, `{hooks_mod.ENV}`)"
        )

    def _check(self, point: str) -> None:
        """A fault point: the hooks' check, when there are hooks."""
        if self.hooks is not None:
            self.hooks.check(point, self.where())

    # -- identity ------------------------------------------------------------------------
    def where(self) -> str:
        """This rank's log context."""
        slots = self.slots
        return f"rank={slots.rank} label={self.label} epoch={slots.epoch} step={self.stepper.steps}"

    def info(self) -> dict[str, Any]:
        """pid, host, ip, pod (env MOE_POD_NAME, else the host name), device, nccl (the NCCL
        version of a GPU rank), rank, epoch."""
        host = socket.gethostname()
        kv = self.loaded.kv
        return {
            "pid": os.getpid(),
            "host": host,
            "ip": groups_mod.host_ip(),
            "pod": os.environ.get(contract_names.POD_NAME_ENV) or host,
            "device": self.device,
            "nccl": group_mod.nccl_version() if self.device.startswith("cuda") else None,
            "rank": self.slots.rank,
            "num_ranks": self.slots.num_ranks,
            "epoch": self.slots.epoch,
            "num_experts": len(self.slots.experts),
            "num_seqs": 0 if kv is None else len(kv),
            "steps": self.stepper.steps,
            "tp_size": 1 if self.tensor is None else self.tensor.size,
            # every TP follower of the DP rank: stage 0's, then each later stage's
            "tp_pids": ([] if self.tensor is None else self.tensor.followers.pids())
            + ([] if self.pipeline is None else self.pipeline.stages.follower_pids()),
            "pp_size": 1 if self.pipeline is None else self.pipeline.size,
            "pp_pids": [] if self.pipeline is None else self.pipeline.stages.pids(),
            protocol.INFO_KEY: protocol.VERSION,
        }

    def set_label(self, label: int) -> None:
        """The executor's label of this worker (logs only; `rank` is set by activate)."""
        self.label = label

    def ping(self) -> dict[str, Any]:
        """Cheap liveness answer for health checks; RankFailed once the rank failed (`fail`)."""
        if self.failed is None and self.tensor is not None:
            try:
                self.tensor.check()
            except tensor_mod.FollowerLost as exc:
                self.fail(f"a tensor-parallel follower is lost: {exc}")
        if self.failed is None and self.pipeline is not None:
            try:
                self.pipeline.check()
            except pipeline_mod.StageLost as exc:
                self.fail(f"a pipeline stage is lost: {exc}")
        if self.failed is not None:
            raise RankFailed(f"rank failed: {self.failed} ({self.where()})")
        slots = self.slots
        return {
            "pid": os.getpid(),
            "rank": slots.rank,
            "epoch": slots.epoch,
            "steps": self.stepper.steps,
        }

    def load_progress(self) -> dict[str, Any]:
        """What the running (or last) `load_weights` has read: `moe_contract.loading.RankLoad`
        as JSON. Answers while a load runs on another thread (the executor's health lane)."""
        return self.progress.snapshot()

    def live_state(self) -> dict[str, Any]:
        """What serves now (debugging; the tests read it): epoch, origin, rank, placement
        (phy2log rows), whether a staged or a previous state is held, and the groups' epochs."""
        slots = self.slots
        placement = slots.placement
        return {
            "epoch": slots.epoch,
            "origin": slots.origin,
            "rank": slots.rank,
            "num_ranks": slots.num_ranks,
            "phy2log": None if placement is None else placement.phy2log.tolist(),
            "staged": slots.staged is not None,
            "prestaged": len(self.prestaged.experts),
            "retained": len(slots.retained),
            "previous": slots.previous is not None,
            "group_epochs": self.groups.epochs(),
        }

    # -- failures ------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """This rank cannot step again (out of device memory in a step): every group is aborted
        at once so no peer waits for it in a collective, and its pings raise `RankFailed` from
        now on (the heartbeat reports it lost; the recovery removes it and shrinks)."""
        if self.failed is None:
            self.failed = reason
        log.error("rank failed, leaving every group: %s (%s)", reason, self.where())
        self.groups.abort(None, f"rank failed: {reason}")
        if self.tensor is not None:
            self.tensor.abort(f"rank failed: {reason}")
        if self.pipeline is not None:
            self.pipeline.abort(f"rank failed: {reason}")

    def abort_live_groups(self, reason: str = "a peer was lost") -> list[tuple[int, str]]:
        """Abort the live epoch's groups now, without waiting on any peer: the executor lost a
        stepped peer, and a collective of this rank waiting for it must end (NCCL notices no
        dead peer by itself; gloo does, this is then a no-op in effect). Health lane."""
        epoch = self.slots.epoch
        if epoch is not None and self.pipeline is not None:
            self.pipeline.abort(reason)  # the stages' groups of every epoch go with it
        if epoch is not None and self.tensor is not None and self.parts is not None:
            self.tensor.abort(reason)  # the followers' mesh groups of every epoch too
        return [] if epoch is None else self.groups.abort(epoch, reason)

    def _stages_join(self, spec: Any, rank: int, role: str) -> None:
        """The leader joined `role`'s group of `spec.epoch`: its pipeline stages join theirs
        (`PipelineLeader.join`: the step group's for their experts, the transfer group's for
        their expert moves)."""
        if self.pipeline is not None and role != mesh_mod.ROLE:  # not the leader's own mesh
            self.pipeline.join(spec, rank, role)
        if self.parts is not None and role == groups_mod.STEP:
            own = functools.partial(
                self.groups.join_group, role=mesh_mod.ROLE, group_timeout=mesh_mod.GROUP_TIMEOUT_S
            )
            self.parts.join(spec, rank, own)  # the mesh group beside it

    def _abort_joins(self, epoch: int) -> None:
        """The joins of `epoch` are called off: so are the stages' and the followers'."""
        if self.pipeline is not None:
            self.pipeline.abort_join(epoch)
        if self.parts is not None:
            self.parts.abort_join(epoch)

    # -- weights -------------------------------------------------------------------------
    def load_weights(
        self,
        *,
        source: str,
        rank: int,
        num_ranks: int,
        placement: policy.Placement | None,
        placeholder: bool = False,
    ) -> int:
        """Load the non-expert weights and this rank's expert slots; returns bytes loaded.

        placeholder: zeros of the right shapes instead (a new rank that will receive its
        weights from peers); with placement None it holds no expert slot until one is staged.
        """
        self._check("load_weights")
        started = time.monotonic()
        src = source_mod.open_source(source)
        cfg = src.config
        shard: tp_shard.Shard | None = None
        stage: pipeline.PipelineStage | None = None
        staging = None
        if self.pipeline is not None:
            # Pipeline stage 0; stages 1..P-1 read their layers and experts meanwhile.
            stage = self.pipeline.plan(cfg)
            staging = self.pipeline.start_load(
                source, self.dtype, rank=rank, num_ranks=num_ranks, placement=placement,
                placeholder=placeholder,
            )  # fmt: skip
        if self.tensor is None:
            model = decoder.MoEModel(cfg, dtype=self.dtype, device=self.device, pp=stage)
        else:  # the followers read their shards meanwhile (`tensor_group`), and their parts
            if self.parts is not None:  # at P > 1 the followers hold stage 0's rows only
                self.parts.restrict = pipeline_mod.stage_view(stage)
            theirs = placement if self.parts is None else self.parts.rows(placement)
            model, shard, following = self.tensor.model(
                source,
                cfg,
                dtype=self.dtype,
                pp=stage,
                experts=(rank, num_ranks, theirs, placeholder),
            )
        # what this rank holds of each non-expert tensor (None: all of it)
        held = pipeline.parts(cfg, stage=stage, shard=shard)
        non_expert = list(held)
        mine: list[tuple[int, int, int]] = []  # (MoE layer, local slot, logical expert)
        if placement is not None:
            placement.validate(num_ranks)
            me, members = rank, num_ranks
            if self.parts is not None:  # it holds part 0 of its slots, its followers the rest
                mesh_mod.check_slots(placement.num_physical, num_ranks, self.parts.size)
                me, members = mesh_mod.member(rank, num_ranks, self.parts.size)
            for layer in range(cfg.num_moe_layers):
                for slot, logical in enumerate(placement.experts_on_rank(layer, me, members)):
                    mine.append((layer, slot, logical))
        size = torch.empty((), dtype=self.dtype).element_size()
        expert_shapes = [shape for _, shape in names.expert_tensors(cfg, 0, 0).values()]
        expert_bytes = progress_mod.nbytes(expert_shapes, size)
        self.progress.begin(
            rank=rank,
            tensors_total=len(non_expert) + len(mine) * len(expert_shapes),
            bytes_total=progress_mod.nbytes((model.tensor_shape(n) for n in non_expert), size)
            + len(mine) * expert_bytes,
        )
        state: dict[str, torch.Tensor] = {}
        for n in non_expert:
            self._check("load_tensor")
            shape = model.tensor_shape(n)
            part = held[n]
            if placeholder:
                state[n] = torch.zeros(shape, dtype=self.dtype)
            elif part is None:
                state[n] = src.tensor(n)
            else:
                state[n] = src.tensor_slice(n, dim=part.dim, start=part.start, stop=part.stop)
            self.progress.add(tensors=1, nbytes=progress_mod.nbytes([shape], size))
        model.load_non_expert(state)
        del state  # the model holds its own (cast) copies where the dtype differs
        experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        elsewhere = None  # the slots of other pipeline stages' MoE layers: one zero expert
        for layer, slot, logical in mine:
            self._check("load_tensor")
            if stage is not None and not layer < stage.moe_layers[1]:
                if elsewhere is None:
                    elsewhere = experts_mod.zero_expert(cfg, dtype=self.dtype, device=self.device)
                experts[(layer, slot)] = elsewhere
            elif placeholder:
                experts[(layer, slot)] = experts_mod.zero_expert(
                    cfg, dtype=self.dtype, device=self.device
                )
            else:
                experts[(layer, slot)] = experts_mod.load_expert(
                    src, layer, logical, dtype=self.dtype, device=self.device
                )
            self.progress.add(tensors=len(expert_shapes), nbytes=expert_bytes)
        if self.tensor is not None:
            self.tensor.finish_load(following)
        if self.pipeline is not None:
            self.pipeline.finish_load(staging)
        kv = kv_mod.KVCache(
            model.local_config, dtype=self.dtype, device=self.device, layers=model.layers
        )
        self.loaded.load(source, cfg, model, kv)
        self.slots.reset(
            placement=placement,
            rank=rank,
            num_ranks=num_ranks,
            experts=experts,
            placeholder=placeholder,
        )
        self.progress.finish()
        nbytes = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
        nbytes += sum(w.nbytes for w in {id(w): w for w in experts.values()}.values())
        log.info(
            "loaded %s%s: %d expert slots, %.1f MB in %.2fs (%s)",
            source,
            " (placeholder)" if placeholder else "",
            len(experts),
            nbytes / 1e6,
            time.monotonic() - started,
            self.where(),
        )
        return nbytes

    # -- the step ------------------------------------------------------------------------
    def execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """One step (`stepper.Stepper.execute`), never two at once on this rank."""
        return self.stepper.execute(step)

    # -- groups and slots together -------------------------------------------------------
    def drop_epoch(self, epoch: int) -> None:
        """Destroy the step and transfer groups of `epoch` (a resize undone before its switch);
        a previous state of that epoch goes with them. The active epoch cannot be dropped."""
        if epoch == self.slots.epoch:
            raise ValueError(f"epoch {epoch} is the active one ({self.where()})")
        self.slots.forget_previous(epoch)
        self.groups.drop_epoch(epoch)

    # -- queries for the engine / coordinator --------------------------------------------
    def kv_seq_ids(self) -> list[str]:
        kv = self.loaded.kv
        return [] if kv is None else kv.seq_ids()

    def expert_load_total(self) -> torch.Tensor | None:
        """Tokens routed per logical expert [L, E] by this rank since its weights loaded."""
        total = self.loaded.total_load
        return None if total is None else total.clone()

    def shutdown(self) -> None:
        """Destroy every group (in the background: the process is about to stop, nothing
        waits for its peers to close) and drop weights."""
        self.groups.close()
        self.slots.close()
        if self.tensor is not None:
            self.tensor.close()
        if self.pipeline is not None:
            self.pipeline.close()
        log.info("shut down (%s)", self.where())
