"""Failures never stop serving: the runtime shrinks around a lost rank by itself, and grows back.

Detection: the executor's heartbeat (`Executor.heartbeat`, `health.Heartbeat.start`) finds a dead rank at once (its
ping fails) and a hung one after `hang_timeout` s, or `step_grace` s once a step is past the
deadline derived from observed step times; a hung rank is fenced (killed) so no collective
waits on it. A failed step (`Engine.on_step_failure`) names the lost ranks too.

Shrink (stage `Recovering`, on the engine thread between two steps: requests queue, none is
refused), `recover_now`:
1. the sequences of the lost ranks move to survivors and re-run from prompt + generated tokens
   (`Engine.migrate_from`: same `num_generated`, so greedy and seeded sampling give the same
   tokens and a stream goes on with the next token);
2. an EPLB commit caught in flight is reverted on the survivors (one placement everywhere);
3. the lost workers are removed; the placement for the survivors is planned
   (`moves.plan_recovery`): experts only a lost rank held come from replicas on survivors, else
   from the model source;
4. a new epoch's groups over the survivors are built, the experts staged, the step graph
   switched (survivor i becomes rank i) and confirmed; the engine steps the survivors.

Any failure in it leaves the record Failed and no step path; the next step fails again, which
calls `recover_now` again (it starts over with a fresh epoch), so the state always converges
or requests fail after `EngineConfig.max_step_retries` failed steps (the engine's known state).

Grow back (`ElasticConfig.auto_recover`): a thread asks the coordinator for the size before
the loss (a normal resize, trigger "auto_recover") once the executor has free rank slots again
(a replacement Ray node offers `moe_rank`) or warm spare ranks cover it (then at once, and the
replacement node becomes a spare). A request for that size by anyone returns the same
resize (the coordinator's same-target rule).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from moe_runtime.elastic import coordinator as coord_mod
from moe_runtime.elastic import rebalance, records, resize
from moe_runtime.engine import seam
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)

GROW_BACK_POLL_SECONDS = 0.5
GROW_BACK_RETRY_SECONDS = 10.0


class Recovery:
    """Shrink around lost ranks and grow back (see the module docstring). Call `attach()`."""

    def __init__(self, ctx: resize.ResizeContext, *, coordinator: coord_mod.Coordinator) -> None:
        """ctx: the serving process's pieces a resize changes, shared with the resizes (the
        engine, the executor, the serving state, the live config, the warm spares)."""
        self.ctx = ctx
        self.coordinator = coordinator
        #: The size before the first loss while the runtime serves below it (None otherwise):
        #: the size autoRecover grows back to.
        self.full_size: int | None = None
        #: The lost ranks (status entries) while the runtime serves below `full_size`.
        self.lost: list[dict[str, Any]] = []
        self.recoveries = 0
        self._stop = threading.Event()
        self._grow_thread: threading.Thread | None = None
        self._retry_at = 0.0
        #: The lost ranks of a recovery that found no survivor (recorded once: every step
        #: the engine retries meets them again until a grow repairs the deployment).
        self._no_survivor: frozenset[int] | None = None

    def attach(self) -> None:
        """Register with the engine, start the heartbeat and (autoRecover) the grow-back loop."""
        self.ctx.engine.on_step_failure(self._on_step_failure)
        self.ctx.executor.heartbeat.start(
            interval=self.ctx.config.heartbeat_interval,
            hang_timeout=self.ctx.config.hang_timeout,
            on_lost=self._on_lost,
        )
        if self.ctx.config.auto_recover:
            self._grow_thread = threading.Thread(
                target=self._grow_back_loop, name="auto-recover", daemon=True
            )
            self._grow_thread.start()

    def close(self) -> None:
        """Stop detecting and recovering (the process is shutting down); idempotent."""
        self._stop.set()
        self.ctx.executor.heartbeat.stop()

    # -- triggers ------------------------------------------------------------------------
    def _on_lost(self, lost: dict[int, str]) -> None:
        """Heartbeat thread: ranks were found dead or hung (and fenced)."""
        log.error("ranks lost: %s; recovering at the next step boundary", lost)
        self.ctx.engine.call_at_boundary(self.recover_now)

    def _on_step_failure(self, failure: seam.StepFailure) -> None:
        """Engine thread, before the retry: repair here when ranks are lost."""
        if self.ctx.executor.lost_ranks() or not self.ctx.executor.has_step_path():
            self.recover_now()

    # -- the shrink ----------------------------------------------------------------------
    def recover_now(self) -> None:
        """Shrink around every lost active rank; a no-op when none is lost. Engine thread."""
        if self._stop.is_set():
            return  # shutting down: ranks die with the process, nothing to recover
        lost = self.ctx.executor.lost_ranks()
        live = set(self.ctx.executor.ranks)
        gone = [r for r in self.ctx.engine.active_ranks() if r not in live or r in lost]
        if not gone and self.ctx.executor.has_step_path():
            return
        survivors = [r for r in self.ctx.executor.ranks if r not in lost]
        if not survivors:
            if self._no_survivor == frozenset(gone):
                return  # recorded already: autoRecover's grow-back (or a resize) repairs it
            self._no_survivor = frozenset(gone)
        else:
            self._no_survivor = None
        old_n = self.ctx.serving.num_ranks
        infos = self.ctx.executor.rank_infos()
        seen = [h.lost_at for label, h in lost.items() if label in gone and h.lost_at is not None]
        info = records.RecoveryInfo(detected_at=_wall(min(seen, default=time.monotonic())))
        beats = [h.last_ok for label, h in lost.items() if label in gone]
        if beats:
            info.last_heartbeat_at = _wall(min(beats))
        info.ranks_lost = [
            {
                "rank": label,
                "pod": infos.get(label, {}).get("pod"),
                "node_id": infos.get(label, {}).get("node_id"),
                "pid": infos.get(label, {}).get("pid"),
                "reason": lost[label].reason if label in lost else "gone",
            }
            for label in gone
        ]
        record = self.coordinator.begin_recovery(from_size=old_n, to_size=len(survivors), info=info)
        log.error(
            "recovery %s: ranks %s lost; shrinking %d -> %d ranks",
            record.resize_id,
            gone,
            old_n,
            len(survivors),
        )
        try:
            self._shrink(record, info, gone=gone, survivors=survivors, old_n=old_n)
        except Exception as exc:  # noqa: BLE001 - known state: no step path; retried next step
            log.exception("recovery %s failed; the next step tries again", record.resize_id)
            self.coordinator.end_recovery(record, error=f"{type(exc).__name__}: {exc}")
            return
        info.recovered_at = time.time()
        self.recoveries += 1
        self.full_size = max(self.full_size or 0, old_n)
        self.lost += [
            {**r, "state": lost[r["rank"]].state} for r in info.ranks_lost if r["rank"] in lost
        ]
        self.coordinator.end_recovery(record)
        log.warning(
            "recovery %s: serving at %d ranks %.2fs after the loss was detected "
            "(%d sequences re-run, experts %d from replicas, %d from the source, %d retained)",
            record.resize_id,
            len(survivors),
            info.recovered_at - info.detected_at,
            info.requests_rerun,
            info.experts_from_replicas,
            info.experts_from_source,
            info.experts_from_retained,
        )

    def _shrink(
        self,
        record: records.ResizeRecord,
        info: records.RecoveryInfo,
        *,
        gone: list[int],
        survivors: list[int],
        old_n: int,
    ) -> None:
        if not survivors:
            raise RuntimeError("no rank survived: nothing to shrink to")
        timeout = self.ctx.config.rpc_timeout
        moved = self.ctx.engine.migrate_from(gone).result()
        info.requests_rerun += len(moved)
        record.sequences_migrated += len(moved)
        self.ctx.serving.generation += 1  # a resize or rebalance planned before this is stale
        left, self.ctx.serving.left = self.ctx.serving.left, {}  # the survivors are renumbered
        if self.ctx.serving.committing is not None:
            self.ctx.executor.collective_rpc(
                "revert", self.ctx.serving.committing, ranks=survivors, timeout=timeout
            )
        dead = [r for r in gone if r in self.ctx.executor.rank_infos()]
        if dead:
            record.freed = self.ctx.executor.remove_ranks(dead)
        n = len(survivors)
        # The default lane: no step runs, and a transfer lane may be stuck on the lost peer.
        retained = rebalance.retained_keys(
            self.ctx.executor, survivors, timeout=timeout, background=False
        )
        plan = moves_mod.plan_recovery(
            self.ctx.load.total(),
            self.ctx.serving.placement,
            old_num_ranks=old_n,
            survivors=survivors,
            num_physical=self.ctx.config.num_physical_for(self.ctx.model_config.num_experts, n),
            held=rebalance.by_index(survivors, retained),
            tolerance=self.ctx.config.eplb_min_gain,
            units=self.ctx.config.slot_multiple,
        )
        target, moves, reads = self._choose(plan, left, survivors, old_n, retained)
        info.experts_from_replicas = plan.from_replicas
        info.experts_from_source, info.experts_from_retained = reads
        record.expert_moves += len(moves)
        epoch = self.ctx.serving.take_epoch()
        # The default lane: no step runs, and a transfer lane may be stuck on the lost peer.
        self.ctx.executor.build_groups(survivors, epoch=epoch, timeout=timeout, background=False)
        staging = weight_moves.Staging(
            epoch=epoch,
            moves=moves,
            target=target,
            members=survivors,
            new_num_ranks=n,
            from_source=True,
        )
        record.bytes_expert += rebalance.stage_experts(
            self.ctx.executor, staging, timeout=timeout, background=False
        )
        self.ctx.executor.switch(
            survivors, epoch=epoch, placement=target, timeout=self.ctx.config.switch_timeout
        )
        self.ctx.serving.serve(target, n)
        self.ctx.serving.epoch = epoch
        # Confirmed: the old groups go in the background (destroying one with a dead peer takes
        # ~0.5 s) while the survivors serve.
        self.ctx.executor.collective_rpc_async("retire_previous", ranks=list(range(n)))
        held = target.slot_counts(n)  # by new index; the engine still knows the old labels
        slots = {old: held[new] for new, old in enumerate(survivors)}
        self.ctx.engine.set_active_ranks(survivors, slots=slots).result()
        self.ctx.engine.relabel_ranks({old: new for new, old in enumerate(survivors)}).result()

    def _choose(
        self,
        plan: moves_mod.RecoveryPlan,
        left: dict[int, policy.Placement],
        survivors: list[int],
        old_n: int,
        retained: dict[int, set[rebalance.Key]],
    ) -> tuple[policy.Placement, list[moves_mod.ExpertMove], tuple[int, int]]:
        """The survivors' placement, its moves (less what they retain) and its source reads
        (`_source_reads`): the recovery plan's, or, when the lost ranks were the highest (the
        survivors keep their ranks) and this size served before (`Serving.left`), that size's
        placement if it fits the load and costs fewer copies and reads (as many: the better
        balanced one): a rank lost after a grow then heals like a shrink back, from what the
        survivors retain."""
        n = len(survivors)
        options = [(plan.target, rebalance.outstanding(plan.moves, survivors, {}, retained)[0])]
        earlier = left.get(n) if survivors == list(range(n)) else None
        if (
            earlier is not None
            and earlier.num_physical == plan.target.num_physical
            and rebalance.fits(
                self.ctx.load.total(),
                earlier,
                plan.target,
                n * self.ctx.config.slot_multiple,
                min_gain=self.ctx.config.eplb_min_gain,
            )
        ):
            moves = rebalance.moves_needed(
                self.ctx.serving.placement,
                earlier,
                old_num_ranks=old_n,
                new_num_ranks=n,
                members=survivors,
                retained=retained,
                senders=range(n),
            )
            options.append((earlier, moves))
        costs = [
            (len(moves), self._source_reads(target, plan.lost_only, survivors, retained))
            for target, moves in options
        ]
        # Fewest copies and source reads; as many (often none: the recovery plan keeps what
        # the survivors retain too), the better balanced placement.
        load = self.ctx.load.total()
        best = min(
            range(len(options)),
            key=lambda k: (
                costs[k][0] + costs[k][1][0],
                -policy.balancedness(load, options[k][0], n * self.ctx.config.slot_multiple),
            ),
        )
        (target, moves), reads = options[best], costs[best][1]
        if best:
            log.info(
                "recovery: size %d's earlier placement: %d copies, %d source reads",
                n,
                len(moves),
                reads[0],
            )
        return target, moves, reads

    @staticmethod
    def _source_reads(
        target: policy.Placement,
        lost_only: frozenset[rebalance.Key],
        survivors: list[int],
        retained: dict[int, set[rebalance.Key]],
    ) -> tuple[int, int]:
        """(experts only the lost ranks held that some survivor must read from the model
        source under `target`, those that every survivor needing them retains)."""
        n = len(survivors)
        read: set[rebalance.Key] = set()
        kept: set[rebalance.Key] = set()
        for i, label in enumerate(survivors):
            for layer in range(target.num_layers):
                for logical in target.experts_on_rank(layer, i, n):
                    key = (layer, logical)
                    if key in lost_only:
                        (kept if key in retained.get(label, ()) else read).add(key)
        return len(read), len(kept - read)

    # -- grow back -----------------------------------------------------------------------
    def _grow_back_loop(self) -> None:
        while not self._stop.wait(GROW_BACK_POLL_SECONDS):
            try:
                self._grow_back_once()
            except Exception:  # noqa: BLE001 - the loop must go on; the next poll retries
                log.exception("auto-recover: grow back failed")
                self._retry_at = time.monotonic() + GROW_BACK_RETRY_SECONDS

    def degraded(self) -> bool:
        """Serving below the size before a loss; clears itself once the size is back."""
        if self.full_size is not None and self.ctx.executor.num_ranks >= self.full_size:
            self.full_size, self.lost = None, []
        return self.full_size is not None

    def _grow_back_once(self) -> None:
        if not self.degraded():
            return
        target = self.full_size
        assert target is not None
        size = self.ctx.executor.num_ranks
        if self.coordinator.current is not None or time.monotonic() < self._retry_at:
            return
        free = self.ctx.executor.free_rank_slots()
        warm = len(self.ctx.spares.ready()) if self.ctx.spares is not None else 0
        pooled = len(self.ctx.rank_pool.ready()) if self.ctx.rank_pool is not None else 0
        if free is not None and free + warm + pooled < target - size:
            return
        log.info("auto-recover: %d free rank slots; growing %d -> %d", free or 0, size, target)
        rec = self.coordinator.request(target, trigger=records.TRIGGER_AUTO_RECOVER)
        self.coordinator.wait(rec)
        if not rec.succeeded:
            log.error("auto-recover: grow back to %d failed: %s", target, rec.message)
            self._retry_at = time.monotonic() + GROW_BACK_RETRY_SECONDS

    def status(self) -> dict[str, Any]:
        """`auto_recover` of GET /elastic_ep/status: target = the size it grows back to."""
        degraded = self.degraded()
        return {
            "enabled": self.ctx.config.auto_recover,
            "target": self.full_size if degraded and self.ctx.config.auto_recover else None,
        }


def _wall(monotonic: float) -> float:
    """time.time() of a time.monotonic() reading."""
    return time.time() - (time.monotonic() - monotonic)
