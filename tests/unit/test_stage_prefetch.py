"""A pipeline stage prefetches the experts of a placement its leader stages
(`StageWorker.prefetch`, beside the steps), so that the step that switches to it
(`StageWorker.follow`) reads nothing from the model source; without a prefetch, that step
reads them itself (what every stage did before). The prefetch runs the leaders' moves of
its layers peer to peer with the other DP ranks' stages (a real gloo group) and reads only
what no move brings; a stage retains what earlier placements served (as its leader), and a
warm spare's stage pre-stages its layers' experts when its leader pre-stages (wired through
a `RankWorker`)."""

from __future__ import annotations

import concurrent.futures
import pathlib
from typing import Any

import pytest
import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import stage_worker, worker
from tests.support import checkpoints

EXPERTS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("mixtral")
    checkpoints.build(path)
    return path


def _stage(model_dir: pathlib.Path) -> stage_worker.StageWorker:
    """Stage 1 of 2, loaded as DP rank 1 of 2 (experts 3..5 of its MoE layers)."""
    stage = stage_worker.StageWorker(stage=1, size=2, device="cpu")
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    two = policy.identity(layers, EXPERTS, EXPERTS, 2)
    stage.load(str(model_dir), "float32", 1, 2, two)
    return stage


def _assert_holds_source_experts(stage: stage_worker.StageWorker, model_dir: pathlib.Path) -> None:
    src = source_mod.open_source(str(model_dir))
    assert stage.stage is not None and stage.placement is not None
    first = stage.stage.moe_layers[0]
    for (layer, slot), held in stage.experts.items():
        logical = int(stage.placement.phy2log[layer, slot])
        want = experts_mod.load_expert(
            src, first + layer, logical, dtype=torch.float32, device="cpu"
        )
        for part, tensor in want.tensors().items():
            assert torch.equal(held[part], tensor), (layer, logical, part)


def test_a_prefetched_placement_is_followed_without_reading_the_source(
    model_dir: pathlib.Path,
) -> None:
    stage = _stage(model_dir)
    assert stage.stage is not None
    moe_layers = stage.stage.num_moe_layers
    assert moe_layers >= 1
    one = policy.identity(
        source_mod.open_source(str(model_dir)).config.num_moe_layers, EXPERTS, EXPERTS, 1
    )
    # the shrink to one rank: rank 0 holds every expert; this stage holds 3..5 of each layer
    assert stage.prefetch(one, 0, 1) == 3 * moe_layers
    assert stage.prefetch(one, 0, 1) == 0  # a second prefetch of the same finds them held
    stage.follow((7, 7, 0, 1), one)
    assert stage.reads_in_step == 0
    assert len(stage.experts) == EXPERTS * moe_layers
    _assert_holds_source_experts(stage, model_dir)
    ping = stage.ping()
    assert (ping["reads_in_step"], ping["prefetched"]) == (0, 3 * moe_layers)

    # without a prefetch, the step that switches reads what the stage lacks
    cold = _stage(model_dir)
    cold.follow((7, 7, 0, 1), one)
    assert cold.reads_in_step == 3 * moe_layers
    _assert_holds_source_experts(cold, model_dir)


def test_a_later_prefetch_replaces_an_earlier_one(model_dir: pathlib.Path) -> None:
    """A staging that was undone (its prefetch kept nothing live) and another one staged:
    only the experts of the last one stay prefetched, and a switch back to what the stage
    served reads nothing."""
    stage = _stage(model_dir)
    assert stage.stage is not None
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    one = policy.identity(layers, EXPERTS, EXPERTS, 1)
    two = policy.identity(layers, EXPERTS, EXPERTS, 2)
    assert stage.prefetch(one, 0, 1) == 3 * stage.stage.num_moe_layers
    assert stage.prefetch(two, 1, 2) == 0  # what it serves: nothing to read, nothing kept
    assert stage._prefetched == {}
    stage.follow((8, 8, 1, 2), two)
    assert stage.reads_in_step == 0
    _assert_holds_source_experts(stage, model_dir)


def test_a_spare_stage_pre_stages_its_layers_and_a_grow_then_reads_nothing(
    model_dir: pathlib.Path,
) -> None:
    """A warm spare's stage (loaded with no placement) pre-stages the experts of its layers
    among the keys its leader pre-stages (keys of stage 0's layers are not its own); a
    later prefetch of the grow's placement and the switching step then read nothing, and
    the stage serves the source's weights; a replan's drop keeps only what it still wants."""
    stage = stage_worker.StageWorker(stage=1, size=2, device="cpu")
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    stage.load(str(model_dir), "float32", 0, 1, None)  # a spare: no slot yet
    assert stage.stage is not None
    first, stop = stage.stage.moe_layers
    assert stop == layers and first >= 1  # stage 0 holds MoE layers too
    # the grow 2 -> 3 gives the spare (rank 2) experts 4 and 5 of every layer
    three = policy.identity(layers, EXPERTS, EXPERTS, 3)
    keys = [(layer, logical) for layer in range(layers) for logical in (4, 5)]
    mine = 2 * (stop - first)
    assert stage.prestage(keys) == mine
    assert stage.prestage(keys) == 0  # held already
    assert stage.ping()["prestaged"] == mine
    assert stage.prefetch(three, 2, 3) == 0
    stage.follow((9, 9, 2, 3), three)
    assert stage.reads_in_step == 0 and stage.prefetched == 0
    _assert_holds_source_experts(stage, model_dir)
    assert stage.ping()["prestaged"] == 0  # it serves them now

    spare = stage_worker.StageWorker(stage=1, size=2, device="cpu")
    spare.load(str(model_dir), "float32", 0, 1, None)
    spare.prestage(keys)
    assert spare.drop_prestaged([(layer, 5) for layer in range(layers)]) == stop - first
    assert spare.prefetch(three, 2, 3) == stop - first  # expert 4 of each of its layers


