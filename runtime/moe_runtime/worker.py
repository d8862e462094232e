"""The rank worker: one DP rank's model shard, KV cache, groups and expert slots.

A `RankWorker` is a plain object. `moe_runtime.executor` runs it as a Ray actor (one per rank)
or in this process (`LocalExecutor`); nothing here knows about Ray.

What a rank holds
-----------------
- the non-expert weights (`MixtralModel`) and a `KVCache` of its own sequences (attention is
  data-parallel: a sequence lives on one rank);
- its physical expert slots: `ExpertWeights` per (layer, local slot), where local slot ``s`` of
  rank ``r`` of ``N`` is global slot ``r * P/N + s`` of the current `Placement`;
- communication groups keyed by (epoch, role): the *step* group is used only by `execute_step`
  collectives (expert dispatch/combine); the *transfer* group only by background weight moves,
  so a transfer never interleaves with step collectives on one gloo group;
- an optional *staged* expert set (from `stage_experts`) that becomes live at a step boundary
  (`StepInput.control["expert_epoch"]`) or at `activate`.

Threads: the executor calls `execute_step` from one thread and control methods
(`join_group`, `transfer_non_expert`, `stage_experts`) from another (Ray's "ctl" concurrency
group), so they overlap. They share only `_lock`-protected dictionaries; a control call never
uses the active step group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moe_runtime import step as step_mod
from moe_runtime.comm import ep as ep_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.comm import transfer as transfer_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import config as config_mod
from moe_runtime.model import mixtral, names
from moe_runtime.model import source as source_mod

log = logging.getLogger(__name__)

STEP_ROLE = "step"
TRANSFER_ROLE = "transfer"
ROLES = (STEP_ROLE, TRANSFER_ROLE)

#: StepInput.control key: commit the experts staged under this stage id at this step.
CONTROL_EXPERT_EPOCH = "expert_epoch"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InjectedFailure(RuntimeError):
    """Raised by an operation armed with `RankWorker.fail_next` (tests of Failed resizes)."""


@dataclasses.dataclass
class _Staged:
    """Expert slots prepared for a future placement; the live slots keep serving meanwhile."""

    stage: int
    placement: policy.Placement
    rank: int
    num_ranks: int
    experts: dict[tuple[int, int], mixtral.ExpertWeights]


def sample_token(logits: torch.Tensor, params: step_mod.SamplingParams, num_generated: int) -> int:
    """Next token from logits [V] (float32).

    temperature == 0: argmax. Otherwise softmax(logits / temperature), restricted to the
    smallest set of most likely tokens whose mass reaches top_p, sampled by inverse CDF with a
    uniform draw from a generator seeded by (seed, num_generated) alone, so any rank draws the
    same token for the same sequence position. seed None: a fresh random draw.
    """
    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cdf = torch.cumsum(sorted_probs, dim=0)
    if params.top_p < 1.0:
        keep = int(torch.searchsorted(cdf, torch.tensor([params.top_p], dtype=cdf.dtype)).item())
        keep = min(max(keep + 1, 1), cdf.numel())
    else:
        keep = cdf.numel()
    total = float(cdf[keep - 1].item())
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling_seed(params.seed, num_generated))
    u = float(torch.rand((), generator=generator, dtype=torch.float64).item()) * total
    index = int(torch.searchsorted(cdf[:keep], torch.tensor([u], dtype=cdf.dtype)).item())
    return int(order[min(index, keep - 1)].item())


def sampling_seed(seed: int, num_generated: int) -> int:
    """A 63-bit generator seed from (request seed, tokens generated so far), process-stable."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def senders_for(src_ranks: Sequence[int], dst_ranks: Sequence[int]) -> dict[int, int]:
    """{receiver: sender}: receivers split over senders in order, the first
    ``len(dst) % len(src)`` senders taking one extra (as vLLM's elastic EP does)."""
    if not src_ranks:
        raise ValueError("non-expert transfer needs at least one sender")
    base, extra = divmod(len(dst_ranks), len(src_ranks))
    out: dict[int, int] = {}
    it = iter(dst_ranks)
    for i, src in enumerate(src_ranks):
        for _ in range(base + (1 if i < extra else 0)):
            out[next(it)] = src
    return out


