"""Starting DP ranks' actors for `RayExecutor` (`start_ranks`): each DP rank's placement group
(T x P bundles on one node, `ray_bundles`), its leader (`ray_actor.RankActor`), its pipeline
stage actors (`ray_pipeline`) and every TP follower (`ray_tensor`), checked and ordered."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.exceptions
import ray.util

from moe_contract import protocol
from moe_runtime.executor import (
    base,
    guards,
    niceness,
    ray_actor,
    ray_bundles,
    ray_calls,
    ray_pipeline,
    ray_tensor,
    roster,
)
from moe_runtime.rank import hooks as hooks_mod

log = logging.getLogger(__name__)

RANK_RESOURCE = ray_actor.RANK_RESOURCE


def start_ranks(
    count: int,
    *,
    first_label: int,
    use_gpu: bool,
    dtype: str,
    timeout: float,
    driver_node: str,
    existing: Sequence[Mapping[str, Any]],
    spare: bool = False,
    hooks: hooks_mod.HooksFactory | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    micro_batch_tokens: int | None = None,
    env: Mapping[str, str] | None = None,
    expert_layout: str = "leader",
) -> list[ray_actor.Member]:
    """Placement groups, then actors; wait until all answer; sort (`base.order_ranks`, with
    the nodes of existing ranks counted); label from first_label. `spare`: warm spares (below
    the serving ranks' CPU priority); `hooks`: the factory of their rank hooks. Each DP rank's
    placement group holds T x P bundles on one node (`bundles`), bundle s x T + t holding TP
    rank t of pipeline stage s: the leader in bundle 0 leads stage 0's TP followers
    (`ray_tensor`) and the stage actors (`ray_pipeline`), each leading its own stage's.
    `micro_batch_tokens`, `expert_layout`: the leader's (`pipeline_group.micro_batches`,
    `model.tensor_parallel`). `existing`: the infos of running ranks (`node_id`, `ip`); ranks on
    two nodes that report one IP are refused (`guards.check_node_ips`). `env`: the head's
    variables every actor gets (`guards.rank_env`)."""
    bundle_list = ray_bundles.bundles(tp_size * pp_size, use_gpu=use_gpu)
    bundle = bundle_list[0]
    pgs = [ray.util.placement_group(bundle_list, strategy="STRICT_PACK") for _ in range(count)]
    actors: list[Any] = []
    followers: list[tuple[Any, ...]] = []
    stage_actors: list[tuple[Any, ...]] = []
    try:
        try:
            ray.get([pg.ready() for pg in pgs], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{count} placement groups of {len(bundle_list)} x {bundle} were not scheduled "
                f"within {timeout}s: the cluster offers {ray_bundles.free(RANK_RESOURCE)} free "
                f"{RANK_RESOURCE}"
            ) from None
        device = "cuda" if use_gpu else "cpu"
        # A spare's process lowers its priority before it imports the runtime (~3 s of CPU);
        # a grow's (ranks start beside serving ones: `existing`) takes the serving ranks'
        # priority (the grow waits for it; a no-op where the cluster's workers start there,
        # `cluster.WORKER_NICENESS`, but a worker at Ray's default niceness 15 beside busy
        # ranks took ~90 s to import). Either hook is a runtime_env of its own (a process of
        # its own, never a pooled idle worker), with the head's copied variables (`env`).
        hook = niceness.SPARE_SETUP_HOOK if spare else niceness.GROW_SETUP_HOOK
        leader_options = guards.actor_env_options(
            env or {}, {niceness.SETUP_HOOK_ENV: hook} if spare or existing else {}
        )
        mesh = {"device": device, "expert_layout": expert_layout}  # every actor of a DP rank
        follower = {**mesh, "tp_size": tp_size, "stages": pp_size, "spare": spare}
        for i, pg in enumerate(pgs):
            # Bundle s x T + t; the followers take the leader's options (a whole DP rank).
            label = first_label + i
            tp = [
                tuple(
                    ray_tensor.RemoteFollower.options(
                        **ray_bundles.options(pg, s * tp_size + t, use_gpu, leader_options)
                    ).remote(label=label, tp_rank=t, stage=s, **follower)
                    for t in range(1, tp_size)
                )
                for s in range(pp_size)
            ]
            stages = tuple(
                ray_pipeline.RemoteStage.options(
                    **ray_bundles.options(pg, s * tp_size, use_gpu, leader_options)
                ).remote(label=label, stage=s, size=pp_size, followers=tp[s], **mesh)
                for s in range(1, pp_size)
            )
            stage_actors.append(stages)
            # every actor of the DP rank besides its leader (killed with it)
            followers.append(tp[0] + stages + tuple(f for fs in tp[1:] for f in fs))
            actors.append(
                ray_actor.RemoteRankActor.options(
                    **ray_bundles.options(pg, 0, use_gpu, leader_options)
                ).remote(
                    label=label,
                    device=device,
                    dtype=dtype,
                    spare=spare,
                    hooks=hooks,
                    followers=tp[0],
                    stages=stages,
                    micro_batch_tokens=micro_batch_tokens,
                    expert_layout=expert_layout,
                )
            )
        infos = ray_calls.get_all(
            [a.ready.remote() for a in actors],
            list(range(first_label, first_label + count)),
            what="ready",
            timeout=timeout,
        )
        for label, info in zip(range(first_label, first_label + count), infos, strict=True):
            protocol.check(info, where=f"rank {label}")
        guards.check_node_ips(infos, existing=existing)
    except BaseException:
        for a in [*actors, *(f for fs in followers for f in fs)]:
            ray.kill(a)
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        raise
    order = base.order_ranks(
        infos, driver_node=driver_node, existing_nodes=[str(i["node_id"]) for i in existing]
    )
    started = [
        roster.Member(
            label=first_label + offset,
            handle=ray_actor.RankHandle(actors[i], pgs[i], followers[i], stage_actors[i]),
            info=infos[i],
        )
        for offset, i in enumerate(order)
    ]
    ray.get([m.handle.actor.execute_method.remote("set_label", m.label) for m in started])
    log.info(
        "started ranks %s on nodes %s",
        [m.label for m in started],
        [m.info["node_id"][:8] for m in started],
    )
    return started
