"""A pipeline stage prefetches the experts of a placement its leader stages
(`StageWorker.prefetch`, beside the steps), so that the step that switches to it
(`StageWorker.follow`) reads nothing from the model source; without a prefetch, that step
reads them itself (what every stage did before)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod
from moe_runtime.rank import stage_worker
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