class RankWorker:
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
        self.model: mixtral.MixtralModel | None = None
        self.kv: mixtral.KVCache | None = None
        self.placement: policy.Placement | None = None
        self.experts: dict[tuple[int, int], mixtral.ExpertWeights] = {}
        self._backend: mixtral.ExpertBackend | None = None
        self._groups: dict[tuple[int, str], group_mod.StatelessGroup] = {}
        self._group_ranks: dict[tuple[int, str], int] = {}
        self._staged: _Staged | None = None
        self._fail: dict[str, str] = {}
        self._lock = threading.RLock()
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
            "ip": _host_ip(),
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

    def free_port(self, host: str | None = None) -> tuple[str, int]:
        """(address, port) of a port free on this host now, for a TCPStore this rank hosts."""
        address = host or _host_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
            return address, int(sock.getsockname()[1])

    # -- test hook -----------------------------------------------------------------------
    def fail_next(self, operation: str, message: str = "injected failure") -> None:
        """Make the next call of `operation` (a method name) fail with InjectedFailure.

        Collective operations fail after their collective part, so peers never hang.
        """
        with self._lock:
            self._fail[operation] = message

    def _check_fail(self, operation: str) -> None:
        with self._lock:
            message = self._fail.pop(operation, None)
        if message is not None:
            raise InjectedFailure(f"{operation}: {message} ({self._ctx()})")

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
        model = mixtral.MixtralModel(cfg, dtype=self.dtype, device=self.device)
        non_expert = names.non_expert_tensor_names(cfg)
        if placeholder:
            state = {
                n: torch.zeros(names.tensor_shape(cfg, n), dtype=self.dtype) for n in non_expert
            }
        else:
            state = {n: src.tensor(n) for n in non_expert}
        model.load_non_expert(state)
        experts: dict[tuple[int, int], mixtral.ExpertWeights] = {}
        if placement is not None:
            placement.validate(num_ranks)
            for layer in range(cfg.num_layers):
                for slot, logical in enumerate(placement.experts_on_rank(layer, rank, num_ranks)):
                    if placeholder:
                        experts[(layer, slot)] = self._zero_expert(cfg)
                    else:
                        experts[(layer, slot)] = mixtral.load_expert(
                            src, layer, logical, dtype=self.dtype, device=self.device
                        )
        with self._lock:
            self.source_name = source
            self.config = cfg
            self.model = model
            self.kv = mixtral.KVCache(cfg, dtype=self.dtype, device=self.device)
            self.experts = experts
            self.placement = placement
            self.rank = rank
            self.num_ranks = num_ranks
            self.total_load = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
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

    def _zero_expert(
        self, cfg: config_mod.ModelConfig, *, device: str | torch.device | None = None
    ) -> mixtral.ExpertWeights:
        i, h = cfg.intermediate_size, cfg.hidden_size
        where = self.device if device is None else device
        return mixtral.ExpertWeights(
            w1=torch.zeros(i, h, dtype=self.dtype, device=where),
            w2=torch.zeros(h, i, dtype=self.dtype, device=where),
            w3=torch.zeros(i, h, dtype=self.dtype, device=where),
        )

    def _require_model(self) -> tuple[config_mod.ModelConfig, mixtral.MixtralModel]:
        if self.config is None or self.model is None:
            raise RuntimeError(f"no weights loaded yet ({self._ctx()})")
        return self.config, self.model

    # -- groups --------------------------------------------------------------------------
    def join_group(
        self,
        spec: group_mod.GroupSpec,
        rank: int,
        *,
        role: str = STEP_ROLE,
        group_timeout: float | None = None,
    ) -> None:
        """Build the `role` group of `spec.epoch` as member `rank` (blocks until all joined).

        Runs in the background while this rank serves steps on its active group. group_timeout:
        seconds the rendezvous and each later collective of the group may take (None: the
        group's default), so a member that never comes does not hold this rank for long.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        started = time.monotonic()
        if group_timeout is None:
            built = group_mod.StatelessGroup(spec, rank)
        else:
            built = group_mod.StatelessGroup(spec, rank, timeout=group_timeout)
        key = (spec.epoch, role)
        with self._lock:
            old = self._groups.pop(key, None)
            self._groups[key] = built
            self._group_ranks[key] = rank
        if old is not None:
            old.destroy()
        log.info(
            "joined %s group of epoch %d as %d/%d in %.2fs (%s)",
            role,
            spec.epoch,
            rank,
            spec.world_size,
            time.monotonic() - started,
            self._ctx(),
        )
        try:
            self._check_fail("join_group")
        except InjectedFailure:
            self._drop_group(key)
            raise

    def _group(self, epoch: int, role: str) -> tuple[group_mod.StatelessGroup, int]:
        with self._lock:
            key = (epoch, role)
            if key not in self._groups:
                raise RuntimeError(f"no {role} group for epoch {epoch} ({self._ctx()})")
            return self._groups[key], self._group_ranks[key]

    def _drop_group(self, key: tuple[int, str]) -> None:
        with self._lock:
            dropped = self._groups.pop(key, None)
            self._group_ranks.pop(key, None)
        if dropped is not None:
            dropped.destroy()

    def groups(self) -> list[tuple[int, str]]:
        """The (epoch, role) of every group this rank holds."""
        with self._lock:
            return sorted(self._groups)

    # -- non-expert transfer -------------------------------------------------------------
    def transfer_non_expert(
        self, epoch: int, *, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> int:
        """Copy the non-expert weights from src_ranks to dst_ranks over epoch's transfer group.

        Peer to peer: receivers are spread over senders (`senders_for`: the first
        ``len(dst) % len(src)`` senders get one extra), each sender sends its whole state as one
        flat buffer to each of its receivers at once. Ranks are ranks of that group; members
        that neither send nor receive return at once. Returns the bytes this rank received.
        """
        cfg, model = self._require_model()
        grp, me = self._group(epoch, TRANSFER_ROLE)
        sender_of = senders_for(list(src_ranks), list(dst_ranks))
        tensor_names = names.non_expert_tensor_names(cfg)
        shapes = [names.tensor_shape(cfg, n) for n in tensor_names]
        numel = sum(_numel(s) for s in shapes)
        started = time.monotonic()
        tag = 1_000_000 + epoch  # apart from expert-move tags (move indices)
        mine = sorted(dst for dst, src in sender_of.items() if src == me)
        works = []
        sent = 0
        if mine:
            state = model.non_expert_state()
            flat = _flatten([state[n] for n in tensor_names]).to(grp.device)
            for dst in mine:
                works.append(grp.isend(flat, dst, tag))
                sent += flat.numel() * flat.element_size()
        recv: torch.Tensor | None = None
        if me in sender_of:
            recv = torch.empty(numel, dtype=self.dtype, device=grp.device)
            works.append(grp.irecv(recv, sender_of[me], tag))
        for work in works:
            work.wait()
        received = 0
        if recv is not None:
            tensors: dict[str, torch.Tensor] = {}
            offset = 0
            for name, shape in zip(tensor_names, shapes, strict=True):
                n = _numel(shape)
                tensors[name] = recv[offset : offset + n].view(shape)
                offset += n
            model.load_non_expert(tensors)
            received = recv.numel() * recv.element_size()
        log.info(
            "non-expert transfer epoch %d: sent %d B to %s, received %d B in %.2fs (%s)",
            epoch,
            sent,
            mine,
            received,
            time.monotonic() - started,
            self._ctx(),
        )
        self._check_fail("transfer_non_expert")
        return received

    # -- expert staging ------------------------------------------------------------------
    def stage_experts(
        self,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        new_placement: policy.Placement,
        *,
        new_rank: int | None,
        new_num_ranks: int,
        stage: int | None = None,
        from_source: bool = False,
    ) -> int:
        """Prepare this rank's slots of `new_placement` in a staging area; returns bytes received.

        from_source: experts that neither this rank holds nor a move brings are read from the
        model source (recovery after a rank died with the only copy); otherwise that is an error.

        new_rank None: this rank leaves (scale-down); it only sends and stages nothing.

        Every member of epoch's transfer group calls it with the same `moves` (a move's
        src_rank / dst_rank are ranks of that group, which are the old and the new ranks since
        survivors keep their rank); moves run peer to peer (`comm.transfer.execute_moves`).
        Slots whose expert this rank already holds are filled locally (shared tensors, no
        copy). The live slots keep serving until the stage is committed: by
        `StepInput.control["expert_epoch"] == stage` (same ranks) or by `activate` (new group).
        stage defaults to epoch.
        """
        cfg, _ = self._require_model()
        grp, _me = self._group(epoch, TRANSFER_ROLE)
        new_placement.validate(new_num_ranks)
        started = time.monotonic()
        held = self._held_experts()
        received: dict[tuple[int, int], mixtral.ExpertWeights] = {}

        def read_expert(layer: int, logical: int) -> mixtral.ExpertWeights:
            weights = held.get((layer, logical))
            if weights is None:
                raise RuntimeError(
                    f"a move names this rank as source of expert {logical} of layer {layer}, "
                    f"which it does not hold ({self._ctx()})"
                )
            return weights

        def write_expert(move: moves_mod.ExpertMove, weights: mixtral.ExpertWeights) -> None:
            received[(move.layer, move.logical)] = weights.to(dtype=self.dtype, device=self.device)

        stats = transfer_mod.execute_moves(
            grp,
            list(moves),
            read_expert=read_expert,
            write_expert=write_expert,
            like=self._zero_expert(cfg, device=grp.device),
        )
        self._check_fail("stage_experts")
        if new_rank is None:
            log.info(
                "sent %d experts for a placement without this rank in %.2fs (%s)",
                stats.sent,
                time.monotonic() - started,
                self._ctx(),
            )
            return stats.bytes_received
        available = {**held, **received}
        staged: dict[tuple[int, int], mixtral.ExpertWeights] = {}
        missing: list[tuple[int, int]] = []
        loaded = 0
        src = (
            source_mod.open_source(self.source_name)
            if from_source and self.source_name is not None
            else None
        )
        for layer in range(cfg.num_layers):
            for slot, logical in enumerate(
                new_placement.experts_on_rank(layer, new_rank, new_num_ranks)
            ):
                weights = available.get((layer, logical))
                if weights is None and src is not None:
                    weights = mixtral.load_expert(
                        src,
                        layer,
                        logical,
                        dtype=self.dtype,
                        device=self.device,
                    )
                    available[(layer, logical)] = weights
                    loaded += 1
                if weights is None:
                    missing.append((layer, logical))
                else:
                    staged[(layer, slot)] = weights
        if loaded:
            log.info("read %d experts from %s (%s)", loaded, self.source_name, self._ctx())
        if missing:
            raise RuntimeError(
                f"stage_experts: the moves bring no weights for (layer, expert) {missing[:5]} "
                f"({len(missing)} missing) that new rank {new_rank} needs ({self._ctx()})"
            )
        stage_id = epoch if stage is None else stage
        with self._lock:
            self._staged = _Staged(
                stage=stage_id,
                placement=new_placement,
                rank=new_rank,
                num_ranks=new_num_ranks,
                experts=staged,
            )
        log.info(
            "staged %d slots for stage %d (new rank %d/%d): sent %d, received %d experts "
            "(%d B) in %.2fs (%s)",
            len(staged),
            stage_id,
            new_rank,
            new_num_ranks,
            stats.sent,
            stats.received,
            stats.bytes_received,
            time.monotonic() - started,
            self._ctx(),
        )
        return stats.bytes_received

    def _held_experts(self) -> dict[tuple[int, int], mixtral.ExpertWeights]:
        """{(layer, logical): weights} of the live slots."""
        with self._lock:
            placement, rank, num_ranks = self.placement, self.rank, self.num_ranks
            experts = dict(self.experts)
        if placement is None or rank is None or num_ranks is None:
            return {}
        out: dict[tuple[int, int], mixtral.ExpertWeights] = {}
        for layer in range(placement.num_layers):
            for slot, logical in enumerate(placement.experts_on_rank(layer, rank, num_ranks)):
                if (layer, slot) in experts:
                    out.setdefault((layer, logical), experts[(layer, slot)])
        return out

    def discard_staged(self) -> None:
        """Forget staged experts (a resize that failed)."""
        with self._lock:
            self._staged = None

    def _commit_staged(self, stage: int | None, *, num_ranks: int) -> None:
        with self._lock:
            staged = self._staged
            if staged is None or (stage is not None and staged.stage != stage):
                have = None if staged is None else staged.stage
                raise RuntimeError(f"no experts staged for stage {stage} (have {have})")
            if staged.num_ranks != num_ranks:
                raise RuntimeError(
                    f"experts of stage {staged.stage} were staged for {staged.num_ranks} ranks, "
                    f"not {num_ranks}"
                )
            self.experts = staged.experts
            self.placement = staged.placement
            self.rank = staged.rank
            self.num_ranks = staged.num_ranks
            self._staged = None

    # -- activation ----------------------------------------------------------------------
    def activate(
        self, epoch: int, *, rank: int, num_ranks: int, placement: policy.Placement
    ) -> None:
        """Serve with epoch's step group as `rank` of `num_ranks` under `placement`.

        Called while no step runs. Staged experts (if any) become live; without them the live
        slots must already match `placement`. Groups of older epochs are destroyed.
        """
        self._check_fail("activate")
        cfg, _ = self._require_model()
        grp, group_rank = self._group(epoch, STEP_ROLE)
        if grp.world_size != num_ranks or group_rank != rank:
            raise ValueError(
                f"activate: epoch {epoch}'s step group has this worker as {group_rank}/"
                f"{grp.world_size}, not {rank}/{num_ranks} ({self._ctx()})"
            )
        placement.validate(num_ranks)
        with self._lock:
            staged = self._staged
        if staged is not None:
            if staged.rank != rank or not staged.placement.equals(placement):
                raise ValueError(
                    f"activate: the staged experts (stage {staged.stage}) are for rank "
                    f"{staged.rank}/{staged.num_ranks} under another placement ({self._ctx()})"
                )
            self._commit_staged(None, num_ranks=num_ranks)
        else:
            wanted = [
                placement.experts_on_rank(layer, rank, num_ranks) for layer in range(cfg.num_layers)
            ]
            current = (
                None
                if self.placement is None or self.rank is None or self.num_ranks is None
                else [
                    self.placement.experts_on_rank(layer, self.rank, self.num_ranks)
                    for layer in range(cfg.num_layers)
                ]
            )
            if current != wanted:
                raise ValueError(
                    f"activate: this rank's slots do not hold the experts rank {rank}/{num_ranks} "
                    f"needs under the new placement: stage them first ({self._ctx()})"
                )
            with self._lock:
                self.placement = placement
                self.rank = rank
                self.num_ranks = num_ranks
        with self._lock:
            old_keys = [key for key in self._groups if key[0] < epoch]
            self.epoch = epoch
            self._backend = self._make_backend(grp)
        for key in old_keys:
            self._drop_group(key)
        log.info("activated epoch %d with %d slots (%s)", epoch, len(self.experts), self._ctx())

    def _make_backend(self, grp: group_mod.StatelessGroup) -> mixtral.ExpertBackend:
        """The expert-parallel backend over the step group (it keys slots by global index)."""
        placement, rank, num_ranks = self.placement, self.rank, self.num_ranks
        if placement is None or rank is None or num_ranks is None:
            raise RuntimeError(f"no placement to serve ({self._ctx()})")
        base = placement.slots_of_rank(rank, num_ranks).start
        slots = {(layer, base + slot): w for (layer, slot), w in self.experts.items()}
        return ep_mod.ExpertParallelBackend(grp, placement, slots, rank=rank)

    # -- the step ------------------------------------------------------------------------
    def execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        """Apply step.control, free KV, run this rank's batch, sample; never raises.

        An idle rank (no batch) still runs the forward pass with no tokens, so it joins the
        expert collectives. When the control fails, or the batch is bad, the rank runs an empty
        batch instead (its peers must not hang in a collective) and reports the problem in
        StepOutput.error, as it does any exception. A failed forward pass leaves each sequence's
        KV cache as it was before the step, so the step can be retried as it was.
        """
        rank = -1 if self.rank is None else self.rank
        out = step_mod.StepOutput(rank=rank, step_id=step.step_id)
        batch = step.batches.get(rank) or step_mod.RankBatch()
        errors: list[str] = []
        run_batch = True
        try:
            self._check_fail("execute_step")
            if step.control:
                self._apply_control(step.control)
        except Exception as exc:  # noqa: BLE001 - reported; the rank still joins the step
            log.exception("step %d: control failed, running empty (%s)", step.step_id, self._ctx())
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
            fwd = mixtral.ForwardBatch(
                seq_ids=[s.seq_id for s in seqs],
                token_ids=[list(s.token_ids) for s in seqs],
                start_pos=[s.start_pos for s in seqs],
            )
            load = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
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
                out.tokens[s.seq_id] = sample_token(logits[i], s.sampling, s.num_generated)
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
        kv: mixtral.KVCache,
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

    def _apply_control(self, control: Mapping[str, Any]) -> None:
        for key, value in control.items():
            if key == CONTROL_EXPERT_EPOCH:
                if self.num_ranks is None:
                    raise RuntimeError("expert_epoch control before any placement")
                self._commit_staged(int(value), num_ranks=self.num_ranks)
                grp, _ = self._group(self._require_epoch(), STEP_ROLE)
                with self._lock:
                    self._backend = self._make_backend(grp)
                log.info("committed staged experts of stage %s (%s)", value, self._ctx())
            else:
                log.debug("ignoring unknown control %r (%s)", key, self._ctx())

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

    def drop_epoch(self, epoch: int) -> None:
        """Destroy the step and transfer groups of `epoch` (a resize undone before its switch).

        The active epoch cannot be dropped.
        """
        if epoch == self.epoch:
            raise ValueError(f"epoch {epoch} is the active one ({self._ctx()})")
        for role in ROLES:
            self._drop_group((epoch, role))

    def shutdown(self) -> None:
        """Destroy every group and drop weights."""
        with self._lock:
            keys = list(self._groups)
        for key in keys:
            self._drop_group(key)
        with self._lock:
            self._backend = None
            self._staged = None
        log.info("shut down (%s)", self._ctx())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _host_ip() -> str:
    """This host's address for peers: env MOE_POD_IP, else the host name's address."""
    env = os.environ.get("MOE_POD_IP")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
