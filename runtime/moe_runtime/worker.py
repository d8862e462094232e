"""The rank worker: one DP rank's model shard, KV cache, groups and expert slots.

A `RankWorker` is a plain object. `moe_runtime.executor` runs it as a Ray actor (one per rank)
or in this process (`LocalExecutor`); nothing here knows about Ray.

What a rank holds
-----------------
- the non-expert weights (`MoEModel`) and a `KVCache` of its own sequences (attention is
  data-parallel: a sequence lives on one rank);
- its physical expert slots: `ExpertWeights` per (layer, local slot), where local slot ``s`` of
  rank ``r`` of ``N`` is global slot ``r * P/N + s`` of the current `Placement`;
- communication groups keyed by (epoch, role): the *step* group is used only by `execute_step`
  collectives (expert dispatch/combine); the *transfer* group only by background weight moves,
  so a transfer never interleaves with step collectives on one gloo group;
- an optional *staged* expert set (from `stage_experts`) that becomes live at a step boundary
  (`StepInput.control["expert_epoch"]`) or at `activate`;
- the *previous* live state (slots, placement, epoch, backend) that the last `activate` or
  commit replaced, kept until `retire_previous` so that a switch or an EPLB commit can be
  undone (`revert`); the older epochs' groups stay until then too.

Every change of the live slots is all-or-nothing across ranks: `activate` runs on every rank
between two steps and is undone with `revert` where a peer failed; an EPLB commit inside a step
is voted on first (a min all-reduce over the step group: every rank commits, or none does).

Threads: the executor calls `execute_step` from one thread (a second one only after a failed
step, and a lock keeps their steps apart) and control methods
(`join_group`, `transfer_non_expert`, `stage_experts`) from another (Ray's "ctl" concurrency
group), so they overlap. They share only `_lock`-protected dictionaries; a control call never
uses the active step group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moe_runtime import faults, rank_groups, retention, sampling
from moe_runtime import slots as slots_mod
from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import config as config_mod
from moe_runtime.model import decoder, names
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankWorker(faults.FaultHooks, rank_groups.RankGroups, slots_mod.ExpertSlots):
    """One DP rank. See the module docstring; methods are called through an Executor."""

    def __init__(
        self,
        *,
        device: str | None = None,
        dtype: str = "float32",
        torch_threads: int | None = None,
        label: int | None = None,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _DTYPES[dtype]
        self.label = label  # the executor's label at creation (logging only)
        self.rank: int | None = None
        self.num_ranks: int | None = None
        self.epoch: int | None = None
        self.source_name: str | None = None
        self.config: config_mod.ModelConfig | None = None
        self.model: decoder.MoEModel | None = None
        self.kv: kv_mod.KVCache | None = None
        self.placement: policy.Placement | None = None
        self.experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        self._backend: experts_mod.ExpertBackend | None = None
        self._groups: dict[tuple[int, str], group_mod.StatelessGroup] = {}
        self._aborted_joins: set[int] = set()
        self._group_ranks: dict[tuple[int, str], int] = {}
        self._staged: slots_mod.Staged | None = None
        self._previous: slots_mod.Live | None = None
        self._prestaged: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        self._retained = retention.Retained()
        self._origin: int | None = None
        self._fail: dict[str, str] = {}
        self._stall: dict[str, float] = {}
        self._lock = threading.RLock()
        #: One step at a time: after a step timed out in the driver, the rebuilt step path
        #: (plain calls, another thread) must not start the next step on this rank while the
        #: old one still runs in the compiled graph's loop: both would use the step group at
        #: once and gloo aborts the process on the mismatched messages.
        self._step_lock = threading.Lock()
        self.steps = 0
        self.total_load: torch.Tensor | None = None

    # -- identity ------------------------------------------------------------------------
    def _ctx(self) -> str:
        return f"rank={self.rank} label={self.label} epoch={self.epoch} step={self.steps}"

    def info(self) -> dict[str, Any]:
        """pid, host, ip, pod (env MOE_POD_NAME, else the host name), device, rank, epoch."""
        host = socket.gethostname()
        return {
            "pid": os.getpid(),
            "host": host,
            "ip": rank_groups.host_ip(),
            "pod": os.environ.get("MOE_POD_NAME") or host,
            "device": self.device,
            "rank": self.rank,
            "num_ranks": self.num_ranks,
            "epoch": self.epoch,
            "num_experts": len(self.experts),
            "num_seqs": 0 if self.kv is None else len(self.kv),
            "steps": self.steps,
        }

    def set_label(self, label: int) -> None:
        """The executor's label of this worker (logs only; `rank` is set by activate)."""
        self.label = label

    def ping(self) -> dict[str, Any]:
        """Cheap liveness answer for health checks."""
        return {"pid": os.getpid(), "rank": self.rank, "epoch": self.epoch, "steps": self.steps}

    def live_state(self) -> dict[str, Any]:
        """What serves now, for tests and debugging: epoch, origin, rank, placement (phy2log
        rows), whether a staged or a previous state is held, and the groups' epochs."""
        with self._lock:
            placement = self.placement
            return {
                "epoch": self.epoch,
                "origin": self._origin,
                "rank": self.rank,
                "num_ranks": self.num_ranks,
                "phy2log": None if placement is None else placement.phy2log.tolist(),
                "staged": self._staged is not None,
                "prestaged": len(self._prestaged),
                "retained": len(self._retained),
                "previous": self._previous is not None,
                "group_epochs": sorted({epoch for epoch, _ in self._groups}),
            }

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
        self._check_fail("load_weights")
        started = time.monotonic()
        src = source_mod.open_source(source)
        cfg = src.config
        model = decoder.MoEModel(cfg, dtype=self.dtype, device=self.device)
        non_expert = names.non_expert_tensor_names(cfg)
        if placeholder:
            state = {
                n: torch.zeros(names.tensor_shape(cfg, n), dtype=self.dtype) for n in non_expert
            }
        else:
            state = {n: src.tensor(n) for n in non_expert}
        model.load_non_expert(state)
        experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        if placement is not None:
            placement.validate(num_ranks)
            for layer in range(cfg.num_moe_layers):
                for slot, logical in enumerate(placement.experts_on_rank(layer, rank, num_ranks)):
                    if placeholder:
                        experts[(layer, slot)] = experts_mod.zero_expert(
                            cfg, dtype=self.dtype, device=self.device
                        )
                    else:
                        experts[(layer, slot)] = experts_mod.load_expert(
                            src, layer, logical, dtype=self.dtype, device=self.device
                        )
        with self._lock:
            self.source_name = source
            self.config = cfg
            self.model = model
            self.kv = kv_mod.KVCache(cfg, dtype=self.dtype, device=self.device)
            self.experts = experts
            self.placement = placement
            self.rank = rank
            self.num_ranks = num_ranks
            self.total_load = torch.zeros(cfg.num_moe_layers, cfg.num_experts, dtype=torch.int64)
            self._retained.reset(experts.values() if placeholder else ())
        nbytes = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
        nbytes += sum(w.nbytes for w in experts.values())
        log.info(
            "loaded %s%s: %d expert slots, %.1f MB in %.2fs (%s)",
            source,
            " (placeholder)" if placeholder else "",
            len(experts),
            nbytes / 1e6,
            time.monotonic() - started,
            self._ctx(),
        )
        return nbytes

    def _require_model(self) -> tuple[config_mod.ModelConfig, decoder.MoEModel]:
        if self.config is None or self.model is None:
            raise RuntimeError(f"no weights loaded yet ({self._ctx()})")
        return self.config, self.model

    # -- the step ------------------------------------------------------------------------
    def execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """One step (`_execute_step`), never two at once on this rank."""
        with self._step_lock:
            return self._execute_step(step)

    def _execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """Apply step.control, free KV, run this rank's batch, sample; never raises.

        An idle rank (no batch) still runs the forward pass with no tokens, so it joins the
        expert collectives; when no rank has a token, no rank runs it (and `expert_load` is
        None). When the control fails, or the batch is bad, the rank runs an empty
        batch instead (its peers must not hang in a collective) and reports the problem in
        StepOutput.error, as it does any exception. A failed forward pass leaves each sequence's
        KV cache as it was before the step, so the step can be retried as it was. An EPLB
        commit in the control is voted on by every rank (`StepOutput.committed` says whether
        this step committed it), whatever else fails on this rank.
        """
        rank = -1 if self.rank is None else self.rank
        out = step_mod.StepOutput(rank=rank, step_id=step.step_id)
        batch = step.batches.get(rank) or step_mod.RankBatch()
        errors: list[str] = []
        run_batch = True
        try:
            self._check_fail("execute_step")
        except Exception as exc:  # noqa: BLE001 - reported; the rank still joins the step
            log.exception(
                "step %d: failing as armed, running empty (%s)", step.step_id, self._ctx()
            )
            errors.append(f"{type(exc).__name__}: {exc}")
            run_batch = False
        if step.control:
            try:
                out.committed = self._apply_control(step.control)
            except Exception as exc:  # noqa: BLE001 - reported; the rank still joins the step
                log.exception(
                    "step %d: control failed, running empty (%s)", step.step_id, self._ctx()
                )
                errors.append(f"{type(exc).__name__}: {exc}")
                run_batch = False
        try:
            cfg, model = self._require_model()
            if self._backend is None or self.kv is None:
                raise RuntimeError(f"rank not activated ({self._ctx()})")
            kv = self.kv
            for seq_id in batch.free:
                kv.free(seq_id)
            seqs = list(batch.seqs) if run_batch else []
            bad = self._invalid(seqs, cfg, kv)
            if bad:
                errors.append(f"invalid sequences, step ran empty: {bad}")
                seqs = []
            # When no rank has a token, every rank reads that from the same StepInput and all
            # of them skip the forward pass and its expert collectives: none waits for a peer.
            if any(b.seqs for b in step.batches.values()):
                fwd = kv_mod.ForwardBatch(
                    seq_ids=[s.seq_id for s in seqs],
                    token_ids=[list(s.token_ids) for s in seqs],
                    start_pos=[s.start_pos for s in seqs],
                )
                load = torch.zeros(cfg.num_moe_layers, cfg.num_experts, dtype=torch.int64)
                try:
                    logits = model.forward(fwd, kv, self._backend, expert_load=load)
                except Exception:
                    # Back to the KV state before this step, so the same step can be sent again.
                    for s in seqs:
                        if s.start_pos == 0:
                            kv.free(s.seq_id)
                        else:
                            kv.reserve(s.seq_id, s.start_pos, 0)
                    raise
                logits = logits.to("cpu")
                for i, s in enumerate(seqs):
                    out.tokens[s.seq_id] = sampling.sample_token(
                        logits[i], s.sampling, s.num_generated
                    )
                out.expert_load = load
                if self.total_load is not None:
                    self.total_load += load
        except Exception as exc:  # noqa: BLE001 - reported to the engine, never kills the actor
            log.exception("step %d failed (%s)", step.step_id, self._ctx())
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.steps += 1
        if errors:
            out.error = "; ".join(errors)
        return out

    def _invalid(
        self,
        seqs: Sequence[step_mod.SeqWork],
        cfg: config_mod.ModelConfig,
        kv: kv_mod.KVCache,
    ) -> list[str]:
        bad: list[str] = []
        seen: set[str] = set()
        for s in seqs:
            problem = None
            if s.seq_id in seen:
                problem = "duplicate"
            elif not s.token_ids:
                problem = "no tokens"
            elif min(s.token_ids) < 0 or max(s.token_ids) >= cfg.vocab_size:
                problem = f"token ids outside [0, {cfg.vocab_size})"
            elif s.start_pos < 0 or s.start_pos > kv.num_tokens(s.seq_id):
                problem = f"start_pos {s.start_pos} but {kv.num_tokens(s.seq_id)} cached"
            elif s.start_pos + len(s.token_ids) > cfg.max_position_embeddings:
                problem = f"longer than {cfg.max_position_embeddings} positions"
            seen.add(s.seq_id)
            if problem is not None:
                bad.append(f"{s.seq_id}: {problem}")
        return bad

    def _apply_control(self, control: Mapping[str, Any]) -> int | None:
        """Apply a step's control; returns the staging id committed in this step, if any."""
        committed = None
        for key, value in control.items():
            if key == step_mod.CONTROL_EXPERT_EPOCH:
                if self._commit_vote(int(value)):
                    committed = int(value)
            else:
                log.debug("ignoring unknown control %r (%s)", key, self._ctx())
        return committed

    def _require_epoch(self) -> int:
        if self.epoch is None:
            raise RuntimeError(f"rank not activated ({self._ctx()})")
        return self.epoch

    # -- queries for the engine / coordinator --------------------------------------------
    def kv_seq_ids(self) -> list[str]:
        return [] if self.kv is None else self.kv.seq_ids()

    def expert_load_total(self) -> torch.Tensor | None:
        """Tokens routed per logical expert [L, E] by this rank since its weights loaded."""
        return None if self.total_load is None else self.total_load.clone()

    def shutdown(self) -> None:
        """Destroy every group (in the background: the process is about to stop, nothing
        waits for its peers to close) and drop weights."""
        with self._lock:
            keys = list(self._groups)
        for key in keys:
            self._drop_group(key, wait=False)
        with self._lock:
            self._backend = None
            self._staged = None
            self._previous = None
            self._retained.reset()
        log.info("shut down (%s)", self._ctx())