class _InProcessStages:
    """`pipeline_group.Stages` over `StageWorker`s in this process (calls run at once)."""

    def __init__(self, workers: list[stage_worker.StageWorker]) -> None:
        self.workers = workers

    def send(self, method: str, *args: Any) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        return list(pending)


def test_a_spare_and_a_serving_leader_have_their_stages_move_the_later_layers_experts(
    model_dir: pathlib.Path,
) -> None:
    """`prestage_experts` on a serving DP rank's leader (every expert) and on a warm spare's
    (none), at P = 2: the leaders move stage 0's layers and leave the later stage's out (the
    spare's leader holds zeros for them), their stages move those between themselves over
    their transfer group (the spare's stage reads nothing from the source); through shared
    memory the leaders get no move (`every_move` names them all); `drop_prestaged` reaches
    the spare's stage too."""
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    stages = [stage_worker.StageWorker(stage=1, size=2, device="cpu") for _ in range(2)]
    leaders = [
        worker.RankWorker(
            device="cpu", dtype="float32", pipeline=_InProcessStages([st]), pipeline_size=2
        )
        for st in stages
    ]
    one = policy.identity(layers, EXPERTS, EXPERTS, 1)
    leaders[0].load_weights(source=str(model_dir), rank=0, num_ranks=1, placement=one)
    leaders[1].load_weights(source=str(model_dir), rank=0, num_ranks=1, placement=None)
    assert stages[1].stage is not None
    first, stop = stages[1].stage.moe_layers
    spec = group_mod.GroupSpec.local(2, epoch=3)

    def moves(logicals: tuple[int, ...]) -> list[moves_mod.ExpertMove]:
        return [
            moves_mod.ExpertMove(layer=layer, logical=e, src_rank=0, dst_rank=1, dst_slot=0)
            for layer in range(layers)
            for e in logicals
        ]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(lead.groups.join_group, spec, r, role=groups_mod.TRANSFER)
            for r, lead in enumerate(leaders)
        ]
        [j.result() for j in joins]
        first_batch = moves((1, 4))
        list(pool.map(lambda lead: lead.prestaged.prestage_experts(3, first_batch), leaders))
        # through shared memory: the leaders' own moves came another way, the stages' not
        second = moves((2,))
        list(
            pool.map(
                lambda lead: lead.prestaged.prestage_experts(3, [], every_move=second), leaders
            )
        )
    spare, spare_stage = leaders[1].slots, stages[1]
    later = {(m.layer, m.logical) for m in first_batch if m.layer >= first}
    ahead = spare.ahead.experts
    assert later <= set(ahead)
    assert all(not any(t.any() for t in ahead[k].tensors().values()) for k in later)
    assert any(t.any() for t in ahead[(0, 1)].tensors().values())  # moved by leaders
    assert spare_stage.ping()["prestaged"] == 3 * (stop - first)
    assert spare_stage.prestaged_reads == 0  # all moved from the serving rank's stage
    src = source_mod.open_source(str(model_dir))
    for (layer, logical), held in spare_stage._prestaged.items():
        want = experts_mod.load_expert(src, first + layer, logical, dtype=torch.float32)
        assert all(torch.equal(held[p], t) for p, t in want.tensors().items())
    keep = [(layer, 4) for layer in range(first, stop)]
    assert spare.ahead.drop_prestaged(keep) == len(keep)
    assert spare_stage.ping()["prestaged"] == len(keep)
    for st in stages:
        st.shutdown()


def test_stages_move_their_layers_experts_peer_to_peer_and_read_only_what_no_move_brings(
    model_dir: pathlib.Path,
) -> None:
    """The shrink 2 -> 1 at P = 2: the leaders' moves (every MoE layer) are run by stage 1 of
    both DP ranks for its layers over their own transfer group, peer to peer (DP rank 1's
    stage, leaving, only sends); a key no move brings (a lost rank's) is read from the source;
    the switch then reads nothing and serves the source's weights."""
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    two = policy.identity(layers, EXPERTS, EXPERTS, 2)
    one = policy.identity(layers, EXPERTS, EXPERTS, 1)
    stages = [stage_worker.StageWorker(stage=1, size=2, device="cpu") for _ in range(2)]
    for rank, stage in enumerate(stages):
        stage.load(str(model_dir), "float32", rank, 2, two)
    assert stages[0].stage is not None
    first, stop = stages[0].stage.moe_layers
    spec = group_mod.GroupSpec.local(2, epoch=4)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: stages[r].join(spec, r, "transfer"), range(2)))
        # expert 5 of every layer is not moved (as if its holder was lost)
        moves = [
            moves_mod.ExpertMove(layer=layer, logical=e, src_rank=1, dst_rank=0, dst_slot=e)
            for layer in range(layers)
            for e in (3, 4)
        ]
        reads = list(
            pool.map(
                lambda r: stages[r].prefetch(one, 0 if r == 0 else None, 1, 4, moves), range(2)
            )
        )
    assert reads == [stop - first, 0]  # expert 5 of each of its layers, from the source
    stages[0].follow((5, 5, 0, 1), one)
    assert stages[0].reads_in_step == 0
    assert len(stages[0].experts) == EXPERTS * (stop - first)
    _assert_holds_source_experts(stages[0], model_dir)
    for stage in stages:
        stage.shutdown()


def test_a_stage_retains_what_earlier_placements_served_as_its_leader_does(
    model_dir: pathlib.Path,
) -> None:
    """Two placement changes in a row (a grow 2 -> 3, then a reshuffle), then the shrink back:
    the leaders' planner moves nothing its leader retains, and the stage holds those experts
    too (retained at each switch, bounded as the leader's), so it reads nothing."""
    stage = _stage(model_dir)  # DP rank 1 of 2: experts 3..5
    assert stage.stage is not None
    layers = source_mod.open_source(str(model_dir)).config.num_moe_layers
    two = policy.identity(layers, EXPERTS, EXPERTS, 2)
    three = policy.identity(layers, EXPERTS, EXPERTS, 3)  # rank 1: experts 2, 3
    shuffled = policy.Placement.from_phy2log(
        torch.tensor([[1, 0, 2, 3, 5, 4]] * layers), EXPERTS
    )  # a reshuffle that leaves rank 1 of 3 its experts 2, 3
    moe_layers = stage.stage.num_moe_layers
    for token, placement, reads in (((2, 2, 1, 3), three, moe_layers), ((3, 3, 1, 3), shuffled, 0)):
        assert stage.prefetch(placement, 1, 3) == reads
        stage.follow(token, placement)
    assert stage.prefetch(two, 1, 2) == 0  # 4, 5: retained since the grow
    stage.follow((4, 4, 1, 2), two)
    assert stage.reads_in_step == 0
    _assert_holds_source_experts(stage, model_dir)


def test_a_new_ranks_stages_get_their_non_expert_tensors_from_their_peers(
    model_dir: pathlib.Path,
) -> None:
    """A grow's new DP rank at P = 2 loads placeholders (`weight_source` peer): its stage
    holds zeros, not the source's tensors; the leaders' non-expert transfer runs the
    stages' too (`RankGroups.transfer_non_expert`'s hook), each over its own transfer group,
    so the new rank's stage then holds its serving peer's tensors, and the bytes received
    count the stage's."""
    src = source_mod.open_source(str(model_dir))
    stages = [stage_worker.StageWorker(stage=1, size=2, device="cpu") for _ in range(2)]
    leaders = [
        worker.RankWorker(
            device="cpu", dtype="float32", pipeline=_InProcessStages([st]), pipeline_size=2
        )
        for st in stages
    ]
    one = policy.identity(src.config.num_moe_layers, EXPERTS, EXPERTS, 1)
    leaders[0].load_weights(source=str(model_dir), rank=0, num_ranks=1, placement=one)
    leaders[1].load_weights(
        source=str(model_dir), rank=1, num_ranks=2, placement=None, placeholder=True
    )
    serving, new = (st.model for st in stages)
    assert serving is not None and new is not None
    want = serving.non_expert_state()
    assert want and all(not t.any() for t in new.non_expert_state().values())
    stage_bytes = sum(t.numel() * t.element_size() for t in want.values())
    spec = group_mod.GroupSpec.local(2, epoch=6)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(lead.groups.join_group, spec, r, role=groups_mod.TRANSFER)
            for r, lead in enumerate(leaders)
        ]
        [j.result() for j in joins]
        received = list(
            pool.map(
                lambda lead: lead.groups.transfer_non_expert(6, src_ranks=[0], dst_ranks=[1]),
                leaders,
            )
        )
    got = new.non_expert_state()
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    _, leader_model = leaders[1].loaded.require("test")
    _, serving_leader = leaders[0].loaded.require("test")
    leader_state = serving_leader.non_expert_state()
    leader_bytes = sum(t.numel() * t.element_size() for t in leader_state.values())
    assert all(torch.equal(leader_model.non_expert_state()[n], t) for n, t in leader_state.items())
    assert received == [0, leader_bytes + stage_bytes]
    for st in stages:
        st.shutdown()
